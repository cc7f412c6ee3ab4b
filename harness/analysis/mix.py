"""Shares under a weighed fault mix (harness/config/mix.py): what share of the SDC a fleet sees a
set of checks would catch, when the run's trials sample the fault classes of that mix.

Each fired trial stands for its class's weight spread evenly over the class's fired trials, so a
class counts by its weight, not by how many trials it ran. A share is a ratio of weighed sums:

    share caught            = sum(w caught) / sum(w)             over the fired trials
    share of damaging caught = sum(w caught) / sum(w)             over the fired, damaging trials

Its 95% interval is Wilson's at the Kish effective sample size n = (sum w)^2 / sum(w^2) (a
weighed proportion is as uncertain as an unweighed one of n trials), and the sensitivity range is
the least and most share found with each class's weight halved, and doubled, one at a time:
how far the answer leans on any one published figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from harness.analysis.tables import PUBLISHED, damaged, detector_names, wilson
from harness.results.trial_row import Column

SENSITIVITY = (0.5, 2.0)


@dataclass(frozen=True)
class Share:
    """A weighed share, its 95% interval, and its range under the weights' sensitivity."""

    value: float
    low: float
    high: float
    n_effective: float
    least: float  # the least share with one class's weight halved or doubled
    most: float

    def text(self) -> str:
        return f"{self.value:.1%} [{self.low:.1%}, {self.high:.1%}]"

    def range_text(self) -> str:
        return f"{self.least:.1%} to {self.most:.1%}"


def weighed(df: pd.DataFrame) -> bool:
    """Whether the trials come from a campaign that weighs its faults."""
    return Column.weight in df and bool(df[Column.weight].notna().any())


def fired_weighed(df: pd.DataFrame) -> pd.DataFrame:
    """The fired trials of the mix's classes, with `damaged` (tables.damaged)."""
    fired = df[(df[Column.fired] == True) & df[Column.weight].notna()].copy()  # noqa: E712
    fired["damaged"] = damaged(fired)
    return fired


def trial_weights(fired: pd.DataFrame, scale: dict[str, float] | None = None) -> pd.Series:
    """Each fired trial's share of its class's weight (times `scale[class]`, when given)."""
    count = fired.groupby(Column.fault_class)[Column.weight].transform("size")
    factor = fired[Column.fault_class].map(lambda c: (scale or {}).get(c, 1.0))
    return fired[Column.weight] * factor / count


def share(fired: pd.DataFrame, caught: pd.Series, among: pd.Series) -> Share | None:
    """The weighed share of the trials `among` that `caught` holds, each class's weight spread
    over its trials in `fired` (the fired trials a check set ran in); None without any."""
    if not among.any():
        return None

    def value(scale: dict[str, float] | None) -> float:
        w = trial_weights(fired, scale)[among]
        return float((w * caught[among]).sum() / w.sum())

    n = kish(trial_weights(fired)[among])
    point = value(None)
    low, high = wilson(point * n, n)
    classes = sorted(fired.loc[among, Column.fault_class].unique())
    varied = [value({c: f}) for c in classes for f in SENSITIVITY]
    return Share(point, low, high, n, min(varied), max(varied))


def kish(w: pd.Series) -> float:
    """The Kish effective number of trials of weights `w`: (sum w)^2 / sum(w^2)."""
    return float(w.sum() ** 2 / (w**2).sum())


def covered(df: pd.DataFrame, sampled: pd.DataFrame) -> float:
    """The share of the mix's weight whose classes the trials `sampled` hold (one or more)."""
    weights = mix_weights(df)
    held = set(sampled[Column.fault_class])
    return sum(w for c, w in weights.items() if c in held) / sum(weights.values())


def conflicts(df: pd.DataFrame) -> list[str]:
    """Classes that the trials give more than one weight (runs of different mixes), named."""
    planned = df[df[Column.weight].notna()]
    weights = planned.groupby(Column.fault_class)[Column.weight].unique()
    return [f"{c} ({', '.join(f'{w:g}' for w in sorted(ws))})"
            for c, ws in weights.items() if len(ws) > 1]  # fmt: skip


def mix_weights(df: pd.DataFrame) -> dict[str, float]:
    """Each class's weight as the campaign gives it (one per class: `conflicts` is empty)."""
    planned = df[df[Column.weight].notna()]
    return {
        str(c): float(w)
        for c, w in planned.groupby(Column.fault_class)[Column.weight].first().items()
    }


def check_sets(df: pd.DataFrame) -> list[tuple[str, tuple[str, ...]]]:
    """The sets the report weighs: every check alone, the published three, all the run's."""
    names = detector_names(df)
    sets = [(name, (name,)) for name in names]
    if set(PUBLISHED) <= set(names) and len(names) > len(PUBLISHED):
        sets.append(("published three: " + " + ".join(PUBLISHED), PUBLISHED))
    if len(names) > 1:
        sets.append(("all checks", tuple(names)))
    return sets


def _names(cells: pd.Series) -> pd.Series:
    """A `;`-joined column as sets of names."""
    return cells.map(lambda s: set(s.split(";")) if isinstance(s, str) else set())


def caught_by(fired: pd.DataFrame, checks: tuple[str, ...]) -> pd.Series:
    """Whether any of `checks` alerted at or after the injection, per trial."""
    return _names(fired[Column.detected_by]).map(lambda found: bool(found & set(checks)))


def ran(fired: pd.DataFrame, checks: tuple[str, ...]) -> pd.Series:
    """Whether every one of `checks` ran, per trial."""
    return _names(fired[Column.detectors]).map(lambda names: set(checks) <= names)


def shares(df: pd.DataFrame) -> list[dict[str, object]]:
    """Per check set, among the fired trials in which every member ran: the share of the mix's
    SDC caught and of its damaging SDC, with intervals and the weights' sensitivity range, and
    the share of the mix's weight those trials cover (a class none of them sampled counts for
    nothing, and says so here)."""
    fired = fired_weighed(df)
    rows = []
    for label, checks in check_sets(df):
        sub = fired[ran(fired, checks)]
        caught = caught_by(sub, checks)
        every = share(sub, caught, pd.Series(True, index=sub.index))
        harmful = share(sub, caught, sub["damaged"])
        rows.append({
            "checks": label,
            "expected share caught under the field mix": every.text() if every else "n=0",
            "sensitivity (one weight x0.5, x2)": every.range_text() if every else "-",
            "expected share of damaging faults caught": harmful.text() if harmful else "n=0",
            "sensitivity (damaging)": harmful.range_text() if harmful else "-",
            "mix covered": f"{covered(df, sub):.1%}",
        })  # fmt: skip
    return rows


def classes(df: pd.DataFrame) -> list[dict[str, object]]:
    """The mix as the run sampled it: each class's weight and its fired and damaging trials."""
    fired = fired_weighed(df)
    planned = df[df[Column.weight].notna()]
    weights = mix_weights(df)
    total = sum(weights.values())
    rows = []
    for name, group in planned.groupby(Column.fault_class, sort=True):
        mine = fired[fired[Column.fault_class] == name]
        weight = weights[str(name)]
        rows.append({
            "fault class": name,
            "weight (share)": f"{weight:g} ({weight / total:.1%})",
            "trials": len(group),
            "fired trials": len(mine),
            "damaging": int(mine["damaged"].sum()),
        })  # fmt: skip
    return rows
