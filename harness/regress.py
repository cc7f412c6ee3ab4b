"""`sdc-regress BASELINE_DIR CURRENT_DIR`: did coverage drop or overhead grow since the baseline?

Exit 0 when nothing regressed, 1 with a table of what did, 2 with one line on bad input (a missing
folder, no trials.csv, missing columns), before anything is compared. A regression is:

- a catch rate that fell: per detector (the report's catch-rate table) and per scenario cell
  (site, model, bit class), the current 95% Wilson upper bound below the baseline's lower bound,
  so that the seed-to-seed noise of two runs of the same code is never one;
- a new false positive: a detector with no alert in the baseline's clean trials has one now;
- an overhead more than 25% above the baseline's, per (detector, interval) in overhead.csv,
  when both folders have one;
- a new blind spot (DESIGN section 5): a cell that is one now and was not in the baseline.

Every rate comes from the report's own tables (harness.report), so a regression is judged on
exactly the numbers the report shows.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.report import (
    ReportError,
    _rate,
    _table,
    catch_rates,
    cells,
    false_positives,
    load_trials,
    wilson,
)

OVERHEAD_FILE = "overhead.csv"
OVERHEAD_COLUMNS = ["detector", "interval", "overhead_pct", "floor_pct"]
OVERHEAD_GROWTH = 0.25
CELL_KEYS = ("site", "model", "bit class")
CELL_RATES = ("catch rate (fired)", "catch rate (harmful)")


@dataclass(frozen=True)
class Run:
    """One folder's tables: its trials, and its overhead when it measured one."""

    trials: pd.DataFrame
    overhead: pd.DataFrame | None


def load(folder: Path) -> Run:
    """Read a run or sweep folder; any problem raises ReportError naming the folder or file."""
    return Run(_trials(folder), _overhead(folder / OVERHEAD_FILE))


def _trials(folder: Path) -> pd.DataFrame:
    try:
        return load_trials([folder])
    except ReportError:
        raise
    except (ValueError, OSError) as exc:  # pandas: an empty or malformed trials.csv
        raise ReportError(f"{folder}: unreadable trials.csv: {exc}") from None


def _overhead(path: Path) -> pd.DataFrame | None:
    if not path.exists():
        return None
    try:
        table = pd.read_csv(path, dtype={"detector": str, "interval": str}, keep_default_na=False)
        missing = [c for c in OVERHEAD_COLUMNS if c not in table.columns]
        if missing:
            raise ReportError(f"{path}: missing columns: {', '.join(missing)}")
        table["overhead_pct"] = pd.to_numeric(table["overhead_pct"])
    except ReportError:
        raise
    except (ValueError, OSError) as exc:
        raise ReportError(f"{path}: unreadable: {exc}") from None
    return table


def counts(rate: str) -> tuple[int, int]:
    """(k, n) back from a rate as the report writes it: "k/n = ..." or "n=0"."""
    match = re.match(r"(\d+)/(\d+)", rate)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def fell(baseline: str, current: str) -> bool:
    """The current upper bound below the baseline's lower bound (False when either n is 0)."""
    low, _ = wilson(*counts(baseline))
    _, high = wilson(*counts(current))
    return high < low


def _finding(kind: str, where: str, baseline: str, current: str) -> dict[str, str]:
    return {"regression": kind, "where": where, "baseline": baseline, "current": current}


def detector_drops(base: pd.DataFrame, cur: pd.DataFrame) -> list[dict[str, str]]:
    """Per detector and per trial set (all fired, non-masked, harmful). A detector the baseline
    ran and the current run lacks caught nothing in it: switching a check off is a regression."""
    found = []
    current = {row["trials"]: row for row in catch_rates(cur)}
    for row in catch_rates(base):
        now = current.get(row["trials"])
        if now is None:
            continue
        _, n = counts(now["any detector"])
        for detector, rate in row.items():
            if detector == "trials":
                continue
            rate_now = now.get(detector, f"{_rate(0, n)} (not run)")
            if fell(rate, rate_now):
                where = f"{detector}, {row['trials']} trials"
                found.append(_finding("catch rate fell", where, rate, rate_now))
    return found


def _cells(df: pd.DataFrame) -> dict[tuple, dict[str, object]]:
    return {tuple(row[k] for k in CELL_KEYS): row for row in cells(df)}


def _cell_name(key: tuple) -> str:
    return " / ".join(str(k) for k in key)


def cell_drops(base: pd.DataFrame, cur: pd.DataFrame) -> list[dict[str, str]]:
    found = []
    current = _cells(cur)
    for key, row in _cells(base).items():
        now = current.get(key)
        if now is None:
            continue
        for column in CELL_RATES:
            if fell(row[column], now[column]):
                where = f"{_cell_name(key)}, {column}"
                found.append(_finding("catch rate fell", where, row[column], now[column]))
    return found


def _blind(row: dict[str, object] | None) -> bool:
    return row is not None and "yes" in str(row["blind spot"])


def new_blind_spots(base: pd.DataFrame, cur: pd.DataFrame) -> list[dict[str, str]]:
    found = []
    before = _cells(base)
    for key, row in _cells(cur).items():
        if _blind(row) and not _blind(before.get(key)):
            was = before[key]["catch rate (harmful)"] if key in before else "not in baseline"
            where = f"{_cell_name(key)}, harmful trials"
            found.append(
                _finding("new blind spot", where, str(was), str(row["catch rate (harmful)"]))
            )
    return found


def new_false_positives(base: pd.DataFrame, cur: pd.DataFrame) -> list[dict[str, str]]:
    column = "clean trials with an alert"
    before = {row["detector"]: row[column] for row in false_positives(base)}
    found = []
    for row in false_positives(cur):
        was = before.get(row["detector"], "not run")
        if counts(row[column])[0] > 0 and counts(was)[0] == 0:
            found.append(_finding("new false positive", row["detector"], was, row[column]))
    return found


def overhead_growth(base: pd.DataFrame | None, cur: pd.DataFrame | None) -> list[dict[str, str]]:
    """More than 25% above the baseline's overhead (relative to its size, so a negative or zero
    baseline overhead makes any increase past it count)."""
    if base is None or cur is None:
        return []
    joined = base.merge(cur, on=["detector", "interval"], suffixes=("_base", "_cur"))
    found = []
    for row in joined.itertuples(index=False):
        was, now = row.overhead_pct_base, row.overhead_pct_cur
        if now - was > OVERHEAD_GROWTH * abs(was):
            where = f"{row.detector}, interval {row.interval or '-'}"
            found.append(_finding("overhead grew", where, f"{was:.2f}%", f"{now:.2f}%"))
    return found


def regressions(base: Run, cur: Run) -> list[dict[str, str]]:
    return [
        *detector_drops(base.trials, cur.trials),
        *cell_drops(base.trials, cur.trials),
        *new_false_positives(base.trials, cur.trials),
        *overhead_growth(base.overhead, cur.overhead),
        *new_blind_spots(base.trials, cur.trials),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sdc-regress", description=__doc__.splitlines()[0])
    parser.add_argument("baseline", type=Path, help="the baseline run folder (results/baseline)")
    parser.add_argument("current", type=Path, help="the run to judge against it")
    args = parser.parse_args(argv)
    try:
        base, cur = load(args.baseline), load(args.current)
    except ReportError as exc:
        print(f"sdc-regress: {exc}", file=sys.stderr)
        sys.exit(2)
    found = regressions(base, cur)
    sizes = f"{len(base.trials)} baseline trials, {len(cur.trials)} current trials"
    if not found:
        print(f"sdc-regress: no regression ({sizes})")
        return
    print(_table(found), end="")
    print(f"sdc-regress: {len(found)} regressions ({sizes})", file=sys.stderr)
    sys.exit(1)
