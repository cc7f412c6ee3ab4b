"""overhead.csv of the runs a report or a plan reads: each (check, interval)'s step overhead,
its floor and its cost against plain DDP, as the medians over the runs that measured it
(docs/design.md, section 4).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from harness.analysis.tables import ReportError
from harness.results.schema import OVERHEAD_COLUMNS, OVERHEAD_FILE, OVERHEAD_REQUIRED


def load_overhead(dirs: list[Path]) -> pd.DataFrame | None:
    """Every overhead.csv under the given folders (a sweep holds one per job), one row per
    (detector, interval) with the medians over the runs that measured it and their number;
    None when no run measured overhead."""
    files = [f for d in dirs for f in sorted(d.rglob(OVERHEAD_FILE))]
    if not files:
        return None
    frames = []
    for f in files:
        try:
            table = pd.read_csv(f, dtype=str, keep_default_na=False)
        except (ValueError, OSError) as exc:  # pandas: an empty or malformed file
            raise ReportError(f"{f}: unreadable: {exc}") from None
        missing = [c for c in OVERHEAD_REQUIRED if c not in table.columns]
        if missing:
            raise ReportError(f"{f}: missing columns: {', '.join(missing)}")
        if "overhead_vs_ddp_pct" not in table.columns:  # measured before plain DDP was
            table["overhead_vs_ddp_pct"] = ""
        try:
            for column in ("overhead_pct", "floor_pct", "overhead_vs_ddp_pct"):
                table[column] = pd.to_numeric(table[column].replace("", math.nan))
        except ValueError as exc:
            raise ReportError(f"{f}: unreadable: {exc}") from None
        frames.append(table[OVERHEAD_COLUMNS])
    table = pd.concat(frames, ignore_index=True)
    merged = table.groupby(["detector", "interval"], as_index=False).agg(
        overhead_pct=("overhead_pct", "median"),
        floor_pct=("floor_pct", "median"),
        overhead_vs_ddp_pct=("overhead_vs_ddp_pct", "median"),
        runs=("overhead_pct", "size"),
    )
    merged["steps"] = pd.to_numeric(merged["interval"].replace("", math.nan))
    return merged.sort_values(["detector", "steps"], ignore_index=True)
