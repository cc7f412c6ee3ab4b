"""What an audit interval buys: each periodic check's catch rate and time to detection at each
interval a run gave it (a scenario's `checks:` grid, as in `campaign=audit_frequency`), read
from trials.csv's `check_intervals` and `detect_steps`."""

from __future__ import annotations

import math

import pandas as pd

from harness.analysis.tables import SWEPT, as_text, rate_text, silent_fired, sweep_columns
from harness.results.trial_row import Column


def pairs(text: object) -> dict[str, int]:
    """`name=value;...` (check_intervals, detect_steps) as a mapping; blank: empty."""
    if not isinstance(text, str):
        return {}
    return {k: int(v) for k, v in (item.split("=") for item in text.split(";") if item)}


INTERVAL_COLUMNS = [*SWEPT, "check", "interval", Column.persistence, "caught", Column.ttd_steps]


def interval_outcomes(df: pd.DataFrame) -> pd.DataFrame:
    """One row per fired trial and periodic check in it: what the trial ran on (workload, dtype,
    precision, as text), the check's interval there, whether the check itself caught the fault
    (whichever alerted first) and its time to detection."""
    rows = []
    fired = as_text(silent_fired(df), SWEPT)
    for r in fired.itertuples(index=False):
        found = pairs(r.detect_steps)
        for check, k in pairs(r.check_intervals).items():
            step = found.get(check)
            ttd = math.nan if step is None else step - int(r.inject_step)
            ran = tuple(getattr(r, c) for c in SWEPT)
            rows.append((*ran, check, k, r.persistence, step is not None, ttd))
    return pd.DataFrame(rows, columns=INTERVAL_COLUMNS)


def audit_intervals(df: pd.DataFrame) -> list[dict[str, object]]:
    """Catch rate and time to detection of each periodic check at each interval it ran at, per
    persistence: what an audit interval buys; per workload, dtype and precision where the trials
    hold several (a sweep's jobs train other models: a rate over them is none of theirs). Empty
    unless a check ran at several intervals."""
    outcomes = interval_outcomes(df)
    if outcomes.empty or outcomes.groupby("check")["interval"].nunique().max() < 2:
        return []
    swept = sweep_columns(df)
    rows = []
    for (*ran, check, k, persistence), g in outcomes.groupby(
        [*swept, "check", "interval", Column.persistence]
    ):
        ttd = g[Column.ttd_steps].dropna()
        rows.append(
            {
                **{c: value or "-" for c, value in zip(swept, ran, strict=True)},
                "check": check,
                "interval": k,
                Column.persistence: persistence,
                "caught": rate_text(int(g["caught"].sum()), len(g)),
                "ttd steps (median / max)": f"{ttd.median():g} / {ttd.max():g}"
                if len(ttd)
                else "-",
            }
        )
    return rows
