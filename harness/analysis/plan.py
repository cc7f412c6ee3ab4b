"""`sdc-plan RUN_DIR [RUN_DIR ...]`: which checks to turn on, and how often to audit, for a job.

The run measured what the decision needs (overhead.csv: each check's overhead at each interval;
trials.csv: which faults each check caught, how fast, and which faults did damage). This turns it
into expected GPU-hours lost per day of the job, for each set of checks and interval:

    loss = overhead x 24 h x G
         + events x P(caught) x G x (steps trained again x step time + restart)
         + events x P(damaged and not caught) x G x escape cost

with G GPUs, events = rate x G x 24 h SDC events a day, steps trained again = from the
checkpoint recovery restores to the alarm (harness/analysis/rollbacks.py: the newest before the
steps the alarming checks put in doubt and before the fault, a checkpoint interval of the job
away on average or more; for a check that vouches for no earlier step, the start: half the
job), escape cost = the hours a damaging fault that no check caught costs the job before other
means find it. A fired trial of the run stands for one event; under a weighed fault mix
(harness/analysis/mix.py), for its class's weight spread over the class's fired trials. A
`crash` fault (a process taken down, not a silent corruption) is no SDC event: its trials are
left out. Damaged:
its effect is harmful or latent (docs/design.md, section 5), or its replicas no longer agree at
the end (a fault the loss does not show yet). The range (low, high) puts each probability at its
95% Wilson bounds, the steps trained again at the least and most of any caught fault, and each
check's overhead (and the hook's) at its lowest and highest timed round where overhead.csv holds
one run's rounds, each term at its own extreme: the loss at any mix of those bounds lies inside
it.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from harness.analysis.estimates import FORMULAS, JobShape
from harness.analysis.intervals import pairs
from harness.analysis.mix import conflicts, covered, kish, trial_weights, weighed
from harness.analysis.overheads import (
    ROUNDS,
    load_overhead,
    ran_label,
    ran_on,
    without_pooled_rounds,
)
from harness.analysis.rollbacks import Bound, bound, steps_lost
from harness.analysis.tables import (
    CRASH,
    PUBLISHED,
    Counts,
    ReportError,
    damaged,
    detector_names,
    load_trials,
    silent_fired,
    wilson,
)
from harness.results.costs import JobCosts
from harness.results.folder import RunFolder
from harness.results.schema import HOOK
from harness.results.trial_row import Column

PLAN_FILE = "plan.md"
FIGURE_FILE = "plan.png"
LLAMA3_GPUS = 16384
# 6 of the 419 unexpected interruptions in a 54-day snapshot of Llama 3 405B pre-training on
# 16,384 H100s were attributed to silent data corruption. Those are the SDC events that were
# noticed: the true rate is at least this.
LLAMA3_RATE = 6 / (54 * 24 * LLAMA3_GPUS)
LLAMA3_SOURCE = (
    "Llama 3 405B pre-training: 6 of 419 unexpected interruptions in 54 days on 16,384 H100s "
    "attributed to silent data corruption (Llama Team, The Llama 3 Herd of Models, 2024, "
    "section 3.3.4, table 5)"
)
# The check that also looks before every checkpoint (detectors/weight_consensus.py).
CONSENSUS = "weight_consensus"
# Sets drawn against the interval (every single check is drawn too).
NAMED_SETS = {
    frozenset(s)
    for s in (("replay", "weight_consensus"), PUBLISHED, (*PUBLISHED, "allreduce_sketch"))
}
# Columns that name a fault and its seed: the same fault run at several intervals of a check
# that is not in a set counts once for that set.
FAULT_COLUMNS = [
    Column.workload, Column.dtype, Column.nodes, Column.ranks_per_node, Column.site,
    Column.model, Column.bit, Column.factor, Column.value, Column.scope, Column.persistence,
    Column.fault_ranks, Column.fault_steps, Column.seed, Column.inject_step,
]  # fmt: skip


class PlanError(ValueError):
    """Bad input: one line, exit 2."""


@dataclass(frozen=True)
class Job:
    """The job the plan is for. Defaults: the Llama 3 405B run where the report gives a figure."""

    gpus: int = LLAMA3_GPUS
    # About one Llama 3 405B step: 6 x 405e9 parameters x 16M tokens / (16,384 x 400 TFLOP/s).
    step_seconds: float = 6.0
    checkpoint_every: int = 500  # steps (50 minutes at 6 s)
    restart_minutes: float = 30.0
    sdc_rate: float = LLAMA3_RATE  # events per GPU-hour
    escape_hours: float = 24.0  # a day of the whole job: a loss spike or a bad eval, then back
    job_days: float = 54.0  # a rollback to the start loses the job's age: half of this

    def __post_init__(self) -> None:
        for flag, value, least in (
            ("--gpus", self.gpus, 1),
            ("--step-seconds", self.step_seconds, 0),
            ("--checkpoint-every", self.checkpoint_every, 1),
            ("--restart-minutes", self.restart_minutes, 0),
            ("--sdc-rate", self.sdc_rate, 0),
            ("--escape-hours", self.escape_hours, 0),
            ("--job-days", self.job_days, 0),
        ):
            if not math.isfinite(value) or value < least:
                raise PlanError(f"{flag}: must be a number >= {least}, got {value}")
        for flag, value in (("--step-seconds", self.step_seconds), ("--job-days", self.job_days)):
            if value == 0:
                raise PlanError(f"{flag}: must be > 0, got 0")

    @property
    def events_per_day(self) -> float:
        return self.sdc_rate * self.gpus * 24

    @property
    def steps(self) -> float:
        return self.job_days * 24 * 3600 / self.step_seconds

    def detected_hours(self, lost_steps: float) -> float:
        """Wall hours one detected event costs the job: the steps trained again from the
        checkpoint restored (rollbacks.steps_lost), then a restart."""
        return lost_steps * self.step_seconds / 3600 + self.restart_minutes / 60


@dataclass(frozen=True)
class Catch:
    """A caught fault as its rollback is priced: its weight, the bounds of the checks that
    alarmed first (together), the step they alarmed at and the steps since the fault."""

    weight: float
    bounds: tuple[Bound, ...]
    alarm: int
    ttd: int

    def lost(self, job: Job) -> float:
        return steps_lost(self.bounds, self.alarm, self.ttd, job.checkpoint_every, job.steps)


@dataclass(frozen=True)
class Option:
    """One set of checks at its intervals, with what the run measured for it."""

    checks: tuple[str, ...]  # sorted; () is no checks at all
    intervals: tuple[tuple[str, int], ...]  # the periodic members' intervals
    # Against plain DDP, as the job pays it: the harness's hook once (riders, fixed layout),
    # plus the members' overheads (`overheads`: against plain DDP); 0 for no checks at all.
    overhead_pct: float
    overhead_range: tuple[float, float]  # the same at its members' lowest and highest rounds
    caught: Counts  # fired faults that any member caught
    escaped: Counts  # fired faults that did damage and that no member caught
    ttd: tuple[float, float, float]  # steps to detection: mean, least, most (NaN: none caught)
    catches: tuple[Catch, ...] = ()  # the caught faults' rollbacks
    # What a catch would roll back where none was made (the range's high end): every member
    # alarming at its longest interval's distance from the fault.
    unseen: Catch | None = None

    @property
    def name(self) -> str:
        return " + ".join(self.checks) or "no checks"

    @property
    def interval(self) -> str:
        """The audit interval in steps ("-": every step); a mix names each check's."""
        ks = {k for _, k in self.intervals}
        if not ks:
            return "-"
        if len(ks) == 1:
            return str(ks.pop())
        return ", ".join(f"{c}={k}" for c, k in self.intervals)

    def checkpoint_every(self, job_every: int) -> int:
        """How often a job that checkpoints every `job_every` steps checkpoints with this option.
        Consensus also looks before every checkpoint: checkpoints at a multiple of its interval
        keep its looks its own (sdc-bench refuses checkpoints that would make it look more
        often), the least at or above the job's, which is the job's own where its interval
        divides it."""
        k = dict(self.intervals).get(CONSENSUS)
        return job_every if k is None else -(-job_every // k) * k

    def guard_detectors(self) -> str:
        """The guard's `detectors` for this option (Guard, the Lightning and Trainer
        callbacks, the examples' --detectors), as JSON; "" for no checks, which is no guard."""
        if not self.checks:
            return ""
        every = dict(self.intervals)
        return json.dumps({c: {"interval": every[c]} if c in every else {} for c in self.checks})

    def overrides(self, job_every: int = 1) -> str:
        """The Hydra overrides (sdc-bench, or your training config) that set this option for a
        job checkpointing every `job_every` steps."""
        parts = [f"detectors=[{','.join(self.checks)}]"]
        parts += [f"detectors.{c}.interval={k}" for c, k in self.intervals]
        if CONSENSUS in dict(self.intervals):
            parts.append(f"checkpoint.interval={self.checkpoint_every(job_every)}")
        return " ".join(parts)


@dataclass(frozen=True)
class Loss:
    """Expected GPU-hours lost per day, and its range."""

    expected: float
    low: float
    high: float


def loss(option: Option, job: Job) -> Loss:
    """The model of the module docstring, at the point estimates and at either extreme; a
    rollback at the checkpoints the option sets (Option.checkpoint_every)."""
    job = replace(job, checkpoint_every=option.checkpoint_every(job.checkpoint_every))
    per_event = job.events_per_day * job.gpus  # GPU-hours per wall hour lost, per day
    (kc, nc), (ke, ne) = option.caught, option.escaped
    # No checks catch nothing: 0 at either extreme, not the interval 0 of n leaves open.
    caught_lo, caught_hi = wilson(kc, nc) if option.checks else (0.0, 0.0)
    escaped_lo, escaped_hi = wilson(ke, ne)
    lost = [c.lost(job) for c in option.catches]
    if lost:
        weights = [c.weight for c in option.catches]
        mean = sum(w * x for w, x in zip(weights, lost, strict=True)) / sum(weights)
        least, most = min(lost), max(lost)
    else:  # nothing caught: a catch the bounds allow comes at the longest interval
        mean = least = 0.0
        most = option.unseen.lost(job) if option.unseen is not None else 0.0

    def total(overhead_pct: float, caught: float, lost: float, escaped: float) -> float:
        hours = caught * job.detected_hours(lost) + escaped * job.escape_hours
        return overhead_pct / 100 * 24 * job.gpus + per_event * hours

    cheapest, dearest = option.overhead_range
    return Loss(
        expected=total(option.overhead_pct, kc / nc, mean, ke / ne),
        low=total(cheapest, caught_lo, least, escaped_lo),
        high=total(dearest, caught_hi, most, escaped_hi),
    )


def fired_faults(trials: pd.DataFrame) -> pd.DataFrame:
    """The fired trials but crashes (no SDC), with the columns `measured` reads as sets and
    mappings, and each check's settings (`settings`) and rollback bound (`bounds`)."""
    fired = silent_fired(trials).copy()
    fired["on"] = fired[Column.detectors].map(lambda s: frozenset(d for d in s.split(";") if d))
    fired["every"] = fired[Column.check_intervals].map(pairs)
    fired["found"] = fired[Column.detect_steps].map(pairs)
    fired["settings"] = check_settings(fired)
    fired["bounds"] = fired["settings"].map(lambda on: {n: bound(n, p) for n, p in on.items()})
    fired["damaged"] = damaged(fired)
    # The fault's label (the trial id without its scenario's place, harness/config/load.py):
    # it holds what the columns do not, such as a fault model's own settings.
    label = fired[Column.trial_id].map(lambda t: t.split("-", 1)[-1])
    # Neither holds every fault field (the tensor, the probability): two scenarios alike in both
    # and run with the same checks at the same intervals are two faults. The i-th of them is the
    # same fault as the i-th alike at other intervals, which a grid runs in the same order.
    alike = [*FAULT_COLUMNS, label, Column.detectors, Column.check_intervals]
    place = fired.groupby(alike, dropna=False, sort=False).cumcount()
    fired["fault"] = label + "#" + place.astype(str)
    return fired


def measured(fired: pd.DataFrame, checks: tuple[str, ...], cost: Overheads) -> list[Option]:
    """One Option per interval (or mix of intervals) at which every member of `checks` ran in
    fired trials (`fired_faults`) and had its overhead measured; none for a set not run
    together. A fault is caught when any member caught it, at the first member's alert."""
    fired = fired[fired["on"].map(lambda on: on.issuperset(checks))]
    fired["key"] = fired["every"].map(lambda e: tuple((c, e[c]) for c in checks if c in e))
    options = []
    for key, group in fired.groupby("key", sort=True):
        at = [(c, str(dict(key).get(c, ""))) for c in checks]
        costs = [cost.price(a) for a in at]
        if any(c is None for c in costs):
            continue
        hook = (cost.hook or 0.0) if checks else 0.0
        hook_range = (cost.hook_rounds or (hook, hook)) if checks else (0.0, 0.0)
        spreads = [cost.rounds.get(a, (c, c)) for a, c in zip(at, costs, strict=True)]
        # The same fault at intervals of checks outside the set is one trial for this set.
        group = group.drop_duplicates(subset=[*FAULT_COLUMNS, "fault"])
        first = group["found"].map(lambda f: min((f[c] for c in checks if c in f), default=None))
        hit = first.notna()
        ttd = first[hit].astype(float) - group.loc[hit, Column.inject_step].astype(float)
        # Under a weighed mix each fault stands for its class's share (harness/analysis/mix.py).
        w = trial_weights(group) if weighed(group) else pd.Series(1.0, index=group.index)
        catches = tuple(
            Catch(float(w[i]), tuple(bounds[c] for c in checks if found.get(c) == first[i]),
                  int(first[i]), int(ttd[i]))
            for i, found, bounds in zip(group.index[hit], group.loc[hit, "found"],
                                        group.loc[hit, "bounds"], strict=True)
        )  # fmt: skip
        longest = max((k for _, k in key), default=1)
        unseen = _unseen(group["bounds"].iloc[0], checks, longest) if checks else None
        options.append(
            Option(
                checks=checks,
                intervals=key,
                overhead_pct=sum(costs) + hook,
                overhead_range=(
                    sum(low for low, _ in spreads) + hook_range[0],
                    sum(high for _, high in spreads) + hook_range[1],
                ),
                caught=_counts(w, hit),
                escaped=_counts(w, group["damaged"] & ~hit),
                ttd=(float((w[hit] * ttd).sum() / w[hit].sum()), ttd.min(), ttd.max())
                if len(ttd)
                else (math.nan,) * 3,
                catches=catches,
                unseen=unseen,
            )
        )
    return options


def _unseen(bounds: dict[str, Bound], checks: tuple[str, ...], longest: int) -> Catch:
    """A catch by every member at once, `longest` steps after the fault."""
    return Catch(1.0, tuple(bounds[c] for c in checks), longest, longest)


def check_settings(trials: pd.DataFrame) -> list[dict[str, dict[str, Any]]]:
    """Each trial's checks' settings, as its run's campaign.json records them for it; where the
    folder has none (a table made by hand), the trial's intervals and the checks' defaults."""
    runs = trials["run"].unique() if "run" in trials else ()
    settings = {run: RunFolder(Path(run)).trial_checks() for run in runs}
    found = []
    for row in trials.itertuples(index=False):
        run = getattr(row, "run", None)
        recorded = settings.get(run, {}).get(getattr(row, Column.trial_id)) or {}
        every = pairs(getattr(row, Column.check_intervals))
        on = [d for d in getattr(row, Column.detectors).split(";") if d]
        found.append(
            {name: recorded.get(name) or ({"interval": every[name]} if name in every else {})
             for name in on}
        )  # fmt: skip
    return found


def _counts(w: pd.Series, yes: pd.Series) -> Counts:
    """(k, n) of the faults `yes` holds: whole counts unweighed; under weights the weighed share
    at the Kish effective number of faults, n = (sum w)^2 / sum(w^2)."""
    if (w == 1.0).all():
        return (int(yes.sum()), len(w))
    n = kish(w)
    return (float((w * yes).sum() / w.sum()) * n, n)


@dataclass(frozen=True)
class Overheads:
    """What a check costs in percent of a step, as the plan uses it."""

    at: dict[tuple[str, str], float]  # (detector, interval as in overhead.csv) -> percent
    per_run: dict[str, float]  # a periodic check's fitted cost of one run (percent of a step)
    noise: list[str]  # measurements below zero or below the check's floor
    # The harness's hook against plain DDP, percent of a step (overhead.csv's `hook` row); None
    # in a table measured before plain DDP was, whose costs are then against the hook alone.
    hook: float | None = None
    # Where the figures come from when not the run's overhead.csv: the job's costs file, or the
    # job's shape they were estimated for.
    job: JobCosts | None = None
    source: str = ""
    estimate: JobShape | None = None
    # (lowest, highest) round of `at`'s figures and of the hook's, where overhead.csv holds one
    # run's rounds (none for a table written before them, a pool of runs, or the job's figures).
    rounds: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    hook_rounds: tuple[float, float] | None = None

    def price(self, at: tuple[str, str]) -> float | None:
        """A (check, interval)'s figure; one not timed at that interval, its fitted run over
        the interval where it has a fit (a merged run's grid that left one out); else None."""
        found = self.at.get(at)
        check, k = at
        if found is None and check in self.per_run and k.isdigit():
            found = self.per_run[check] / int(k)
        return found


def amortized(intervals: list[int], measured: list[float]) -> float:
    """c >= 0 of the least-squares fit overhead(k) = c / k: a check that runs every k steps
    costs one run's cost over k, and nothing between its runs. The timing noise of a loaded
    machine is the same size at every interval (points of a step, not a share of the cost), so
    the fit leans on the short intervals, where the cost stands out of it."""
    x = [1 / k for k in intervals]
    fit = sum(xi * y for xi, y in zip(x, measured, strict=True)) / sum(xi * xi for xi in x)
    return max(0.0, fit)


def overheads(table: pd.DataFrame) -> Overheads:
    """Each (check, interval)'s overhead: for a check timed at several intervals, its amortized
    fit over all of them; otherwise its measurement. Never below zero or the check's floor (the
    least it can cost): one timing on a loaded machine can be off by ten points either way. The
    same of its lowest and of its highest rounds, where every row of the check holds them."""
    at, per_run, noise, hook = {}, {}, [], None
    rounds: dict[tuple[str, str], tuple[float, float]] = {}
    hook_rounds = None
    for detector, rows in table.groupby("detector"):
        timed_rounds = bool(rows[ROUNDS].notna().all(axis=None))
        if detector == HOOK:
            measured = rows["overhead_vs_ddp_pct"].dropna()
            if len(measured):
                hook = max(0.0, float(measured.median()))
                if measured.median() < 0:
                    noise.append(f"hook vs plain DDP {measured.median():.2f}%")
                if timed_rounds and len(rows) == 1:
                    low, high = rows[ROUNDS].iloc[0]
                    hook_rounds = (max(0.0, low), max(0.0, high))
            continue
        timed = rows[rows["steps"].notna()]
        fits = {}
        if timed["steps"].nunique() > 1:
            ks = timed["steps"].astype(int).tolist()
            fits = {c: amortized(ks, timed[c].tolist()) for c in ("overhead_pct", *ROUNDS)}
            # One run's floor: an interval priced by the fit alone (Overheads.price) is never
            # below the floor its own row would have had.
            floors = (timed["floor_pct"] * timed["steps"]).dropna()
            per_run[detector] = max(
                fits["overhead_pct"], float(floors.max()) if len(floors) else 0.0
            )
        for r in rows.itertuples(index=False):
            least = 0.0 if math.isnan(r.floor_pct) else max(0.0, r.floor_pct)
            share = {
                c: max(least, fits[c] / r.steps if fits else getattr(r, c))
                for c in ("overhead_pct", *ROUNDS)
            }
            at[(detector, r.interval)] = share["overhead_pct"]
            if timed_rounds:
                rounds[(detector, r.interval)] = (share[ROUNDS[0]], share[ROUNDS[1]])
            if r.overhead_pct < least:
                noise.append(f"{r.detector}@{r.interval or '-'} {r.overhead_pct:.2f}%")
    # A check's share is of the step with the hook, the hook's of plain DDP's: against plain
    # DDP a check costs its share times (1 + hook), so that a set's checks and the hook add up
    # to (1 + hook)(1 + their shares) - 1, as overhead.csv's overhead_vs_ddp_pct multiplies.
    scale = 1 + (hook or 0.0) / 100
    at = {a: c * scale for a, c in at.items()}
    per_run = {d: c * scale for d, c in per_run.items()}
    # The range's ends are the hook's and the checks' lowest rounds together, and their
    # highest: a check's highest share times the hook's median understated the high end.
    low_scale, high_scale = (
        (scale, scale) if hook_rounds is None else tuple(1 + h / 100 for h in hook_rounds)
    )
    rounds = {a: (low * low_scale, high * high_scale) for a, (low, high) in rounds.items()}
    return Overheads(at, per_run, noise, hook, rounds=rounds, hook_rounds=hook_rounds)


def job_overheads(costs: JobCosts, source: str, trials: pd.DataFrame) -> Overheads:
    """The overheads the guard measured in the job itself (`guard.write_costs`), at each interval
    the run's trials ran a check at: a check measured running every k_f steps at f percent of
    the job's step costs f k_f / k at interval k (one run's cost, over k), f itself at k_f; one
    whose looks were irregular (listed steps, extra looks before checkpoints), measured over n
    steps holding l of them, costs f n / l per look, over k. The hook its own entry, once for any
    set. A check the run's trials ran and the file lacks, or measured over fewer steps than its
    interval or over none of its looks, is a PlanError naming it."""
    ran = detector_names(trials)
    missing = [name for name in ran if name not in costs.checks]
    if missing:
        raise PlanError(
            f"--costs {source}: no figure for '{missing[0]}', which the run's trials ran; "
            f"the file has {', '.join(sorted(costs.checks)) or 'none'} (run the guard in the job "
            f"with '{missing[0]}' among its detectors)"
        )
    short = [name for name in ran if (costs.checks[name].interval or 1) > costs.steps]
    if short:
        k = costs.checks[short[0]].interval
        raise PlanError(
            f"--costs {source}: '{short[0]}' looks every {k} steps and the guard measured "
            f"{costs.steps}, which may hold none of its looks; measure at least {k} steps after "
            "the guard's warm-up (several of its intervals for a steady figure)"
        )
    unseen = [name for name in ran if costs.checks[name].looks == 0]
    if unseen:
        raise PlanError(
            f"--costs {source}: '{unseen[0]}' looked at none of the {costs.steps} steps the guard "
            "measured, so its figure holds no look's cost; measure over steps where it looks"
        )
    every = fired_faults(trials)["every"]
    at, per_run = {}, {}
    for name in ran:
        measured = costs.checks[name]
        if measured.looks is None:
            per_run[name] = measured.overhead_pct * (measured.interval or 1)
        else:
            per_run[name] = measured.overhead_pct * costs.steps / measured.looks
        for k in {""} | {str(e[name]) for e in every if name in e}:
            at[(name, k)] = per_run[name] / (int(k) if k else 1)
    return Overheads(at, per_run, [], costs.hook.overhead_pct, costs, source)


def estimated_overheads(shape: JobShape, trials: pd.DataFrame) -> Overheads:
    """Each check's cost in the job `shape` describes, from its docstring's formula
    (harness/analysis/estimates.py), at each interval the run's trials ran it at; the hook's
    own work (a few numbers riding on each reduction) as nothing. A check without a formula (an
    installed one) is a PlanError naming it."""
    ran = detector_names(trials)
    missing = [name for name in ran if name not in FORMULAS]
    if missing:
        raise PlanError(
            f"--gpu: no cost formula for '{missing[0]}', which the run's trials ran; formulas "
            f"exist for {', '.join(sorted(FORMULAS))} (measure it in the job: --costs FILE)"
        )
    fired = fired_faults(trials)
    at, per_run = {}, {}
    for name in ran:
        # At the dearest of the settings the run's trials gave it (the moments fingerprinted
        # too, several replays), which an option of its interval alone cannot tell apart.
        ran_with = [on[name] for on in fired["settings"] if name in on] or [{}]
        dearest = max(ran_with, key=lambda p: shape.overhead_pct(name, settings=p))
        per_run[name] = shape.overhead_pct(name, settings=dearest)
        for k in {""} | {str(e[name]) for e in fired["every"] if name in e}:
            at[(name, k)] = shape.overhead_pct(name, int(k) if k else 1, dearest)
    return Overheads(at, per_run, [], 0.0, estimate=shape)


def options(fired: pd.DataFrame, names: list[str], cost: Overheads) -> list[Option]:
    """Every set of the checks `names` the run ran (each at each interval it ran at in `fired`,
    `fired_faults`), and no checks."""
    found = measured(fired, (), cost)  # no checks: every fired fault, each once
    for size in range(1, len(names) + 1):
        for checks in itertools.combinations(names, size):
            found += measured(fired, checks, cost)
    return found


@dataclass(frozen=True)
class Plan:
    job: Job
    ranked: list[tuple[Option, Loss]]  # best first
    overheads: Overheads
    weighed: bool = False  # the faults weighed by the campaign's fault mix
    # Under a mix: the share of its weight whose classes have no fired trial (count for nothing).
    uncovered: float = 0.0
    # Each check (at an interval, "name every k") the fired trials ran with no figure for its
    # cost: in no option, so the plan says so rather than leave it out unsaid.
    untimed: tuple[str, ...] = ()

    @property
    def best(self) -> tuple[Option, Loss]:
        return self.ranked[0]


def plan(
    trials: pd.DataFrame, table: pd.DataFrame | None, job: Job, costs: Overheads | None = None
) -> Plan:
    """`costs` (job_overheads) in place of `table`'s (overhead.csv), when given."""
    if costs is None:
        if table[Column.workload].nunique() > 1:
            raise PlanError(several_workloads(ran_on(table)))
        table = over_dtypes(table)
        ran = trials[[Column.workload, Column.dtype, Column.precision]].itertuples(index=False)
        trials_on = ", ".join(sorted({ran_label(*r) for r in ran}))
        costs = replace(overheads(table), source=f"{trials_on}, on the campaign's machine")
    fired = trials[trials[Column.fired] == True]  # noqa: E712 (a column of booleans)
    if not (fired[Column.model] != CRASH).any():
        runs = ", ".join(sorted(trials["run"].unique()))
        # A crash is no silent corruption: no check's catch or miss of it is weighed.
        but = " but crashes" if len(fired) else ""
        raise PlanError(
            f"no fault{but} struck in {runs}: a plan weighs the silent faults a campaign fired "
            "(run one with fault scenarios that corrupt values)"
        )
    mixed = weighed(trials)
    if mixed and fired[Column.weight].isna().any():
        raise PlanError(
            "some runs weigh their faults by a mix and some do not: plan from the weighed runs "
            "alone, or from the unweighed ones"
        )
    clash = conflicts(trials) if mixed else []
    if clash:
        raise PlanError(f"the runs give a fault class more than one weight: {'; '.join(clash)}; "
                        "plan from one mix's runs")  # fmt: skip
    faults = fired_faults(trials)
    found = options(faults, detector_names(trials), costs)
    if not found:
        raise PlanError("no fired trials with measured overheads: nothing to plan from")
    ranked = sorted(
        ((o, loss(o, job)) for o in found),
        key=lambda ol: (ol[1].expected, ol[0].overhead_pct, len(ol[0].checks), ol[0].name),
    )
    uncovered = 1 - covered(trials, fired) if mixed else 0.0
    return Plan(job, ranked, costs, mixed, uncovered, untimed(faults, costs))


def untimed(fired: pd.DataFrame, cost: Overheads) -> tuple[str, ...]:
    """The checks `fired` (`fired_faults`) ran at an interval `cost` has no figure for."""
    ran = {(c, str(every.get(c, ""))) for on, every in zip(fired["on"], fired["every"],
                                                           strict=True) for c in on}  # fmt: skip
    missing = sorted(at for at in ran if cost.price(at) is None)
    return tuple(f"{c} every {k}" if k else c for c, k in missing)


def over_dtypes(table: pd.DataFrame) -> pd.DataFrame:
    """One workload's overheads in several dtypes or precisions as one row per (check,
    interval), the median over them: the plan pools their trials too, and its source names
    them. Rounds only where one row stands alone: one run's noise spans no other's median."""
    pooled = table.groupby(["detector", "interval"], as_index=False).agg(
        overhead_pct=("overhead_pct", "median"),
        floor_pct=("floor_pct", "median"),
        overhead_vs_ddp_pct=("overhead_vs_ddp_pct", "median"),
        overhead_low_pct=("overhead_low_pct", "first"),
        overhead_high_pct=("overhead_high_pct", "first"),
        rows=("detector", "size"),
        steps=("steps", "first"),
    )
    without_pooled_rounds(pooled, pooled["rows"])
    return pooled.drop(columns="rows").sort_values(["detector", "steps"], ignore_index=True)


def several_workloads(measured_on: list[str]) -> str:
    """Why overheads of several workloads price no plan: a job runs one, and each check costs
    another share of another workload's step."""
    return (
        f"overhead.csv measured on several workloads ({', '.join(measured_on)}): plan from one "
        "workload's runs, or price the checks for your job with --costs FILE, or --gpu --params "
        "--tokens-per-step"
    )


def load(dirs: list[Path], need_overhead: bool = True) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """The trials and overhead tables of the given run or sweep folders (overhead.csv optional
    without `need_overhead`: the job's costs price the checks)."""
    for d in dirs:
        if not d.is_dir():
            raise PlanError(f"{d}: not a folder")
    try:
        trials = load_trials(dirs)
        table = load_overhead(dirs)
    except ReportError as exc:
        raise PlanError(str(exc)) from None
    except (ValueError, OSError) as exc:  # pandas: an empty or malformed trials.csv
        raise PlanError(f"unreadable trials.csv: {exc}") from None
    if table is None and need_overhead:
        raise PlanError(
            f"{', '.join(map(str, dirs))}: no overhead.csv in it or below it (run a campaign "
            "that measures overhead, such as campaign=audit_frequency; or price the checks for "
            "your job with --costs FILE, or --gpu --params --tokens-per-step)"
        )
    return trials, table
