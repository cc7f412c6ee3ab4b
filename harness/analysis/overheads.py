"""overhead.csv of the runs a report or a plan reads: each (check, interval)'s step overhead,
its floor and its cost against plain DDP on each workload, as the medians over the runs that
measured it (docs/design.md, section 4).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.analysis.tables import ReportError, distinct
from harness.results.folder import TRIALS_FILE
from harness.results.schema import OVERHEAD_COLUMNS, OVERHEAD_FILE, OVERHEAD_REQUIRED
from harness.results.trial_row import Column

# A check's cost is a share of its workload's step: runs of other workloads (or dtypes, or
# precisions) measure other costs, and a median over them is none of them.
RAN_ON = [Column.workload, Column.dtype, Column.precision]


def load_overhead(dirs: list[Path], blank: tuple[str, ...] = ()) -> pd.DataFrame | None:
    """Every overhead.csv under the given folders (a sweep holds one per job), one row per
    (workload, dtype, precision, detector, interval) with the medians over the runs that
    measured it and their number, and one run's lowest and highest round (NaN where several
    runs measured it, or its table predates them); None when no run measured overhead. A run's
    workload, dtype and precision are those of its trials.csv; without one, the other runs'
    when they measured one workload, else blank; the RAN_ON columns in `blank` blank in every
    run (what sdc-regress compares with a table written without them)."""
    distinct(dirs)
    files = [(d, f) for d in dirs for f in sorted(d.rglob(OVERHEAD_FILE))]
    if not files:
        return None
    frames = []
    for d, f in files:
        try:
            table = pd.read_csv(f, dtype=str, keep_default_na=False)
        except (ValueError, OSError) as exc:  # pandas: an empty or malformed file
            raise ReportError(f"{f}: unreadable: {exc}") from None
        missing = [c for c in OVERHEAD_REQUIRED if c not in table.columns]
        if missing:
            raise ReportError(f"{f}: missing columns: {', '.join(missing)}")
        for column in OVERHEAD_COLUMNS[len(OVERHEAD_REQUIRED) :]:  # measured before they were
            if column not in table.columns:
                table[column] = ""
        try:
            for column in OVERHEAD_COLUMNS[2:]:
                table[column] = pd.to_numeric(table[column].replace("", math.nan))
        except ValueError as exc:
            raise ReportError(f"{f}: unreadable: {exc}") from None
        frames.append(table[OVERHEAD_COLUMNS].assign(**_ran_on(d, f.parent)))
    table = pd.concat(frames, ignore_index=True)
    known = table.loc[table[Column.workload] != "", RAN_ON].drop_duplicates()
    if len(known) == 1:  # a file without trials beside it is of the one workload measured
        table[RAN_ON] = known.to_numpy()[0]
    table[list(blank)] = ""
    merged = table.groupby([*RAN_ON, "detector", "interval"], as_index=False).agg(
        overhead_pct=("overhead_pct", "median"),
        floor_pct=("floor_pct", "median"),
        overhead_vs_ddp_pct=("overhead_vs_ddp_pct", "median"),
        overhead_low_pct=("overhead_low_pct", "first"),
        overhead_high_pct=("overhead_high_pct", "first"),
        runs=("overhead_pct", "size"),
    )
    # Several runs (a sweep's jobs, which may differ in more than these columns) spread over
    # their differences too, which no round measures.
    without_pooled_rounds(merged, merged["runs"])
    merged["steps"] = pd.to_numeric(merged["interval"].replace("", math.nan))
    return merged.sort_values([*RAN_ON, "detector", "steps"], ignore_index=True)


# A check's lowest and highest timed round in one run (overhead.csv).
ROUNDS = ["overhead_low_pct", "overhead_high_pct"]


def without_pooled_rounds(table: pd.DataFrame, pooled: pd.Series) -> None:
    """Blank, in place, the rounds of the rows that pool `pooled` > 1 rows: one run's rounds
    spread over its own noise, not around a median over others."""
    table.loc[pooled > 1, ROUNDS] = math.nan


def _ran_on(top: Path, folder: Path) -> dict[str, str]:
    """The workload, dtype and precision of the run in `folder`: its trials.csv's, or the
    nearest one's up to `top` (a job's overhead.csv beside its trials.csv, or below them); blank
    without."""
    for at in (folder, *folder.parents):
        trials = at / TRIALS_FILE
        if trials.is_file():
            try:
                ran = pd.read_csv(
                    trials, usecols=lambda c: c in RAN_ON, dtype=str, keep_default_na=False
                )
            except (ValueError, OSError) as exc:
                raise ReportError(f"{trials}: unreadable: {exc}") from None
            # A table written before the precision column: blank, as a run without trials.
            return {c: ",".join(sorted(ran[c].unique())) if c in ran else "" for c in RAN_ON}
        if at == top:
            break
    return dict.fromkeys(RAN_ON, "")


def ran_on(table: pd.DataFrame) -> list[str]:
    """The workloads the table's runs measured, as `workload in dtype`, and a mixed precision
    where there was one (`gpt in float32 (bf16-mixed)`)."""
    ran = table[RAN_ON].drop_duplicates().itertuples(index=False)
    return [ran_label(w, d, p) if w else "an unknown workload" for w, d, p in ran]


def rounds_text(low: float, high: float) -> str:
    """A check's lowest and highest round as the report and sdc-regress show them; a dash where
    none were recorded."""
    return "-" if math.isnan(low) else f"{low:.2f}% to {high:.2f}%"


def ran_label(workload: str, dtype: str, precision: object) -> str:
    """`workload in dtype`, and the precision where it is a mixed one or was not recorded (a
    table written before the column)."""
    if not isinstance(precision, str) or not precision:
        return f"{workload} in {dtype} (precision not recorded)"
    # Lightning names a mixed precision `*-mixed`; a `*-true` one is the dtype itself.
    mixed = precision.endswith("-mixed")
    return f"{workload} in {dtype}" + (f" ({precision})" if mixed else "")
