"""The report: catch rates with their uncertainty, false positives and time to detection, built
only from trials.csv so that `sdc-report` can rebuild it from any run or sweep folder.

Definitions are docs/design.md section 5's. Every rate carries its n and a 95% Wilson
interval: a 3/3 catch rate is not a 100% detector, and the interval says so.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd
from markdown_it import MarkdownIt

from harness.analysis import figures, mix
from harness.analysis.intervals import audit_intervals
from harness.analysis.overheads import load_overhead, rounds_text
from harness.analysis.tables import (
    CRASH,
    MERGED,
    OneLineParser,
    ReportError,
    bit_dtypes,
    by_parallel,
    catch_rates,
    cells,
    check_out,
    default_out,
    detection_times,
    detector_names,
    escape_cell,
    escapes,
    false_positives,
    harmful_escapes,
    load_trials,
    markdown_table,
    own_attributions,
    per_trial,
    recovery,
    runs_line,
    sees_and_misses,
    sweep_columns,
    unfinished,
    wilson,
)
from harness.core.events import Sensitivity, from_record, of, to_record
from harness.core.vocabulary import Effect, Site
from harness.results import machine
from harness.results.folder import EVENTS_FILE, RunFolder
from harness.results.schema import read_goldens
from harness.results.trial_row import Column


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}%"


def overhead_section(table: pd.DataFrame, folder: Path) -> str:
    """The overhead table and, for checks with an interval, overhead and floor against it; per
    workload, dtype and precision where the runs measured several (a share of another step
    each)."""
    swept = sweep_columns(table)
    rows = [
        {
            **{column: getattr(r, column) or "-" for column in swept},
            "detector": r.detector,
            "interval": r.interval or "-",
            "overhead (vs hook)": _pct(r.overhead_pct),
            "rounds": rounds_text(r.overhead_low_pct, r.overhead_high_pct),
            "overhead (vs plain DDP)": _pct(r.overhead_vs_ddp_pct),
            "floor": _pct(r.floor_pct),
            "overhead / floor": "-"
            if math.isnan(r.floor_pct) or r.floor_pct <= 0
            else f"{r.overhead_pct / r.floor_pct:.2f}x",
            "runs": r.runs,
        }
        for r in table.itertuples(index=False)
    ]
    text = (
        "## Overhead against audit interval\n\nStep time with the check alone over the step "
        "time without checks, minus 1 (docs/design.md, section 5): the median over steps, "
        "amortized over the check's interval, measured on this run's workload and world after "
        "its trials (harness/campaign/overhead.py), against two references: the harness's comm "
        "hook without checks (the check's own cost) and plain DDP without the hook (what a job "
        "pays). The `hook` row is the hook's own cost against plain DDP. Floor: the least the "
        "check could cost; for replay one forward and backward of the audited micro-batches "
        "per interval, measured in the same world. "
        "With several runs, the median over them. Rounds: one run's lowest and highest round "
        "against the hook (the hook's own against plain DDP; a dash over several runs, whose "
        "rounds would spread over their differences too); "
        "a growth within them is noise to sdc-regress. A tiny model on a loaded machine makes "
        "these noisy: read the trend, not the digits.\n\n" + markdown_table(rows)
    )
    path = figures.overhead_vs_interval(table, folder / "overhead.png")
    if path is not None:
        text += f"\n![Overhead and its floor against the interval](figures/{path.name})"
    return text


def escape_section(df: pd.DataFrame, folder: Path) -> str:
    text = (
        "## Escape impact\n\nThe loss damage of harmful faults that no detector caught: "
        "`loss_delta` = final loss minus the golden run's, per scenario cell; the largest by "
        "size. A final loss that is NaN or Inf has no size and is counted apart.\n\n"
    )
    rows = escapes(df)
    if not rows:
        return text + "No harmful fault escaped every detector.\n"
    text += markdown_table(rows)
    path = figures.escape_impact(harmful_escapes(df), escape_cell(df), folder / "escapes.png")
    return text + f"\n![Loss damage of the harmful faults no detector caught](figures/{path.name})"


def incomplete_line(df: pd.DataFrame) -> str:
    """Said where a run's campaign stopped before its end: its rates are of the trials that
    ran, and its clean and faulty trials may not be in their planned shares."""
    stopped = unfinished(df)
    if not stopped:
        return ""
    return (
        f"  \n**Incomplete**: {'; '.join(stopped)} (an interrupted campaign: rerun its command "
        "with the same out to finish it); every figure below is of the trials that ran"
    )


def own_attribution_text(df: pd.DataFrame) -> str:
    rows = own_attributions(df)
    if not rows:
        return ""
    return (
        "\nEach check's own first alert at or after the injection, whether or not it came "
        "first: among the trials it caught, those whose suspects were the culprits and no other "
        "rank (a check that names healthy ranks shows here).\n\n" + markdown_table(rows)
    )


def never_struck(df: pd.DataFrame) -> int:
    """Trials with a fault planned that never changed a value: counted apart from every effect
    (`effect` none, `fired` False), so that fired counts can be trusted. A trial that crashed
    before its fault struck says fired False too: its effect, crash, is its own count."""
    planned = (df[Column.site] != Site.NONE) & (df[Column.effect] == Effect.NONE)
    return int((planned & (df[Column.fired] != True)).sum())  # noqa: E712


def effects_line(df: pd.DataFrame) -> str:
    effects = df[Column.effect].value_counts()
    line = ", ".join(f"{e} {effects[e]}" for e in sorted(effects.index))
    unfired = never_struck(df)
    faults = "fault" if unfired == 1 else "faults"
    if unfired:
        line += f"; {unfired} planned {faults} never struck (effect none)"
    crashes = int((df[Column.model] == CRASH).sum())
    if crashes:
        line += (f"; {crashes} {'trial' if crashes == 1 else 'trials'} of the crash model left "
                 "out of the catch rates (a process taken down, no silent corruption)")  # fmt: skip
    return line


def summary(df: pd.DataFrame) -> str:
    """The short table printed at the end of a campaign."""
    head = f"{len(df)} trials: " + effects_line(df)
    text = (
        head + "\n\n" + markdown_table(catch_rates(df)) + "\n" + markdown_table(false_positives(df))
    )
    if mix.weighed(df) and not mix.conflicts(df):
        text += "\nUnder the campaign's fault mix:\n\n" + markdown_table(mix.shares(df))
    return text


def mix_section(df: pd.DataFrame) -> str:
    """What a weighed campaign's checks catch of the SDC a fleet sees (harness/analysis/mix.py)."""
    clash = mix.conflicts(df)
    if clash:
        return (
            "## Under the field mix\n\nThese runs give a fault class more than one weight: "
            f"{'; '.join(clash)}. They sample different mixes, which cannot be weighed "
            "together: report each mix's runs apart."
        )
    fired = df[Column.fired] == True  # noqa: E712
    left_out = int((fired & df[Column.weight].isna()).sum())
    apart = (
        f"{left_out} fired trials without a weight (runs that do not weigh their faults) are "
        "left out of this section. "
        if left_out
        else ""
    )
    return (
        "## Under the field mix\n\n"
        + apart
        + "Each fired trial stands for its fault class's weight, spread "
        "evenly over the class's fired trials (a class counts by its weight, not by its trials). "
        "Shares with a 95% Wilson interval at the Kish effective number of trials; the "
        "sensitivity range is the least and most share with any one class's weight halved or "
        "doubled. Damaging: harmful or latent, or replicas left apart (docs/design.md, section "
        "5). A check set counts the fired trials in which all its members ran, each class's "
        "weight spread over those; `mix covered` is the share of the mix's weight whose classes "
        "they sample (a class without one counts for nothing).\n\n"
        + markdown_table(mix.classes(df))
        + "\n"
        + markdown_table(mix.shares(df))
    )


def sensitivity(dirs: list[Path]) -> str:
    """The smallest one-element perturbation each check could see, from `sensitivity` events."""
    found = []
    for d in dirs:
        for path in d.rglob(EVENTS_FILE):
            with open(path, encoding="utf-8") as f:
                found += of(Sensitivity, (from_record(json.loads(line)) for line in f))
    if not found:
        return ""
    frame = pd.DataFrame([to_record(e) for e in found])
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


DEFINITIONS = """## Definitions (docs/design.md, section 5)

- **effect**, judged against the golden run (fault-free, same seed, checks observing):
  `masked` final weights bit-identical to golden and no damaged state; `benign` not masked,
  replicas equal, no non-finite state, final loss within the harm threshold; `latent` loss
  within the threshold but the state damaged (replicas diverged, non-finite weights or
  optimizer state, weights frozen by an overflowed Adam moment; column `damage` says which);
  `harmful` NaN/Inf loss or loss outside the threshold; `crash` a rank died or hung; `none` a
  clean trial, or one whose planned fault never struck (`fired` False), counted apart.
- **harm threshold** (`noise_band`): max - min of the golden final loss over the fixed
  reference seeds (`campaign.noise_seeds`), never over a campaign's trial seeds, so the same
  scenario and seed get the same effect in any campaign on the same workload.
- A trial whose checks act (act mode, recovery) takes the effect of its **observe twin**,
  the same scenario and seed with every check observing (`effect_from`); `contained` and
  `recovered` say what the checks achieved, the loss columns what the acting run ended with.
- **catch rate** = detected / fired; per detector over the trials in which it ran. The crash
  model's trials (a process taken down, no silent corruption) count in no catch rate.
- **blind spot**: a scenario cell with harmful or latent trials whose catch rate among them has
  a 95% Wilson upper bound below 50%."""


def environment_line(df: pd.DataFrame) -> str:
    """Where the rows were computed (campaign.json), one line; runs that differ are joined."""
    lines = [machine.summary(machine.recorded(Path(r))) for r in sorted(df["run"].unique())]
    return "; ".join(dict.fromkeys(lines))


def numerics_line(df: pd.DataFrame) -> str:
    """Which numerics model computed the rows' 16-bit products (campaign.json), one line."""
    lines = [machine.numerics(machine.recorded(Path(r))) for r in sorted(df["run"].unique())]
    return "; ".join(dict.fromkeys(lines))


def coverage_line(df: pd.DataFrame) -> str:
    """The share of a step's product FLOPs that matmul_checksum checks (campaign.json's
    `product_coverage`), for the compute-fault rows (site matmul), one line; '' when no run
    with such rows records it (a run without compute faults has nothing the share speaks of)."""
    parts = []
    computing = df[df[Column.site] == "matmul"]
    for run in sorted(computing["run"].unique()):
        held = (RunFolder(Path(run)).campaign_record() or {}).get("product_coverage")
        if held:
            workload = ", ".join(sorted(df.loc[df["run"] == run, Column.workload].unique()))
            parts.append(
                f"{held['checked']:.1%} of {held['flops'] / 1e9:.3g} GFLOP of products per rank "
                f"and step ({workload})"
            )
    if not parts:
        return ""
    return (
        "Product coverage: matmul_checksum checks " + "; ".join(dict.fromkeys(parts)) + ": "
        "what a compute fault (site matmul) strikes outside that share, no checksum sees.\n\n"
    )


def golden_line(df: pd.DataFrame) -> str:
    """How many golden runs the rows were judged against, and which of them the golden store
    gave instead of a run (golden.jsonl's `reused_from`), one line; rows copied without their
    golden.jsonl say so rather than count none."""
    folders = [RunFolder(Path(run)) for run in sorted(df["run"].unique())]
    lacking = sum(not folder.goldens.exists() for folder in folders)
    if lacking == len(folders):
        return "not recorded (no golden.jsonl beside trials.csv)"
    held = [g for folder in folders for g in read_goldens(folder.goldens)]
    reused = [g for g in held if g.reused_from]
    unrecorded = f"; {lacking} of {len(folders)} folders hold no golden.jsonl" if lacking else ""
    if not reused:
        return f"{len(held)}, each run in its campaign{unrecorded}"
    stores = sorted({str(Path(g.reused_from).parent.parent) for g in reused})
    seeds = _spans(sorted({g.seed for g in reused}))
    return (
        f"{len(held)}; {len(reused)} reused from the golden store ({', '.join(stores)}; seeds "
        f"{seeds}), {len(held) - len(reused)} run in their campaign{unrecorded}"
    )


def _spans(numbers: list[int]) -> str:
    """Sorted integers as runs: [0, 1, 2, 5] -> '0-2, 5'."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def write_report(df: pd.DataFrame, out: Path, dirs: list[Path] | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    folder = out / "figures"
    folder.mkdir(exist_ok=True)
    checks = detector_names(df)  # none: a campaign of the faults' effects alone
    sections = [
        "# SDC detection coverage report",
        runs_line(df),
        "Environment: " + environment_line(df) + "  ",
        "Numerics: " + numerics_line(df) + "  ",
        "Golden runs: " + golden_line(df) + "  ",
        f"Trials: {len(df)}; workloads: {', '.join(sorted(df[Column.workload].unique()))}; "
        f"dtypes: {', '.join(sorted(df[Column.dtype].unique()))}; "
        f"precisions: {', '.join(sorted(df[Column.precision].fillna('not recorded').unique()))}; "
        "effects: " + effects_line(df) + incomplete_line(df),
        "Rates are k/n with a 95% Wilson interval. Catch rate = detected / fired "
        "(docs/design.md §5); "
        "`detected` means an alert at or after the injection: in a later step than the first "
        "in which the injection changed a value, or in that step from the phase it struck in.",
        DEFINITIONS,
        "## Catch rate by detector\n\nEach detector's n counts the trials in which it ran.\n\n"
        + markdown_table(catch_rates(df)),
        *([mix_section(df)] if mix.weighed(df) else []),
        "## Catch rate by scenario cell\n\nA cell is a site, model and bit class, and each "
        "setting of the fault that differs between the campaign's scenarios (factor, value, "
        "scope, persistence, steps, a product's phase, a field mix's class; workload, dtype and "
        "precision in a sweep). A blind spot is a cell with harmful or latent trials whose "
        "catch rate among them has a 95% upper bound below 50%.\n\n"
        + coverage_line(df)
        + markdown_table(cells(df)),
        "## What each detector sees and misses\n\nFired trials caught by each detector, per "
        "scenario (k/n, 95% Wilson interval).\n\n" + markdown_table(sees_and_misses(df)),
        "## False positives (clean trials)\n\n"
        + (
            f"All detectors: {per_trial(df)}\n\n" + markdown_table(false_positives(df))
            if checks
            else "No check ran in these trials."
        ),
        "## Time to detection, containment and attribution\n\n"
        + markdown_table(detection_times(df))
        + own_attribution_text(df),
        escape_section(df, folder),
    ]
    sharded = by_parallel(df)
    if sharded:
        sections.append(
            "## Catch rate by parallelism\n\nThe same faults with replicas (ddp), sharded "
            "(fsdp) and sharded within replica groups (hsdp): each detector's catch rate among "
            "the fired trials it ran in; `not run` where the check did not run beside that fault "
            "there (it does not exist under that parallelism, docs/design.md, section 3, or the "
            "run left it out), `no trials` where no run under it held the fault.\n\n"
            + markdown_table(sharded)
        )
    by_interval = audit_intervals(df)
    if by_interval:
        sections.append(
            "## Catch rate against audit interval\n\nFired trials each periodic check caught at "
            "each interval it ran at (its own first alert, whichever check alerted first), and "
            "its time to detection.\n\n" + markdown_table(by_interval)
        )
    measured = load_overhead(dirs or [out])
    if measured is not None:
        sections.append(overhead_section(measured, folder))
    if measured is not None and by_interval:
        from harness.analysis import plan_report  # it builds on this module's tables

        sections.append(plan_report.report_section(df, measured, folder))
    recovered = recovery(df)
    if recovered:
        sections.append(recovered)
    extra = sensitivity(dirs or [out])
    if extra:
        sections.append(extra)
    sections.append(_figures(df, folder))
    clean = df[df[Column.site] == Site.NONE]
    if len(clean) and checks:  # with no check, nothing observed
        same = int(clean[Column.golden_match].sum())
        sections.append(
            "## Detectors observe only\n\nClean trials whose final weights are bit-identical to "
            f"their golden run (same seed, checks observing): {same}/{len(clean)}."
        )
    markdown = "\n\n".join(sections) + "\n"
    _write(out / "report.html", to_html(markdown))
    return _write(out / "report.md", markdown)


def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def _figures(df: pd.DataFrame, folder: Path) -> str:
    checks = detector_names(df)
    rates = (
        figures.catch_rate_by_detector(df, checks, wilson, folder / "catch_rate.png")
        if checks
        else None  # no check ran: no bar to draw
    )
    drawn = [
        ("Catch rate by detector (95% Wilson intervals)", rates),
        (
            "Effect of the faults by scenario",
            figures.effects_by_scenario(df, folder / "effects.png"),
        ),
        ("Time to detection", figures.detection_delay(df, folder / "ttd.png")),
    ]
    for dtype in sorted(bit_dtypes(df).unique()):
        path = figures.catch_heatmap(df, dtype, folder / f"heatmap_{dtype}.png")
        drawn.append((f"Catch rate by site and bit ({dtype})", path))
    lines = ["## Figures"]
    lines += [f"![{title}](figures/{path.name})" for title, path in drawn if path is not None]
    return "\n\n".join(lines)


# CommonMark with GFM tables, raw HTML escaped: a crash cause quoting `<module>` stays text.
_MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable("table")
_STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
          "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;"
          "padding:3px 8px;font-size:90%}th{background:#eee}img{max-width:100%}")  # fmt: skip


def to_html(markdown: str) -> str:
    """report.md as a page that opens from disk, figures included (relative paths)."""
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>SDC detection coverage"
        f"</title><style>{_STYLE}</style></head><body>\n{_MARKDOWN.render(markdown)}</body></html>\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="sdc-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="run folders or sweep folders")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"where to write (default: the folder named, or for several folders {MERGED}/ "
        f"inside the first, {MERGED}-2/ and on where one holds a merge of other runs; a "
        "folder's own report is never replaced by a merged one)",
    )
    try:
        args = parser.parse_args(argv)
        df = load_trials(args.dirs)
        out = args.out or default_out(args.dirs, df)
        check_out("--out", out, args.dirs)
    except ReportError as exc:
        print(f"sdc-report: {exc}", file=sys.stderr)
        sys.exit(2)
    path = write_report(df, out, args.dirs)
    print(summary(df))
    print(f"report: {path}")
