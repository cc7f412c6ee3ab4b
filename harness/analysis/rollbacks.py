"""How far back a job goes after an alarm, as sdc-plan prices it.

Recovery and the guard restore the newest checkpoint saved before the earliest step an alarm puts
in doubt (each check's `Detector.first_suspect_step`; harness/campaign/recovery.py): a check of
each step's values suspects from two steps before its alarm, one that looks every k steps from
its last look, and a product check that checks a share of the steps or products every step since
the start. `bound` holds each built-in check's rule as
data the planner reads without torch (tests/unit/test_rollbacks.py holds it to each detector's
own method at every setting, alarm step and checkpoint interval it tries); a check installed
from elsewhere is priced as the default, a check of its step's values.

`steps_lost`: the steps a job checkpointing every C steps trains again after an alarm at step t,
t - restore, where restore is the newest checkpoint before both the checks' first suspect step
and the fault's own step (a check that alarms on a threshold may see a slow corruption after
its bound; the job must still go back before it). Averaged over where t falls between the job's
checkpoints, its place among the checks' looks kept as in the trial; a rollback to the start
costs the job its age, half its length on average.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True)
class Bound:
    """A check's first suspect step for an alarm at step t. Without looks (`every` and `steps`
    None): t - `back`. With them: its last look before t (after each step s with (s + `shift`)
    % `every` == 0, or after each of `steps` in its place, and with `at_checkpoints` after each
    step a checkpoint follows) moved by `offset`; the start where it never looked. `start`:
    the start whatever the alarm (it vouches for no earlier step)."""

    back: int = 2
    every: int | None = None
    shift: int = 0
    offset: int = 0
    at_checkpoints: bool = False
    steps: tuple[int, ...] | None = None
    start: bool = False

    def first_suspect(self, t: int, checkpoint_every: int) -> int | None:
        """The step, never below 0, for a job that checkpoints after each step s with (s + 1)
        % `checkpoint_every` == 0; None for the start."""
        if self.start:
            return None
        if self.every is None and self.steps is None:
            return max(t - self.back, 0)
        if self.steps is not None:
            looks = [s for s in self.steps if s < t]
        else:
            looks = [t - 1 - (t - 1 + self.shift) % self.every]
        if self.at_checkpoints:
            looks.append(checkpoint_every * (t // checkpoint_every) - 1)
        last = max((s for s in looks if s >= 0), default=None)
        return None if last is None else max(last + self.offset, 0)


VALUES = Bound()  # a check of each step's values: Detector.first_suspect_step's default


def _replay(p: Mapping[str, Any]) -> Bound:
    steps = p.get("steps")
    every = None if steps else p.get("interval") or 5  # replay.DEFAULT_INTERVAL
    return Bound(every=every, offset=-1, steps=tuple(steps) if steps else None)


def _weight_consensus(p: Mapping[str, Any]) -> Bound:
    offset = 1 if p.get("optimizer_state") else 0
    return Bound(every=p.get("interval", 10), shift=1, offset=offset, at_checkpoints=True)


def _megatron_hash(p: Mapping[str, Any]) -> Bound:
    return Bound(every=p.get("interval", 10), shift=1)


def _gather_consensus(p: Mapping[str, Any]) -> Bound:
    return Bound(every=p.get("interval", 1), offset=-1)


def _matmul_checksum(p: Mapping[str, Any]) -> Bound:
    every_product = p.get("interval", 1) == 1 and p.get("fraction", 1.0) == 1
    return VALUES if every_product else Bound(start=True)


RULES: dict[str, Callable[[Mapping[str, Any]], Bound]] = {
    "replay": _replay,
    "weight_consensus": _weight_consensus,
    "megatron_hash": _megatron_hash,
    "gather_consensus": _gather_consensus,
    "matmul_checksum": _matmul_checksum,
}


def bound(name: str, params: Mapping[str, Any]) -> Bound:
    """Check `name`'s bound at its settings `params` (campaign.json's, or just its interval)."""
    rule = RULES.get(name)
    return VALUES if rule is None else rule(params)


def steps_lost(
    bounds: tuple[Bound, ...], alarm: int, ttd: int, checkpoint_every: int, job_steps: float
) -> float:
    """The steps trained again after `bounds`' checks alarm together at step `alarm` of a trial,
    `ttd` steps after the fault (module docstring), in a job of `job_steps` steps. A check at
    listed steps keeps its distance back from the trial's alarm (a job has no such steps)."""
    bounds = tuple(_distance(b, alarm, checkpoint_every) if b.steps else b for b in bounds)
    looks = math.lcm(1, *(b.every for b in bounds if b.every is not None))
    # Only the alarm's place among the periodic looks matters.
    return _lost(bounds, alarm % looks, looks, ttd, checkpoint_every, job_steps)


def _distance(b: Bound, alarm: int, checkpoint_every: int) -> Bound:
    first = b.first_suspect(alarm, checkpoint_every)
    return Bound(start=True) if first is None else Bound(back=alarm - first)


@cache
def _lost(
    bounds: tuple[Bound, ...], alarm: int, looks: int, ttd: int, every: int, job_steps: float
) -> float:
    period = math.lcm(every, looks)
    # Far from the start, so that no bound is cut at step 0, and in the same place among the
    # periodic looks.
    margin = 2 * (every + looks + ttd) + max(b.back for b in bounds)
    far = alarm + period * (margin // period + 1)
    lost = []
    for j in range(period // looks):
        t = far + j * looks
        firsts = [b.first_suspect(t, every) for b in bounds]
        if any(s is None for s in firsts):
            return job_steps / 2
        first = min(*firsts, t - ttd)
        restore = every * (first // every) - 1  # the newest checkpoint before `first`
        lost.append(t - restore)
    return sum(lost) / len(lost)
