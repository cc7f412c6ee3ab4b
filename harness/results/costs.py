"""What each check cost a user's own job, as the guard measured it there (`guard.costs()`,
`guard.write_costs(path)`), and as `sdc-plan --costs FILE` reads it back.

Seconds per step are means over the steps measured (every step after a warm-up): a check that
runs every k steps costs its run over k, as long as the steps measured span several of its
runs. `overhead_pct` is that against the step without the guard: the loop's own step time less
everything the guard spent in it (every check, the hook and a rehearsed fault's injection).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CheckCost:
    seconds_per_step: float
    overhead_pct: float
    interval: int | None = None  # the check runs every `interval` steps; None: every step
    # Its looks in the steps measured, where the check counts them (replay's audits, listed
    # steps, extra looks before checkpoints): its figure is that many looks' cost; None: priced
    # by its interval.
    looks: int | None = None


@dataclass(frozen=True)
class JobCosts:
    step_time_s: float  # the loop's step, the guard's work in it included (mean)
    steps: int  # steps measured
    warmup: int  # steps left out before them
    device: str
    parallel: str  # ddp, fsdp or hsdp
    world_size: int
    checks: dict[str, CheckCost]
    hook: CheckCost  # the guard's own work around the checks: comm hook, shard sites, stop point
    injection: CheckCost | None = None  # a rehearsed fault's (not a check's cost)

    @property
    def spent(self) -> float:
        """Seconds per step the guard's work took: every check, the hook, an injection."""
        parts = [*self.checks.values(), self.hook, *([self.injection] if self.injection else [])]
        return sum(part.seconds_per_step for part in parts)

    def write(self, path: Path) -> None:
        """Atomically: a reader never sees half a file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> JobCosts:
        """A file `write` wrote; ValueError naming what is wrong with any other, and the first
        figure no guard writes (a file edited by hand, or damaged): sdc-plan would plan on it."""
        try:
            data = json.loads(path.read_text())
            entry = _entry(data["hook"])
            costs = cls(
                step_time_s=float(data["step_time_s"]),
                steps=data["steps"],
                warmup=data["warmup"],
                device=str(data["device"]),
                parallel=str(data["parallel"]),
                world_size=data["world_size"],
                checks={str(name): _entry(c) for name, c in data["checks"].items()},
                hook=entry,
                injection=_entry(data["injection"]) if data.get("injection") else None,
            )
        except OSError as exc:
            raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{path}: not a costs file from guard.write_costs ({exc})") from None
        unwritten = _unwritten(costs)
        if unwritten:
            raise ValueError(f"{path}: {unwritten}; not a figure guard.write_costs writes")
        return costs


def _entry(data: dict[str, Any]) -> CheckCost:
    cost = CheckCost(
        seconds_per_step=float(data["seconds_per_step"]),
        overhead_pct=float(data["overhead_pct"]),
        interval=data.get("interval"),
        looks=data.get("looks"),
    )
    if not math.isfinite(cost.overhead_pct):
        raise ValueError("an overhead that is not a number")
    return cost


def _unwritten(costs: JobCosts) -> str | None:
    """The first figure of `costs` outside what the guard writes, as `key: value, what is
    allowed`; None where there is none."""

    def whole(value: object, least: int) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= least

    if not (math.isfinite(costs.step_time_s) and costs.step_time_s > 0):
        return f"step_time_s: {costs.step_time_s:g}, seconds > 0"
    for key, least in (("steps", 1), ("warmup", 0), ("world_size", 1)):
        if not whole(getattr(costs, key), least):
            return f"{key}: {getattr(costs, key)}, a whole number >= {least}"
    parts = {f"checks.{name}": c for name, c in costs.checks.items()}
    parts |= {"hook": costs.hook, **({"injection": costs.injection} if costs.injection else {})}
    for key, part in parts.items():
        for field in ("seconds_per_step", "overhead_pct"):
            if not getattr(part, field) >= 0:
                return f"{key}.{field}: {getattr(part, field):g}, a figure >= 0"
        if part.interval is not None and not whole(part.interval, 1):
            return f"{key}.interval: {part.interval}, a whole number of steps >= 1, or null"
        if part.looks is not None and not (whole(part.looks, 0) and part.looks <= costs.steps):
            return (
                f"{key}.looks: {part.looks}, a whole number from 0 to the {costs.steps} steps "
                "measured, or null"
            )
    return None


def combined(per_rank: list[JobCosts]) -> JobCosts:
    """The world's costs from each rank's: each part's mean over the ranks, and the mean step.
    (A rank's parts add up to less than its step; the slowest rank's figure for each part would
    not, since time one rank's check waits in a collective for another is another's lag.)"""
    first = per_rank[0]

    def mean(parts: list[CheckCost | None]) -> CheckCost | None:
        found = [p for p in parts if p is not None]
        if not found:
            return None
        seconds = sum(p.seconds_per_step for p in found) / len(per_rank)
        return CheckCost(seconds, math.nan, found[0].interval, found[0].looks)

    return priced(
        replace(
            first,
            step_time_s=sum(c.step_time_s for c in per_rank) / len(per_rank),
            checks={name: mean([c.checks.get(name) for c in per_rank]) for name in first.checks},
            hook=mean([c.hook for c in per_rank]),
            injection=mean([c.injection for c in per_rank]),
        )
    )


def priced(raw: JobCosts) -> JobCosts:
    """`raw` with each part's overhead in percent of the step without the guard's work."""
    base = raw.step_time_s - raw.spent

    def pct(part: CheckCost) -> CheckCost:
        share = 100 * part.seconds_per_step / base if base > 0 else math.inf
        return replace(part, overhead_pct=share)

    return replace(
        raw,
        checks={name: pct(c) for name, c in raw.checks.items()},
        hook=pct(raw.hook),
        injection=pct(raw.injection) if raw.injection else None,
    )
