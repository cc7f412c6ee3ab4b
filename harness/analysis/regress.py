"""`sdc-regress BASELINE_DIR CURRENT_DIR`: did coverage drop or overhead grow since the baseline?

Exit 0 when nothing regressed, 1 with a table of what did, 2 with one line on bad input (a missing
folder, no trials.csv, missing columns, two runs that share no scenario cell, a run whose campaign
stopped before its end), before anything is compared. A regression is:

- a catch rate that fell: per detector (the report's catch-rate table, over the scenario cells
  both runs hold, so that a scenario dropped or added moves no rate), per scenario cell (site,
  model, bit class and the settings that tell scenarios apart), and per detector in each cell
  (a check that stops catching a cell another check still catches), the current 95% Wilson
  upper bound below the baseline's lower bound,
  so that the seed-to-seed noise of two runs of the same code is never one;
- a false positive: a detector with no alert in the baseline's clean trials has one now, or
  its rate of clean trials with an alert rose (the current lower bound above the baseline's
  upper bound), or, where that share held, its alerts per clean trial rose (docs/design.md
  section 5's rate; the same rule on its score interval);
- an overhead (a check's against the hook, the hook's own against plain DDP) more than 25%
  above the baseline's and more than 5 percentage points, with every current round above
  every baseline round (`overhead_low_pct` and `overhead_high_pct`): a 4-rank world on 2
  cores moves a round by ten points and more (results/baseline/README.md), so a growth
  within the rounds' spread is named before the verdict and not judged one; per
  (workload, dtype, precision, detector, interval) in the overhead.csv files that a campaign
  with `campaign.overhead` writes, when both folders have them;
- a new blind spot (docs/design.md, section 5): a cell that is one now and was not in the baseline
  (a cell new to the run, or one whose catch rate fell as above: 0/3 then 0/5 caught is one
  now by its narrower interval alone, and the same code's).

A column of the cells' keys that either run's tables were written without (`precision`,
`fault_settings` before they existed) is left out of both runs' cells, and said so: each run's
scenarios then merge as the older table merged them. Before the verdict it names the baseline's
scenario cells and overheads that the current run has none of (they cannot compare: a scenario
or check dropped), and says whether both runs computed in the same environment
(campaign.json, harness.runtime.environment). Only then can rows compare bit for bit: golden
losses, `golden_match` and which trials are masked (bit-identical to their golden run, no
damaged state). It reports how many shared trials (a trial: its job's folder in a sweep, and
its id) kept their effect and golden loss, as information: a change of code may change them.
Across environments these are not compared at all, since a masked trial there may turn benign
from rounding alone; every regression above is a rate with its interval and compares either
way.

Every count comes from the report's own functions (harness.analysis.tables), so a regression is
judged on the numbers the report shows, but for the per-detector rates, which pool only the cells
both runs hold.
"""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from harness.analysis.overheads import RAN_ON, load_overhead, ran_label, ran_on, rounds_text
from harness.analysis.tables import (
    ANY,
    APART,
    Cell,
    Counts,
    OneLineParser,
    ReportError,
    by_cell,
    catch_counts,
    cell_stats,
    detector_names,
    false_alert_counts,
    false_positive_counts,
    load_trials,
    markdown_table,
    named,
    per_trial_text,
    poisson_interval,
    rate_text,
    unfinished,
    wilson,
)
from harness.core.vocabulary import DAMAGING
from harness.results import machine
from harness.results.folder import TRIALS_FILE
from harness.results.schema import HOOK
from harness.results.trial_row import Column

# A trial's place in its run or sweep: a sweep's jobs repeat the same trial ids, so a trial is
# its job's folder (relative to the folder given, "." for a run) and its id.
JOB = "job"
OVERHEAD_GROWTH = 0.25
# A growth below this many percentage points is not evidence even with rounds clear of the
# baseline's: one of a few rounds of a small overhead can stand apart by that much.
OVERHEAD_NOISE_PP = 5.0


@dataclass(frozen=True)
class Run:
    """One folder's tables: its trials, and its overhead when it measured one."""

    trials: pd.DataFrame  # with JOB
    overhead: pd.DataFrame | None
    environment: dict[str, str] | None  # None: not recorded, or differing within a sweep
    folder: Path
    # The columns that tell cells apart (APART) that some trials.csv of it was written without.
    unwritten: frozenset[str] = frozenset()
    code: dict[str, str] | None = None  # its sources' digests; None: not recorded, or differing


def load(folder: Path) -> Run:
    """Read a run or sweep folder; any problem raises ReportError naming the folder or file."""
    trials = _trials(folder)
    trials[JOB] = [str(Path(r).relative_to(folder)) for r in trials["run"]]
    runs = [Path(r) for r in sorted(trials["run"].unique())]
    unwritten = frozenset(c for run in runs for c in APART if c not in _header(run / TRIALS_FILE))
    environment, code = machine.of_runs(runs), machine.code_of_runs(runs)
    return Run(trials, load_overhead([folder]), environment, folder, unwritten, code)


def _header(path: Path) -> list[str]:
    with open(path, newline="") as f:
        return next(csv.reader(f), [])


def _values(column: pd.Series) -> int:
    return column[column != ""].nunique()


def aligned(base: Run, cur: Run) -> tuple[Run, Run, list[str]]:
    """Both runs as their cells can compare: a column of the cells' keys that a table was
    written without (`precision` before it existed) is blank in both, so that each run's
    scenarios merge as that table merged them, rather than every cell read as not in the
    baseline (a known blind spot as a new one); and the columns so blanked. Overheads pool
    anew without them, but for a run that measured several of a blanked column's values
    (a precision sweep): those stay apart, match nothing and are listed as not compared."""
    missing = sorted(base.unwritten | cur.unwritten)
    if not missing:
        return base, cur, []
    ran = tuple(c for c in missing if c in RAN_ON)

    def blanked(run: Run) -> Run:
        overhead = run.overhead
        # A blank (a job written without the column) is no value of its own.
        if overhead is not None and ran and all(_values(overhead[c]) <= 1 for c in ran):
            overhead = load_overhead([run.folder], ran)
        # Overheads of several precisions cost shares of different steps, and a median over
        # them is none of them: kept apart, they match nothing and are listed as not compared.
        return replace(run, trials=run.trials.assign(**dict.fromkeys(missing)), overhead=overhead)

    return blanked(base), blanked(cur), missing


def _trials(folder: Path) -> pd.DataFrame:
    try:
        return load_trials([folder])
    except ReportError:
        raise
    except (ValueError, OSError) as exc:  # pandas: an empty or malformed trials.csv
        raise ReportError(f"{folder}: unreadable trials.csv: {exc}") from None


def fell(baseline: Counts, current: Counts) -> bool:
    """The current upper bound below the baseline's lower bound (False when either n is 0)."""
    low, _ = wilson(*baseline)
    _, high = wilson(*current)
    return high < low


def _finding(kind: str, where: str, baseline: str, current: str) -> dict[str, str]:
    return {"regression": kind, "where": where, "baseline": baseline, "current": current}


def _shared(base: pd.DataFrame, cur: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Both runs' fired trials in the scenario cells both hold: a rate pooled over each run's
    own cells moves with the scenario mix (a cell dropped that a check caught all of)."""
    before, after = by_cell(base), by_cell(cur)
    both = [key for key in before if key in after]

    def kept(cells: dict[tuple[str, ...], pd.DataFrame], like: pd.DataFrame) -> pd.DataFrame:
        return pd.concat([cells[key] for key in both]) if both else like.iloc[:0]

    return kept(before, base), kept(after, cur)


def detector_drops(base: pd.DataFrame, cur: pd.DataFrame) -> list[dict[str, str]]:
    """Per detector and per trial set (all fired, non-masked, harmful), over the cells both runs
    hold. A detector the baseline ran and the current run lacks caught nothing in it:
    switching a check off is a regression."""
    found = []
    base, cur = _shared(base, cur)
    current = catch_counts(cur)
    for trials, by in catch_counts(base).items():
        now = current[trials]
        _, n = now[ANY]
        for detector, was in by.items():
            ran = detector in now
            counted = now[detector] if ran else (0, n)
            if fell(was, counted):
                text = rate_text(*counted) + ("" if ran else " (not run)")
                where = f"{detector}, {trials} trials"
                found.append(_finding("catch rate fell", where, rate_text(*was), text))
    return found


def _cells(df: pd.DataFrame) -> dict[tuple[str, ...], Cell]:
    return {cell.key: cell for cell in cell_stats(df)}


def cell_drops(base: pd.DataFrame, cur: pd.DataFrame) -> list[dict[str, str]]:
    found = []
    current = _cells(cur)
    for key, cell in _cells(base).items():
        now = current.get(key)
        if now is None:
            continue
        for label, was, counted in (
            ("catch rate (fired)", cell.fired, now.fired),
            ("catch rate (harmful or latent)", cell.harmful, now.harmful),
        ):
            if fell(was, counted):
                where = f"{cell.name}, {label}"
                found.append(
                    _finding("catch rate fell", where, rate_text(*was), rate_text(*counted))
                )
    return found


def _caught(trials: pd.DataFrame, detector: str) -> Counts:
    return int(named(trials[Column.detected_by], detector).sum()), len(trials)


def detector_cell_drops(base: pd.DataFrame, cur: pd.DataFrame) -> list[dict[str, str]]:
    """Per detector and scenario cell, over the trials it ran in (in both runs): a check that
    stopped catching a cell another check still catches, which moves neither the cell's rate
    nor, among many cells, its own. Where the cell's rate fell too, `cell_drops` names it; a
    check the current run does not run there is `detector_drops`'s."""
    found = []
    after = by_cell(cur)
    before, now_cells = _cells(base), _cells(cur)
    for key, was_trials in by_cell(base).items():
        now_trials = after.get(key)
        if now_trials is None:
            continue
        cell_fell = {
            "all fired": fell(before[key].fired, now_cells[key].fired),
            "harmful or latent": fell(before[key].harmful, now_cells[key].harmful),
        }
        for detector in detector_names(was_trials):
            was_on = was_trials[named(was_trials[Column.detectors], detector)]
            now_on = now_trials[named(now_trials[Column.detectors], detector)]
            if now_on.empty:
                continue
            for label, was, now in (
                ("all fired", was_on, now_on),
                ("harmful or latent", *(t[t[Column.effect].isin(DAMAGING)]
                                        for t in (was_on, now_on))),
            ):  # fmt: skip
                was_caught, now_caught = _caught(was, detector), _caught(now, detector)
                if fell(was_caught, now_caught) and not cell_fell[label]:
                    where = f"{detector}, {before[key].name}, {label} trials"
                    text = rate_text(*was_caught), rate_text(*now_caught)
                    found.append(_finding("catch rate fell", where, *text))
    return found


def uncompared_overheads(base: pd.DataFrame | None, cur: pd.DataFrame | None) -> list[str]:
    """The baseline's overhead rows the current run measured none of (another workload, dtype
    or precision, a check or interval it did not time): not compared."""
    if base is None:
        return []
    keys = [*RAN_ON, "detector", "interval"]
    timed = set() if cur is None else set(cur[keys].itertuples(index=False, name=None))
    return [
        f"{row.detector}, interval {row.interval or '-'}, "
        + ran_label(row.workload, row.dtype, row.precision)
        for row in base.itertuples(index=False)
        if tuple(getattr(row, k) for k in keys) not in timed
    ]


def uncompared_cells(base: pd.DataFrame, cur: pd.DataFrame) -> list[str]:
    """The baseline's cells the current run has none of: their catch rates were not compared
    (a scenario dropped, or a table of another shape: say so, never pass in silence)."""
    current = _cells(cur)
    return [cell.name for key, cell in _cells(base).items() if key not in current]


def new_blind_spots(base: pd.DataFrame, cur: pd.DataFrame) -> list[dict[str, str]]:
    found = []
    before = _cells(base)
    for key, cell in _cells(cur).items():
        was = before.get(key)
        # Not blind before: new, where its damaging trials were none or its rate fell (more
        # seeds alone can make a cell blind: 0/3 has an upper bound of 56%, 0/5 of 43%).
        if cell.blind and (
            was is None
            or (not was.blind and (not was.harmful[1] or fell(was.harmful, cell.harmful)))
        ):
            text = rate_text(*was.harmful) if was is not None else "not in baseline"
            where = f"{cell.name}, harmful or latent trials"
            found.append(_finding("new blind spot", where, text, rate_text(*cell.harmful)))
    return found


def false_positive_rises(base: pd.DataFrame, cur: pd.DataFrame) -> list[dict[str, str]]:
    """A detector with no alert in the baseline's clean trials that has one now, and one whose
    rate rose: the current lower bound above the baseline's upper bound."""
    before = false_positive_counts(base)
    found = []
    for detector, now in false_positive_counts(cur).items():
        was = before.get(detector)
        if now[0] > 0 and (was is None or was[0] == 0):
            text = rate_text(*was) if was is not None else "not run"
            found.append(_finding("new false positive", detector, text, rate_text(*now)))
        elif was is not None and fell(now, was):
            found.append(
                _finding("false positive rate rose", detector, rate_text(*was), rate_text(*now))
            )
    judged = {f["where"] for f in found}
    return found + [f for f in false_alert_rises(base, cur) if f["where"] not in judged]


def false_alert_rises(base: pd.DataFrame, cur: pd.DataFrame) -> list[dict[str, str]]:
    """A detector whose alerts per clean trial (docs/design.md section 5's false positive rate)
    rose, the current 95% lower bound above the baseline's upper bound: the same share of clean
    trials alerting, each many times more often. Not judged where either table was written
    before `alert_counts` and a clean trial alerted."""
    before = false_alert_counts(base)
    found = []
    for detector, now in false_alert_counts(cur).items():
        was = before.get(detector)
        if now is None or was is None or not was[1] or not now[1]:
            continue
        if poisson_interval(*now)[0] > poisson_interval(*was)[1]:
            found.append(
                _finding(
                    "false alerts per clean trial rose", detector, per_trial_text(*was),
                    per_trial_text(*now),
                )
            )  # fmt: skip
    return found


@dataclass(frozen=True)
class Growth:
    """An overhead the current run measured higher than the baseline by more than the sizes
    `overhead_growths` asks, and whether its rounds stand clear of the baseline's."""

    where: str  # the check, its interval and, among several, what it ran on
    was: float
    now: float
    clear: bool  # every current round above every baseline round, or no rounds recorded
    rounds: str  # both runs' lowest and highest rounds, where recorded


def overhead_growths(base: pd.DataFrame | None, cur: pd.DataFrame | None) -> list[Growth]:
    """Overheads more than 25% above the baseline's (relative to its size; the hook's own
    against plain DDP) and more than
    OVERHEAD_NOISE_PP percentage points above it: a small overhead measured twice on a shared
    machine differs by more than 25% of itself from noise alone. Each is clear of the noise
    when every current round is above every baseline round: for two runs of the same code,
    whose rounds are exchangeable, that happens by chance with probability 1/C(2n, n), 1/252
    for the nightly's five rounds each (1/20 for three). A table written before the rounds'
    spread was recorded, and a check measured by several runs (a sweep's jobs), are judged on
    the sizes alone."""
    if base is None or cur is None:
        return []
    joined = base.merge(cur, on=[*RAN_ON, "detector", "interval"], suffixes=("_base", "_cur"))
    # One workload's table names no workload, as before; with several, each finding names its.
    several = max(len(ran_on(base)), len(ran_on(cur))) > 1
    found = []
    for row in joined.itertuples(index=False):
        was, now = row.overhead_pct_base, row.overhead_pct_cur
        if row.detector == HOOK:  # the harness's own cost, against plain DDP
            was, now = row.overhead_vs_ddp_pct_base, row.overhead_vs_ddp_pct_cur
        if not now - was > max(OVERHEAD_GROWTH * abs(was), OVERHEAD_NOISE_PP):
            continue
        where = f"{row.detector}, interval {row.interval or '-'}"
        if several:
            where += ", " + ran_label(row.workload, row.dtype, row.precision)
        spread = (row.overhead_low_pct_base, row.overhead_high_pct_base,
                  row.overhead_low_pct_cur, row.overhead_high_pct_cur)  # fmt: skip
        if any(math.isnan(x) for x in spread):
            found.append(Growth(where, was, now, True, ""))
            continue
        base_low, base_high, cur_low, cur_high = spread
        rounds = (
            f"rounds {rounds_text(cur_low, cur_high)} against {rounds_text(base_low, base_high)}"
        )
        found.append(Growth(where, was, now, cur_low > base_high, rounds))
    return found


def overhead_growth(base: pd.DataFrame | None, cur: pd.DataFrame | None) -> list[dict[str, str]]:
    """The growths clear of the rounds' noise: regressions."""
    return [
        _finding("overhead grew", g.where, f"{g.was:.2f}%", f"{g.now:.2f}%")
        for g in overhead_growths(base, cur)
        if g.clear
    ]


def noisy_growths(base: pd.DataFrame | None, cur: pd.DataFrame | None) -> list[str]:
    """The growths within the rounds' noise: said, not judged a regression."""
    return [
        f"{g.where}: {g.was:.2f}% -> {g.now:.2f}% ({g.rounds})"
        for g in overhead_growths(base, cur)
        if not g.clear
    ]


def regressions(base: Run, cur: Run) -> list[dict[str, str]]:
    return [
        *detector_drops(base.trials, cur.trials),
        *cell_drops(base.trials, cur.trials),
        *detector_cell_drops(base.trials, cur.trials),
        *false_positive_rises(base.trials, cur.trials),
        *overhead_growth(base.overhead, cur.overhead),
        *new_blind_spots(base.trials, cur.trials),
    ]


def _code_line(base: Run, cur: Run) -> str:
    """Whether the two runs were computed by the same code: their sources' digests where both
    record them, else their commits (a tree with changes may hold any code)."""
    commits = [machine.commit_label(r.environment) for r in (base, cur)]
    if base.code is not None and cur.code is not None:
        if base.code == cur.code:
            return "same commit" if commits[0] == commits[1] else "same code"
        changed = machine.code_changes(base.code, cur.code)
        return f"{' -> '.join(commits)}, other code: {', '.join(changed)} changed"
    if commits[0] != commits[1]:
        return " -> ".join(commits)
    if commits[0].endswith("+dirty"):
        return f"commit {commits[0]} in both, each with uncommitted changes"
    return "same commit"


def environment_lines(base: Run, cur: Run) -> list[str]:
    """Whether the two runs' rows can compare bit for bit, and what compares either way."""
    before, after = base.environment, cur.environment
    differ = machine.workload_differences(base.folder, cur.folder)
    if machine.same_numbers(before, after) and differ:
        return [
            f"same environment, other workloads ({differ}): a trial id of one run is not the "
            "other's trial, and their rows do not compare trial by trial"
        ]
    if machine.same_numbers(before, after):
        shared = base.trials.merge(
            cur.trials, on=[JOB, Column.trial_id], suffixes=("_base", "_cur")
        )
        kept = (shared["effect_base"] == shared["effect_cur"]) & (
            shared["golden_final_loss_base"] == shared["golden_final_loss_cur"]
        )
        code = _code_line(base, cur)
        return [
            f"same environment ({code}): rows compare bit for bit; {int(kept.sum())}/"
            f"{len(shared)} shared trials kept their effect and golden loss"
        ]
    if before is None or after is None:
        which = " and ".join(n for n, e in (("baseline", before), ("current", after)) if e is None)
        runs = "runs" if before is None and after is None else "run"
        lines = [f"environment unknown for the {which} {runs} (none recorded, or mixed in a sweep)"]
    else:
        changed = machine.differences(before, after)
        lines = ["environments differ: " + "; ".join(
            f"{f} {before.get(f, '?')} -> {after.get(f, '?')}" for f in changed
        )]  # fmt: skip
    return [
        *lines,
        "statistical comparisons only: catch rates, false positives, blind spots and overhead "
        "compare; golden losses, bit-identity (golden_match) and masked counts do not (a "
        "masked trial may turn benign from rounding alone), and are not judged",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="sdc-regress", description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", type=Path, help="the baseline run folder (results/baseline)")
    parser.add_argument("current", type=Path, help="the run to judge against it")
    try:
        args = parser.parse_args(argv)
        base, cur = load(args.baseline), load(args.current)
    except ReportError as exc:
        print(f"sdc-regress: {exc}", file=sys.stderr)
        sys.exit(2)
    for which, run in (("baseline", base), ("current", cur)):
        stopped = unfinished(run.trials)
        if stopped:
            # Its cells' rates, and the share of clean trials, are of a part of the campaign:
            # a nightly stopped early passed as "no regression".
            print(f"sdc-regress: the {which} run is incomplete ({'; '.join(stopped)}): finish "
                  "it (rerun its command with the same out) before comparing",
                  file=sys.stderr)  # fmt: skip
            sys.exit(2)
    base, cur, blanked = aligned(base, cur)
    missing = uncompared_cells(base.trials, cur.trials)
    if missing and len(missing) == len(cell_stats(base.trials)):
        print(
            f"sdc-regress: {args.current} shares no scenario cell with {args.baseline}: nothing "
            "to compare (another campaign, or a baseline written before a column the cells "
            "hold: regenerate it)",
            file=sys.stderr,
        )
        sys.exit(2)
    for line in environment_lines(base, cur):
        print(f"sdc-regress: {line}")
    if blanked:
        print(
            f"sdc-regress: a table was written before the columns {', '.join(blanked)}: both "
            "runs' cells compare without them (the scenarios they tell apart merge, as that "
            "table merged them)"
        )
    if missing:
        print(
            f"sdc-regress: {len(missing)} baseline scenario cells have none in the current run "
            f"and were not compared: {'; '.join(missing)}"
        )
    untimed = uncompared_overheads(base.overhead, cur.overhead)
    if untimed:
        print(
            f"sdc-regress: {len(untimed)} baseline overheads have none in the current run and "
            f"were not compared: {'; '.join(untimed)}"
        )
    noisy = noisy_growths(base.overhead, cur.overhead)
    if noisy:
        print(
            f"sdc-regress: {len(noisy)} overheads grew past the thresholds within the noise of "
            f"their rounds (some current round at or below some baseline round), not judged a "
            f"regression: {'; '.join(noisy)}"
        )
    found = regressions(base, cur)
    sizes = f"{len(base.trials)} baseline trials, {len(cur.trials)} current trials"
    if not found:
        print(f"sdc-regress: no regression ({sizes})")
        return
    print(markdown_table(found), end="")
    print(f"sdc-regress: {len(found)} regressions ({sizes})", file=sys.stderr)
    sys.exit(1)
