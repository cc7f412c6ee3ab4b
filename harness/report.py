"""The report: catch rates with their uncertainty, false positives and time to detection, built
only from trials.csv so that `sdc-report` can rebuild it from any run or sweep folder.

Definitions are DESIGN section 5's. Every rate carries its n and a 95% Wilson interval: a 3/3
catch rate is not a 100% detector, and the interval says so.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
from pathlib import Path

import pandas as pd

from harness import figures
from harness.outcome import CONTRACT_COLUMNS, EXTRA_COLUMNS
from harness.workloads import DTYPES
from injectors import bits

Z95 = 1.959963984540054


class ReportError(ValueError):
    pass


def wilson(k: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval for k successes in n trials."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    denom = 1 + Z95**2 / n
    center = (p + Z95**2 / (2 * n)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / denom
    return (max(0.0, center - half), min(1.0, center + half))


def bit_class(dtype: str, bit: object) -> str:
    """A configured bit as its class; a configured class stays itself."""
    if bit == "" or bit is None or (isinstance(bit, float) and math.isnan(bit)):
        return ""
    if str(bit) in bits.CLASSES:
        return str(bit)
    return bits.classify(DTYPES[dtype], int(float(bit)))


def load_trials(dirs: list[Path]) -> pd.DataFrame:
    """Every trials.csv under the given folders (a sweep folder holds one per job)."""
    files = []
    for d in dirs:
        if not d.is_dir():
            raise ReportError(f"{d}: not a folder")
        found = sorted(d.rglob("trials.csv"))
        if not found:
            raise ReportError(f"{d}: no trials.csv in it or below it")
        files += found
    frames = []
    for f in files:
        df = pd.read_csv(f, keep_default_na=False, na_values=[""], dtype={"trial_id": str})
        missing = [c for c in CONTRACT_COLUMNS if c not in df.columns]
        if missing:
            raise ReportError(f"{f}: missing columns: {', '.join(missing)}")
        for column in EXTRA_COLUMNS:
            if column not in df.columns:
                df[column] = ""
        frames.append(df.assign(run=str(f.parent)))
    df = pd.concat(frames, ignore_index=True)
    for col in (
        "fired",
        "detected",
        "contained",
        "attribution_correct",
        "golden_match",
        "replicas_agree",
    ):
        df[col] = df[col].map({True: True, False: False, "True": True, "False": False})
    df["bit_class"] = [bit_class(d, b) for d, b in zip(df["dtype"], df["bit"], strict=True)]
    for col in ("detected_by", "alert_detectors", "detectors"):
        df[col] = df[col].fillna("").astype(str)
    return df


def _rate(k: int, n: int) -> str:
    if n == 0:
        return "n=0"
    lo, hi = wilson(k, n)
    return f"{k}/{n} = {k / n:.0%} [{lo:.0%}, {hi:.0%}]"


def _table(rows: list[dict[str, object]]) -> str:
    if not rows:
        return "_none_\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _detectors(df: pd.DataFrame) -> list[str]:
    return sorted({d for ds in df["detectors"] for d in ds.split(";") if d})


def catch_rates(df: pd.DataFrame) -> list[dict[str, object]]:
    fired = df[df["fired"] == True]  # noqa: E712 (a column of booleans)
    rows = []
    for label, subset in (
        ("all fired", fired),
        ("non-masked", fired[fired["effect"] != "masked"]),
        ("harmful", fired[fired["effect"] == "harmful"]),
    ):
        row = {"trials": label, "any detector": _rate(int(subset["detected"].sum()), len(subset))}
        for d in _detectors(df):
            caught = subset["detected_by"].map(lambda s, d=d: d in s.split(";")).astype(bool)
            row[d] = _rate(int(caught.sum()), len(subset))
        rows.append(row)
    return rows


def cells(df: pd.DataFrame) -> list[dict[str, object]]:
    """Catch rate per (site, model, bit class), and whether the cell is a blind spot."""
    fired = df[df["fired"] == True]  # noqa: E712
    rows = []
    for (site, model, klass), g in fired.groupby(["site", "model", "bit_class"], dropna=False):
        harmful = g[g["effect"] == "harmful"]
        k_h, n_h = int(harmful["detected"].sum()), len(harmful)
        blind = n_h > 0 and wilson(k_h, n_h)[1] < 0.5
        rows.append(
            {
                "site": site,
                "model": model,
                "bit class": klass or "-",
                "catch rate (fired)": _rate(int(g["detected"].sum()), len(g)),
                "catch rate (harmful)": _rate(k_h, n_h),
                "effects": ", ".join(f"{e} {c}" for e, c in g["effect"].value_counts().items()),
                "blind spot": "**yes**" if blind else "no",
            }
        )
    return rows


def sees_and_misses(df: pd.DataFrame) -> list[dict[str, object]]:
    """Per scenario (site, model, scope, persistence): what share of fired trials each detector
    caught, as measured. A dash: the detector was not on in those trials."""
    fired = df[df["fired"] == True]  # noqa: E712
    keys = ["site", "model", "scope", "persistence"]
    rows = []
    for key, g in fired.fillna({"scope": ""}).groupby(keys, dropna=False):
        row: dict[str, object] = dict(zip(keys, (k or "-" for k in key), strict=True))
        for d in _detectors(df):
            on = g[g["detectors"].map(lambda s, d=d: d in s.split(";")).astype(bool)]
            caught = on["detected_by"].map(lambda s, d=d: d in s.split(";")).astype(bool)
            row[d] = f"{int(caught.sum())}/{len(on)}" if len(on) else "-"
        row["harmful"] = int((g["effect"] == "harmful").sum())
        rows.append(row)
    return rows


def recovery(df: pd.DataFrame) -> str:
    """What recovery did: trials recovered, steps lost, time, nodes that left, verdicts."""
    tried = df[pd.to_numeric(df["recoveries"], errors="coerce").fillna(0) > 0]
    verdicts = df[df["recovery_verdict"].fillna("") != ""]
    if tried.empty and verdicts.empty:
        return ""
    rows = []
    for _, r in pd.concat([tried, verdicts]).drop_duplicates("trial_id").iterrows():
        shrunk = pd.notna(r["final_nodes"]) and int(r["final_nodes"]) < int(r["nodes"])
        rows.append(
            {
                "trial": r["trial_id"],
                "recovered": r["recovered"],
                "quarantined nodes": r["quarantined_nodes"] if pd.notna(r["quarantined_nodes"])
                else "-",
                "world after": f"{int(r['final_nodes'])} nodes" + (" (shrunk)" if shrunk else "")
                if pd.notna(r["final_nodes"]) else "-",
                "restored from step": r["restore_step"],
                "steps lost": r["steps_lost"],
                "recovery s": r["recovery_s"],
                "matches golden": r["golden_match"],
                "effect": r["effect"],
                "verdict": r["recovery_verdict"] if pd.notna(r["recovery_verdict"]) else "-",
            }
        )  # fmt: skip
    same = int(tried["golden_match"].fillna(False).astype(bool).sum())
    head = (f"{len(tried)} trials recovered at least once; {same} of them ended bit-identical to "
            "their golden run. A restore step of -1 means from the initial weights.")  # fmt: skip
    return "## Recovery\n\n" + head + "\n\n" + _table(rows)


def false_positives(df: pd.DataFrame) -> list[dict[str, object]]:
    clean = df[df["site"] == "none"]
    rows = []
    for d in _detectors(df):
        flagged = clean["alert_detectors"].map(lambda s, d=d: d in s.split(";")).astype(bool)
        rows.append(
            {
                "detector": d,
                "clean trials with an alert": _rate(int(flagged.sum()), len(clean)),
            }
        )
    return rows


def _per_trial(df: pd.DataFrame) -> str:
    clean = df[df["site"] == "none"]
    return f"{clean['alerts'].sum()}/{len(clean)}" if len(clean) else "no clean trials"


def detection_times(df: pd.DataFrame) -> list[dict[str, object]]:
    caught = df[df["detected"] == True]  # noqa: E712
    rows = []
    for d, g in caught.groupby("first_detector"):
        ttd = g["ttd_steps"]
        rows.append(
            {
                "first detector": d,
                "n": len(g),
                "ttd steps (median / max)": f"{ttd.median():g} / {ttd.max():g}",
                "ttd seconds (median)": f"{g['ttd_seconds'].median():.4f}",
                "contained": _rate(int(g["contained"].sum()), len(g)),
                "attribution correct": _rate(int(g["attribution_correct"].sum()), len(g)),
            }
        )
    return rows


def summary(df: pd.DataFrame) -> str:
    """The short table printed at the end of a campaign."""
    effects = df["effect"].value_counts()
    head = f"{len(df)} trials: " + ", ".join(f"{e} {effects[e]}" for e in sorted(effects.index))
    return head + "\n\n" + _table(catch_rates(df)) + "\n" + _table(false_positives(df))


def sensitivity(dirs: list[Path]) -> str:
    """The smallest one-element perturbation each check could see, from `sensitivity` events."""
    found = []
    for d in dirs:
        for path in d.rglob("events.jsonl"):
            with open(path, encoding="utf-8") as f:
                found += [e for e in map(json.loads, f) if e["kind"] == "sensitivity"]
    if not found:
        return ""
    frame = pd.DataFrame(found)
    frame["relative"] = frame["bound"] / frame["grad_norm"]
    lines = [
        "## Sensitivity\n",
        "| detector | n | smallest visible change of one element "
        "(median) | relative to the averaged gradient's L2 norm (median) |",
        "|---|---|---|---|",
    ]
    for name, g in frame.groupby("detector"):
        lines.append(
            f"| {name} | {len(g)} | {g['bound'].median():.3g} | {g['relative'].median():.3g} |"
        )
    return "\n".join(lines) + "\n"


def write_report(df: pd.DataFrame, out: Path, dirs: list[Path] | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    sections = [
        "# SDC detection coverage report",
        f"Runs: {', '.join(sorted(df['run'].unique()))}  ",
        f"Trials: {len(df)}; workloads: {', '.join(sorted(df['workload'].unique()))}; "
        f"dtypes: {', '.join(sorted(df['dtype'].unique()))}; "
        "effects: " + ", ".join(f"{e} {n}" for e, n in df["effect"].value_counts().items()),
        "Rates are k/n with a 95% Wilson interval. Catch rate = detected / fired (DESIGN §5); "
        "`detected` means an alert at or after the first step in which the injection changed a "
        "value.",
        "## Catch rate by detector\n\n" + _table(catch_rates(df)),
        "## Catch rate by scenario cell\n\nA blind spot is a cell with harmful trials whose catch "
        "rate's upper bound is below 50%.\n\n" + _table(cells(df)),
        "## What each detector sees and misses\n\nFired trials caught by each detector, per "
        "scenario (k/n).\n\n" + _table(sees_and_misses(df)),
        "## False positives (clean trials)\n\n"
        f"Alerts per clean trial, all detectors: {_per_trial(df)}\n\n"
        + _table(false_positives(df)),
        "## Time to detection, containment and attribution\n\n" + _table(detection_times(df)),
    ]
    recovered = recovery(df)
    if recovered:
        sections.append(recovered)
    extra = sensitivity(dirs or [out])
    if extra:
        sections.append(extra)
    sections.append(_figures(df, out))
    clean = df[df["site"] == "none"]
    if len(clean):
        same = int(clean["golden_match"].sum())
        sections.append(
            "## Detectors observe only\n\nClean trials whose final weights are bit-identical to "
            f"their golden run (detectors off): {same}/{len(clean)}."
        )
    markdown = "\n\n".join(sections) + "\n"
    _write(out / "report.html", to_html(markdown))
    return _write(out / "report.md", markdown)


def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def _figures(df: pd.DataFrame, out: Path) -> str:
    folder = out / "figures"
    folder.mkdir(exist_ok=True)
    rates = figures.catch_rate_by_detector(df, _detectors(df), wilson, folder / "catch_rate.png")
    drawn = [
        ("Catch rate by detector (95% Wilson intervals)", rates),
        (
            "Effect of the faults by scenario",
            figures.effects_by_scenario(df, folder / "effects.png"),
        ),
        ("Time to detection", figures.detection_delay(df, folder / "ttd.png")),
    ]
    for dtype in sorted(df["dtype"].unique()):
        path = figures.catch_heatmap(df, dtype, folder / f"heatmap_{dtype}.png")
        drawn.append((f"Catch rate by site and bit ({dtype})", path))
    lines = ["## Figures"]
    lines += [f"![{title}](figures/{path.name})" for title, path in drawn if path is not None]
    return "\n\n".join(lines)


def _inline(text: str) -> str:
    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", text)


def to_html(markdown: str) -> str:
    """The report's own small markdown (headings, tables, images, paragraphs) as a page."""
    body, table = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip("|").split("|")])
            continue
        if table:
            head, rows = table[0], table[2:]
            body.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>")
            body += ["<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rows]
            body.append("</table>")
            table = []
        image = re.fullmatch(r"!\[(.*)\]\((.*)\)", line.strip())
        if line.startswith("## "):
            body.append(f"<h2>{_inline(line[3:])}</h2>")
        elif line.startswith("# "):
            body.append(f"<h1>{_inline(line[2:])}</h1>")
        elif image:
            alt, src = (html.escape(g) for g in image.groups())
            body.append(
                f'<figure><img src="{src}" alt="{alt}"><figcaption>{alt}</figcaption></figure>'
            )
        elif line.strip():
            body.append(f"<p>{_inline(line)}</p>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;"
             "padding:3px 8px;font-size:90%}th{background:#eee}img{max-width:100%}")  # fmt: skip
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>SDC detection coverage"
        f"</title><style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sdc-report", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="run folders or sweep folders")
    parser.add_argument("--out", type=Path, help="where to write (default: the first folder)")
    args = parser.parse_args(argv)
    try:
        df = load_trials(args.dirs)
    except ReportError as exc:
        print(f"sdc-report: {exc}", file=sys.stderr)
        sys.exit(2)
    path = write_report(df, args.out or args.dirs[0], args.dirs)
    print(summary(df))
    print(f"report: {path}")
