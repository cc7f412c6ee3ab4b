"""Hand-built rows of trials.csv for the analysis's tests: each row is what a campaign would
have written, read back through TrialRow, so the tests frame it as load_trials does."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.analysis.tables import trials_frame
from harness.results.trial_row import TrialRow, write_trials

# A fired-or-not trial needs these; a test states the cells it is about.
REQUIRED = dict(
    trial_id="t",
    seed="0",
    workload="mlp",
    dtype="float32",
    nodes="4",
    ranks_per_node="1",
    site="grad",
    model="scale",
    fired="False",
    effect="none",
    detected="False",
    alerts="0",
    golden_final_loss="1.0",
)


def row(**cells: object) -> TrialRow:
    """A TrialRow from cells as trials.csv holds them (`True`, `nan_inf;replay`, `3`)."""
    return TrialRow.from_cells({**REQUIRED, **{k: str(v) for k, v in cells.items()}})


def frame(*rows: dict) -> pd.DataFrame:
    """Rows given as cells, framed as load_trials frames a trials.csv."""
    return trials_frame([row(**cells) for cells in rows])


def write(path: Path, rows: list[dict]) -> None:
    """A trials.csv of rows given as cells."""
    write_trials(path, [row(**cells) for cells in rows])
