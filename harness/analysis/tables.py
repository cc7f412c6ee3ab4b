"""The report's tables, built from trials.csv and overhead.csv alone: catch rates with their 95%
Wilson intervals, blind spots, scenario cells, escapes, false positives, detection times and
audit intervals (docs/design.md, section 5). The report (harness/analysis/report.py), the
planner and `sdc-regress` read runs through these.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import NoReturn

import pandas as pd

from harness.core.formats import BIT_CLASSES, classify_bit
from harness.core.vocabulary import DAMAGING, Effect, Site
from harness.results.folder import (
    TRIALS_FILE,
    RunFolder,
    rows_identity,
    seeds_text,
    shared_seeds,
)
from harness.results.schema import (
    RECOVERY_KINDS,
    recovery_kinds,
)
from harness.results.trial_row import (
    COLUMNS,
    Column,
    TrialRow,
    TrialRowError,
    cell_text,
    read_trials,
)

Z95 = 1.959963984540054
# The published design's three checks (docs/design.md, section 1), a set the plan and the mix
# always weigh.
PUBLISHED = ("nan_inf", "replay", "weight_consensus")
TRIAL_SETS = ("all fired", "non-masked", "harmful")
ANY = "any detector"
# The fault model that takes a process down (injectors/crash.py): no silent corruption, so no
# check can catch or miss it. Its trials count among the effects (crash), never in a catch rate.
CRASH = "crash"

# (k, n): k successes in n trials; under a weighed fault mix (harness/analysis/mix.py) the
# weighed share times the effective number of trials, so neither need be whole.
Counts = tuple[float, float]


class ReportError(ValueError):
    pass


class OneLineParser(argparse.ArgumentParser):
    """argparse's refusals as the tools' one line and exit 2, not its usage block over two."""

    def error(self, message: str) -> NoReturn:
        raise ReportError(message)


def wilson(k: float, n: float) -> tuple[float, float]:
    """95% Wilson score interval for k successes in n trials (weighed: Counts)."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    denom = 1 + Z95**2 / n
    center = (p + Z95**2 / (2 * n)) / denom
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / denom
    # At k = 0 (or n) the bound is exactly 0 (or 1); center -/+ half rounds a step off it.
    low = 0.0 if k == 0 else max(0.0, center - half)
    high = 1.0 if k == n else min(1.0, center + half)
    return (low, high)


def poisson_interval(count: int, n: int) -> tuple[float, float]:
    """95% score interval of a rate of events per trial: `count` events over `n` trials, each
    trial able to hold several (alerts per clean trial), where Wilson's bounds a share."""
    if n == 0:
        return (math.nan, math.nan)
    half = Z95 * math.sqrt(count + Z95**2 / 4)
    return (max(0.0, count + Z95**2 / 2 - half) / n, (count + Z95**2 / 2 + half) / n)


def per_trial_text(count: int, n: int) -> str:
    """`count` events over `n` trials as a rate with its interval: "24/3 = 8 [5.4, 12]"."""
    low, high = poisson_interval(count, n)
    return f"{count}/{n} = {count / n:.3g} [{low:.2g}, {high:.2g}]"


def blind_spot(harmful: Counts) -> bool:
    """docs/design.md section 5: harmful trials whose catch rate's upper bound is below 50%."""
    k, n = harmful
    return n > 0 and wilson(k, n)[1] < 0.5


def bit_class(dtype: str, bit: object) -> str:
    """A configured bit as its class; a configured class stays itself."""
    if bit == "" or bit is None or (isinstance(bit, float) and math.isnan(bit)):
        return ""
    if str(bit) in BIT_CLASSES:
        return str(bit)
    return classify_bit(dtype, int(float(bit)))


def bit_dtypes(df: pd.DataFrame) -> pd.Series:
    """The dtype each trial's `bit` indexes: `bit_dtype` where autocast struck another than
    the workload's, else the workload's."""
    return df[Column.bit_dtype].where(df[Column.bit_dtype].notna(), df[Column.dtype])


def distinct(dirs: list[Path]) -> None:
    """Folders whose tables are read together, none among another's: a folder named twice, or
    a sweep's job beside the sweep, had every trial counted twice."""
    for i, d in enumerate(dirs):
        for other in dirs[:i]:
            a, b = d.resolve(), other.resolve()
            if a.is_relative_to(b) or b.is_relative_to(a):
                raise ReportError(
                    f"{d}: named with {other}, and one holds the other's tables (the same "
                    "folder, or one inside the other): each trial would count twice; name each "
                    "run or sweep once"
                )


def _one_of_each_campaign(files: list[Path]) -> None:
    """Tables of two runs that ran the same trials (configs alike in all that decides a row,
    seeds in common: a copy, the same command again, fewer seeds or `campaign.fast_forward`
    set otherwise) hold the same rows: read together, each would count twice and narrow every
    interval as if it were evidence."""
    seen: list[tuple[Path, dict, str]] = []
    for f in files:
        record = RunFolder(f.parent).campaign_record()
        if record is None:
            continue
        rows = rows_identity(record)
        for first, earlier, its_rows in seen:
            shared = shared_seeds(earlier, record) if its_rows == rows else []
            if shared:
                raise ReportError(
                    f"{f.parent}: the same campaign as {first} for {seeds_text(shared)} "
                    "(its config but for the seeds and the settings that change no row), whose "
                    "rows both hold: each trial would count twice; name one of them, or runs "
                    "that share no seed (sdc-regress compares two runs)"
                )
        seen.append((f.parent, record, rows))


def check_out(flag: str, out: Path, dirs: list[Path]) -> None:
    """Where a tool writes what it made of `dirs`: a folder, and not one that holds another
    run's trials or is a sweep's (what it writes there would replace that run's own report or
    plan); a folder above the runs reported is theirs."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"{flag} {out}: not a folder; name a folder to write into")
    given = [d.resolve() for d in dirs]
    foreign = out.is_dir() and (
        any(not any(f.resolve().is_relative_to(d) for d in given) for f in out.rglob(TRIALS_FILE))
        or ((out / "multirun.yaml").exists() and out.resolve() not in given)
    )
    if foreign:
        raise ReportError(
            f"{flag} {out}: another run's folder (it holds trials not reported here), whose "
            "own files this would replace; name one of the folders reported, or a new one"
        )


# Where a report or plan of several folders goes by default, inside the first: each run's own
# report and plan stay its own. A merge of another set of runs takes the next free name
# (merged-2, ...); a report and a plan of the same runs share a folder.
MERGED = "merged"
MERGES = ("report.md", "plan.md")  # what a merge writes, its runs line third


def runs_line(df: pd.DataFrame) -> str:
    """The first line of a report or plan after its title: the folders whose trials it counts."""
    return f"Runs: {', '.join(sorted(df['run'].unique()))}  "


def default_out(dirs: list[Path], df: pd.DataFrame) -> Path:
    """Where `sdc-report` and `sdc-plan` write without --out: one folder's report or plan into
    that folder; a merge of several into FIRST/merged/, or where a merge of other runs is there
    already, the first of merged-2, merged-3, ... that is free or holds this merge's."""
    if len(dirs) == 1:
        return dirs[0]
    line = runs_line(df)
    for n in itertools.count(1):
        out = dirs[0] / (MERGED if n == 1 else f"{MERGED}-{n}")
        if not out.exists() or any(line in _head(out / name) for name in MERGES):
            return out
    raise AssertionError("unreachable")


def _head(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()[:3]
    except (FileNotFoundError, NotADirectoryError):
        return []


def load_trials(dirs: list[Path]) -> pd.DataFrame:
    """Every trials.csv under the given folders (a sweep folder holds one per job), each read
    into TrialRows (harness/results/trial_row.py) and framed by `trials_frame`, with `run` (the
    file's folder) added and `bit_class` filled where an older table lacks it."""
    distinct(dirs)
    files = []
    for d in dirs:
        if not d.is_dir():
            raise ReportError(f"{d}: not a folder")
        found = sorted(d.rglob(TRIALS_FILE))
        if not found:
            raise ReportError(f"{d}: no trials.csv in it or below it")
        files += found
    _one_of_each_campaign(files)
    frames = []
    for f in files:
        try:
            _, rows = read_trials(f)
        except TrialRowError as exc:
            raise ReportError(str(exc)) from None
        frames.append(trials_frame(rows).assign(run=str(f.parent)))
    df = pd.concat(frames, ignore_index=True)
    if df.empty:  # a report of nothing read as a run with no findings (an empty "Runs:" line)
        raise ReportError(
            f"{', '.join(str(d) for d in dirs)}: trials.csv holds no trials yet (a campaign "
            "stopped before its first row): nothing to report"
        )
    # A table written before rows kept their class: the bit's, in the dtype it indexes.
    classed = [bit_class(d, b) for d, b in zip(bit_dtypes(df), df[Column.bit], strict=True)]
    df[Column.bit_class] = df[Column.bit_class].where(df[Column.bit_class].notna(), classed)
    return df


def unfinished(df: pd.DataFrame) -> list[str]:
    """Each run whose campaign.json plans trials its trials.csv does not hold yet (a campaign
    interrupted before its end), as "FOLDER: K of N planned trials"."""
    found = []
    for run, trials in df.groupby("run"):
        record = RunFolder(Path(run)).campaign_record() or {}
        planned = {t.get(Column.trial_id) for t in record.get("trials", [])}
        if planned - set(trials[Column.trial_id]):
            found.append(f"{run}: {len(trials)} of {len(planned)} planned trials")
    return found


def _framed(value: object) -> object:
    """A field as a frame holds it: a list or mapping as its cell's text (pandas groups and
    compares text), an enum as its plain text, None as a missing value."""
    if isinstance(value, tuple | dict):
        return cell_text(value)
    if isinstance(value, StrEnum):
        return str(value)
    return value


def trials_frame(rows: list[TrialRow]) -> pd.DataFrame:
    """TrialRows as one frame, a column per field: booleans are bools (object where the column
    may be blank), numbers are numbers (float where it may be blank), blanks are missing."""
    records = [{c: _framed(getattr(row, c)) for c in COLUMNS} for row in rows]
    return pd.DataFrame.from_records(records, columns=list(COLUMNS))


def damaged(df: pd.DataFrame) -> pd.Series:
    """Whether each trial's fault did damage (docs/design.md, section 5): harmful, latent (the
    loss hides it), or replicas left apart."""
    return df[Column.effect].isin(DAMAGING) | (df[Column.replicas_agree] == False)  # noqa: E712


def percent(x: float) -> str:
    """A share in whole percent, but one a whole percent would round to 0% or 100% (a bound
    of 0.2% is no 0%)."""
    if x in (0, 1) or 0.005 <= x < 0.995:
        return f"{x:.0%}"
    for digits in (1, 2, 3):
        text = f"{x:.{digits}%}"
        if float(text[:-1]) not in (0, 100):
            break
    return text


def rate_text(k: float, n: float) -> str:
    if n == 0:
        return "n=0"
    lo, hi = wilson(k, n)
    shares = f"{percent(k / n)} [{percent(lo)}, {percent(hi)}]"
    if float(k).is_integer() and float(n).is_integer():
        return f"{k:.0f}/{n:.0f} = {shares}"
    return f"{shares} weighed, n = {n:.1f}"


def markdown_table(rows: list[dict[str, object]]) -> str:
    if not rows:
        return "_none_\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    # A `|` inside a cell (a warning's text, an override) would end the cell.
    lines += ["| " + " | ".join(str(r[c]).replace("|", "\\|") for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def detector_names(df: pd.DataFrame) -> list[str]:
    return sorted({d for ds in df[Column.detectors] for d in ds.split(";") if d})


def named(column: pd.Series, name: str) -> pd.Series:
    """Whether each `;`-joined entry of `column` names `name`."""
    return column.map(lambda s: name in s.split(";")).astype(bool)


def silent_fired(df: pd.DataFrame) -> pd.DataFrame:
    """The fired trials of faults that corrupt values: all but the crash model's (CRASH)."""
    return df[(df[Column.fired] == True) & (df[Column.model] != CRASH)]  # noqa: E712


def catch_counts(df: pd.DataFrame) -> dict[str, dict[str, Counts]]:
    """(k, n) caught per trial set (TRIAL_SETS) and per column (ANY, then each detector)."""
    fired = silent_fired(df)
    subsets = (
        fired,
        fired[fired[Column.effect] != Effect.MASKED],
        fired[fired[Column.effect] == Effect.HARMFUL],
    )
    found = {}
    for label, subset in zip(TRIAL_SETS, subsets, strict=True):
        found[label] = {ANY: (int(subset[Column.detected].sum()), len(subset))}
        for d in detector_names(df):
            # Over the trials in which the detector ran: a merged sweep mixes detector sets.
            on = subset[named(subset[Column.detectors], d)]
            found[label][d] = (int(named(on[Column.detected_by], d).sum()), len(on))
    return found


def catch_rates(df: pd.DataFrame) -> list[dict[str, object]]:
    return [
        {"trials": label, **{column: rate_text(*kn) for column, kn in by.items()}}
        for label, by in catch_counts(df).items()
    ]


# A fault's own settings beyond site, model and bit: scenarios that differ in one are caught
# differently (x10 and x1e6, a NaN and a random value, a transient and a permanent fault, a
# step replay audits and one between its audits, a field mix's classes, a defective unit that
# strikes 1% of the products and one that strikes 10%, a scaled reduction of the gradients and
# one of the sketch's riders).
SETTINGS = (
    Column.scope,
    Column.persistence,
    Column.factor,
    Column.value,
    Column.fault_steps,
    Column.fault_phase,
    Column.fault_class,
    Column.fault_settings,
)
# What a sweep varies between its jobs that changes what a scenario is.
SWEPT = (Column.workload, Column.dtype, Column.precision)
# What tells one cell from another: the sweep's columns, then the fault's settings.
APART = (*SWEPT, *SETTINGS)


def sweep_columns(df: pd.DataFrame) -> list[str]:
    """Workload, dtype and precision, each where the trials hold more than one: a scenario is
    only the same within one of each (a bit class names different bits in each dtype; bf16-mixed
    computes in bfloat16 under a float32 dtype), so a sweep's cells are told apart by them. A
    campaign of one of each keeps its cells' columns as they are."""
    # A blank counts: a table written before the precision column beside one written after.
    return [c for c in SWEPT if df[c].nunique(dropna=False) > 1]


def setting_columns(df: pd.DataFrame, always: tuple[str, ...] = ()) -> list[str]:
    """The settings (SETTINGS) that tell scenarios apart: those `always` names, each that the
    fired trials hold more than one value of, a blank being none (nightly's x10 at the loss
    and x1000 at the gradients), and each that the fired trials of one site and model hold
    more than one value of, a blank counting (a defective unit at its default rate beside one
    at 10%). A clean trial, which has no steps, adds none, nor does a bit flip's blank factor
    beside one scaling's x10."""
    fired = as_text(silent_fired(df), SETTINGS)
    told = fired.groupby([Column.site, Column.model])[list(SETTINGS)].nunique(dropna=False)
    return [
        c for c in SETTINGS
        if c in always or fired[c].mask(fired[c] == "").nunique() > 1 or (told[c] > 1).any()
    ]  # fmt: skip


def _text(value: object) -> str:
    """A cell as the tables show and group it: a blank as "", a number in its shortest form
    that reads back as itself (x1.000001 is not x1)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return str(value)


def as_text(df: pd.DataFrame, columns: list[str] | tuple[str, ...]) -> pd.DataFrame:
    """The columns as the tables show and group them (`_text`)."""
    return df.assign(**{c: df[c].map(_text) for c in columns})


def _named(columns: list[str], key: tuple) -> dict[str, object]:
    """A table row's leading cells: each column by its spaced name, a blank as "-"."""
    return {c.replace("_", " "): value or "-" for c, value in zip(columns, key, strict=True)}


def scenario_columns(df: pd.DataFrame) -> list[str]:
    """The columns beyond site, model and bit class that tell the trials' scenarios apart, as
    the cells' table shows them: a sweep's (`sweep_columns`), then the settings'."""
    return [*sweep_columns(df), *setting_columns(df)]


# How a cell's name shows a setting whose value alone would not say what it is.
_SHOWN = {
    Column.factor: "x{}",
    Column.value: "value {}",
    Column.fault_steps: "step {}",
    Column.fault_class: "class {}",
}


def cell_label(parts: dict[str, str]) -> str:
    """A scenario cell's columns as one name: the parts that are not blank (or "-"), a setting
    with what it is ('grad / scale / x10 / step 12')."""
    shown = (_SHOWN.get(c, "{}").format(v) for c, v in parts.items() if v and v != "-")
    return " / ".join(shown)


@dataclass(frozen=True)
class Cell:
    """One scenario cell of fired trials, as numbers: site, model, bit class, and every column
    that may tell scenarios apart (APART; blank where a trial has none). The tables show those
    that differ among their trials (`sweep_columns`, `setting_columns`); the key holds them
    all, so two runs' cells of one scenario match whatever else either run holds."""

    site: str
    model: str
    bit_class: str  # "-" for a fault without a bit
    fired: Counts
    harmful: Counts
    effects: str
    workload: str
    dtype: str
    precision: str
    scope: str
    persistence: str
    factor: str
    value: str
    fault_steps: str
    fault_phase: str
    fault_class: str
    fault_settings: str

    @property
    def key(self) -> tuple[str, ...]:
        return (self.site, self.model, *(getattr(self, c) for c in APART), self.bit_class)

    @property
    def name(self) -> str:
        """The key as a finding names it (`cell_label`)."""
        columns = (Column.site, Column.model, *APART, Column.bit_class)
        return cell_label(dict(zip(columns, self.key, strict=True)))

    @property
    def blind(self) -> bool:
        return blind_spot(self.harmful)


CELL_KEY = (Column.site, Column.model, *APART, Column.bit_class)


def by_cell(df: pd.DataFrame) -> dict[tuple[str, ...], pd.DataFrame]:
    """The fired trials of each scenario cell, by the cell's key (Cell.key)."""
    fired = silent_fired(df)
    groups = as_text(fired, APART).groupby(list(CELL_KEY), dropna=False)
    return {(*key[:-1], key[-1] or "-"): g for key, g in groups}


def cell_stats(df: pd.DataFrame) -> list[Cell]:
    """Catch counts per scenario cell (Cell), among fired and among harmful or latent trials
    (the damage a blind spot lets through)."""
    found = []
    for (site, model, *apart, klass), g in by_cell(df).items():
        harmful = g[g[Column.effect].isin(DAMAGING)]
        effects = ", ".join(f"{e} {c}" for e, c in g[Column.effect].value_counts().items())
        found.append(
            Cell(
                site=site,
                model=model,
                bit_class=klass,
                fired=(int(g[Column.detected].sum()), len(g)),
                harmful=(int(harmful[Column.detected].sum()), len(harmful)),
                effects=effects,
                **dict(zip(map(str, APART), apart, strict=True)),
            )
        )
    return found


def cells(df: pd.DataFrame) -> list[dict[str, object]]:
    """Catch rate per scenario cell (Cell), and whether the cell is a blind spot."""
    told = scenario_columns(df)
    return [
        {
            Column.site: c.site,
            Column.model: c.model,
            **{column.replace("_", " "): getattr(c, column) or "-" for column in told},
            "bit class": c.bit_class,
            "catch rate (fired)": rate_text(*c.fired),
            "catch rate (harmful or latent)": rate_text(*c.harmful),
            "effects": c.effects,
            "blind spot": "**yes**" if c.blind else "no",
        }
        for c in cell_stats(df)
    ]


def _escape_apart(df: pd.DataFrame) -> list[str]:
    return [*sweep_columns(df), *setting_columns(df, always=(Column.persistence,))]


def escape_cell(df: pd.DataFrame) -> list[str]:
    """An escape's scenario cell: site, model, persistence, the other columns that tell the
    trials' scenarios apart (`sweep_columns`, `setting_columns`), bit class."""
    return [Column.site, Column.model, *_escape_apart(df), Column.bit_class]


def harmful_escapes(df: pd.DataFrame) -> pd.DataFrame:
    """Harmful trials that no detector caught, with their scenario cell's columns as text."""
    harmful = df[(df[Column.fired] == True) & (df[Column.effect] == Effect.HARMFUL)]  # noqa: E712
    missed = harmful[harmful[Column.detected] != True]  # noqa: E712
    return as_text(missed, _escape_apart(df))


def escapes(df: pd.DataFrame) -> list[dict[str, object]]:
    """The loss damage (loss_delta, final loss minus its golden run's) of harmful trials that no
    detector caught, per scenario cell (`escape_cell`). A blank loss_delta is a final loss that
    is not a number: the damage has no size, and is counted apart."""
    harmful = df[(df[Column.fired] == True) & (df[Column.effect] == Effect.HARMFUL)]  # noqa: E712
    cell = escape_cell(df)
    totals = as_text(harmful, _escape_apart(df)).groupby(cell, dropna=False).size()
    rows = []
    for key, missed in harmful_escapes(df).groupby(cell, dropna=False):
        delta = pd.to_numeric(missed[Column.loss_delta], errors="coerce")
        finite = delta[delta.map(math.isfinite)]
        row = _named(cell, key)
        row["escaped / harmful"] = f"{len(missed)}/{totals[key]}"
        row["loss_delta median"] = f"{finite.median():.4g}" if len(finite) else "-"
        row["largest abs loss_delta"] = f"{finite.abs().max():.4g}" if len(finite) else "-"
        row["final loss NaN/Inf"] = len(missed) - len(finite)
        rows.append(row)
    return rows


def sees_and_misses(df: pd.DataFrame) -> list[dict[str, object]]:
    """Per scenario (site, model, scope, persistence, bit class; workload, dtype, precision and
    the other settings where the trials hold several): what share of fired trials each detector
    caught, with n and a 95% Wilson interval. A dash: the detector was not on in those trials."""
    fired = silent_fired(df)
    told = [*sweep_columns(df), *setting_columns(df, always=(Column.scope, Column.persistence))]
    keys = [Column.site, Column.model, *told, Column.bit_class]
    rows = []
    for key, g in as_text(fired, told).groupby(keys, dropna=False):
        row = _named(keys, key)
        for d in detector_names(df):
            on = g[named(g[Column.detectors], d)]
            caught = named(on[Column.detected_by], d)
            row[d] = rate_text(int(caught.sum()), len(on)) if len(on) else "-"
        row["harmful"] = int((g[Column.effect] == Effect.HARMFUL).sum())
        rows.append(row)
    return rows


def recovery(df: pd.DataFrame) -> str:
    """What recovery did: how each trial got back (an in-step retry of the reduction, a rollback,
    a rollback with quarantine, counted apart), steps lost, time, nodes that left, verdicts."""
    verdicts = df[Column.recovery_verdict].map(lambda v: v if isinstance(v, str) else "")
    tried = df[verdicts != ""]
    if tried.empty:
        return ""
    rows = []
    for _, r in tried.iterrows():
        after = r[Column.final_nodes]
        shrunk = pd.notna(after) and int(after) < int(r[Column.nodes])
        rows.append(
            {
                "trial": r[Column.trial_id],
                Column.recovered: r[Column.recovered],
                Column.recoveries: int(r[Column.recoveries]),
                "quarantined nodes": r[Column.quarantined_nodes] or "-",
                "world after": f"{int(after)} nodes" + (" (shrunk)" if shrunk else "")
                if pd.notna(after) else "-",
                "restored from step": r[Column.restore_step] or "-",
                "steps lost": int(r[Column.steps_lost]),
                "recovery s": r[Column.recovery_s] if pd.notna(r[Column.recovery_s]) else "-",
                "matches golden": r[Column.golden_match],
                Column.effect: r[Column.effect],
                "how": r[Column.recovery_verdict],
            }
        )  # fmt: skip
    recovered = tried[tried[Column.recovered] == True]  # noqa: E712 (True, False or blank)
    kinds = [recovery_kinds(v) for v in verdicts[recovered.index]]
    by_kind = {k: sum(k in found for found in kinds) for k in RECOVERY_KINDS}
    same = int((recovered[Column.golden_match] == True).sum())  # noqa: E712
    head = (
        f"{len(recovered)} of {len(tried)} trials that needed recovery got back: "
        f"{by_kind['retry']} by an in-step retry of the reduction, {by_kind['rollback']} by a "
        f"rollback, {by_kind['rollback+quarantine']} by a rollback with quarantine (a trial "
        f"may take several); {same} of them ended bit-identical to their golden run. A "
        "restore step of -1 means from the initial weights."
    )
    return "## Recovery\n\n" + head + "\n\n" + markdown_table(rows)


def by_parallel(df: pd.DataFrame) -> list[dict[str, object]]:
    """Each detector's catch rate per fault (site, model, dtype; the sweep's other columns, the
    settings that tell the trials' scenarios apart and the bit class, where there are several)
    under each parallelism the trials ran with, side by side: what a check loses when the model
    is sharded. Empty unless the trials span more than one (a table written before sharding
    existed reads as ddp)."""
    modes = sorted(set(df[Column.parallel]))  # ddp, fsdp, hsdp: replicas first, as names sort
    if len(modes) < 2:
        return []
    fired = silent_fired(df)
    swept = [c for c in sweep_columns(df) if c != Column.dtype]
    told = [*swept, *setting_columns(df)]
    if fired[Column.bit_class].fillna("").nunique() > 1:
        told.append(Column.bit_class)
    keys = [Column.site, Column.model, Column.dtype, *told]
    rows = []
    for key, cell in as_text(fired, told).groupby(keys, sort=True):
        for d in detector_names(cell):
            row = {**_named(keys, key), "detector": d}
            for mode in modes:
                at = cell[cell[Column.parallel] == mode]
                on = at[named(at[Column.detectors], d)]
                caught = int(named(on[Column.detected_by], d).sum())
                # The check did not run beside this fault there, or no run there held the fault.
                missing = "not run" if len(at) else "no trials"
                row[mode] = rate_text(caught, len(on)) if len(on) else missing
            rows.append(row)
    return rows


def false_positive_counts(df: pd.DataFrame) -> dict[str, Counts]:
    """Per detector: (clean trials it alerted in, clean trials it ran in). A trial is one
    outcome, alert or none, so k/n is a proportion with a Wilson interval; a count of alerts
    per trial would not be one."""
    clean = df[df[Column.site] == Site.NONE]
    found = {}
    for d in detector_names(df):
        on = clean[named(clean[Column.detectors], d)]
        found[d] = (int(named(on[Column.alert_detectors], d).sum()), len(on))
    return found


def false_alert_counts(df: pd.DataFrame) -> dict[str, tuple[int, int] | None]:
    """Per detector: (its alerts in the clean trials it ran in, those trials), the false
    positive rate of docs/design.md section 5 as a count over a count (a trial may raise
    several); None where a clean trial alerted in a table written before `alert_counts`, whose
    alerts cannot be laid on a check."""
    clean = df[df[Column.site] == Site.NONE]
    counts = clean[Column.alert_counts].map(
        lambda text: {k: int(v) for k, v in (x.split("=") for x in text.split(";"))} if text else {}
    )
    unrecorded = (clean[Column.alerts] > 0) & (counts.map(len) == 0)
    found: dict[str, tuple[int, int] | None] = {}
    for d in detector_names(df):
        on = named(clean[Column.detectors], d)
        alerts = sum(c.get(d, 0) for c in counts[on])
        found[d] = None if unrecorded[on].any() else (alerts, int(on.sum()))
    return found


def false_positives(df: pd.DataFrame) -> list[dict[str, object]]:
    """Per detector: the share of clean trials with an alert (a proportion, with its interval),
    and its alerts per clean trial (docs/design.md section 5's rate, which one noisy trial
    raises as much as many)."""
    alerts = false_alert_counts(df)
    rows = []
    for d, kn in false_positive_counts(df).items():
        counted = alerts[d]
        per = "-"
        if counted is not None and counted[1]:
            per = f"{counted[0]}/{counted[1]} = {counted[0] / counted[1]:.3g}"
        rows.append(
            {"detector": d, "clean trials with an alert": rate_text(*kn),
             "alerts per clean trial": per}
        )  # fmt: skip
    return rows


def per_trial(df: pd.DataFrame) -> str:
    """All detectors' alerts in the clean trials, as a count beside the trials: not k/n, since
    one trial may raise several."""
    clean = df[df[Column.site] == Site.NONE]
    if clean.empty:
        return "no clean trials"
    alerts, n = int(clean[Column.alerts].sum()), len(clean)
    return f"{alerts} {_plural(alerts, 'alert')} in {n} {_plural(n, 'clean trial')}"


def _plural(count: int, noun: str) -> str:
    return noun if count == 1 else noun + "s"


def own_attributions(df: pd.DataFrame) -> list[dict[str, object]]:
    """Per check, over the fired trials it caught: whether its own first alert named the
    culprits and nothing else (`attributions`), the first detector's or not. Empty for a table
    written before the column."""
    fired = silent_fired(df)
    judged = fired[Column.attributions].map(
        lambda text: dict(item.split("=") for item in text.split(";")) if text else {}
    )
    rows = []
    for d in detector_names(df):
        verdicts = [v[d] == "True" for v in judged if d in v]
        if verdicts:
            rows.append({"detector": d, "its first alert names the culprits alone":
                         rate_text(sum(verdicts), len(verdicts))})  # fmt: skip
    return rows


def detection_times(df: pd.DataFrame) -> list[dict[str, object]]:
    """Per first detector, how soon it caught the silent faults it caught first (the crash
    model's trials left out, as from every catch rate)."""
    fired = silent_fired(df)
    caught = fired[fired[Column.detected] == True]  # noqa: E712
    rows = []
    for d, g in caught.groupby(Column.first_detector):
        ttd = g[Column.ttd_steps]
        rows.append(
            {
                "first detector": d,
                "n": len(g),
                "ttd steps (median / max)": f"{ttd.median():g} / {ttd.max():g}",
                "ttd seconds (median)": f"{g[Column.ttd_seconds].median():.4f}",
                Column.contained: rate_text(int(g[Column.contained].sum()), len(g)),
                "attribution correct": rate_text(int(g[Column.attribution_correct].sum()), len(g)),
            }
        )
    return rows
