"""Timing whole training steps in real simulated worlds (harness.launch.world), detectors included.

A world serves many trials, and each trial may carry its own RunConfig, so one world times
every detector configuration in turn, each between two trials without detectors.

Two measures of each trial:

- Wall time per step, as docs/design.md defines overhead: each step's slowest rank, as trials.csv's
  `step_time_s` takes it (the ranks wait for each other in the allreduce, so they agree
  closely). Checks that run
  every k steps make the series periodic, so a plain median over steps would return the cost
  of a step without the check: steps are grouped by their position in the cycle (step mod
  cycle), each position's median taken, and the positions averaged: the amortized step.
- CPU time of the rank processes over the whole trial (from /proc), less the trial's fixed
  cost (building the model, DDP, the final evaluation; measured as a one-step trial). Waiting
  costs no CPU time, so this measure moves much less when other programs load the machine,
  but it misses the latency of a collective. Trials span whole cycles from step 0, so each
  check runs exactly steps / interval times.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.common import compose_run
from harness.campaign.overhead import WARMUP_STEPS, amortized_step
from harness.config.load import detector_configs
from harness.config.schema import FaultConfig, RunConfig, TrialSpec
from harness.launch.world import World

# No checkpoint in a timed trial: writing one is I/O on rank 0, not a detector's cost.
NO_CHECKPOINT = "checkpoint.interval=1000000"


def base_run(steps: int, nodes: int = 4, *overrides: str, workload: str = "gpt") -> RunConfig:
    """A clean trial of `workload` (the reference, `gpt`, unless named) for `steps` steps without
    detectors, as `sdc-bench` composes it."""
    return compose_run(
        "campaign=single",
        "fault=none",
        f"workload={workload}",
        "detectors=[]",
        f"workload.steps={steps}",
        f"topology.nodes={nodes}",
        NO_CHECKPOINT,
        *overrides,
    )


def with_detectors(run: RunConfig, checks: dict[str, dict], **workload: int) -> RunConfig:
    """`run` with other detectors (validated as the config would be) and workload changes.

    Cheaper than composing again through Hydra, which takes a second per config here.
    """
    validated = detector_configs(checks, run.topology)
    return replace(run, detectors=validated, workload=replace(run.workload, **workload))


def steps_for(cycle: int, cycles: int) -> int:
    """Whole cycles from step 0; the second cycle supplies the positions the warm-up drops."""
    assert cycles >= 2 and cycle >= WARMUP_STEPS, (cycle, cycles)
    return cycle * cycles


class Worlds:
    """Spawned worlds by size, kept for reuse and closed together."""

    def __init__(self, workdir: Path | None = None):
        self.tmp = Path(tempfile.mkdtemp(prefix="sdc-bench-", dir=workdir))
        self.worlds: dict[int, World] = {}

    def get(self, run: RunConfig) -> World:
        size = run.topology.world_size
        if size not in self.worlds or not self.worlds[size].alive:
            self.worlds[size] = World(run.topology, self.tmp / "world", self.tmp / "store")
        return self.worlds[size]

    def close(self) -> None:
        # The ranks are idle between trials and hold nothing worth saving: killing them skips
        # the graceful leave (gc, barrier, destroy), which costs seconds on a loaded machine.
        for world in self.worlds.values():
            world.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> Worlds:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def cpu_seconds(world: World) -> float:
    """User + system CPU time of the world's rank processes so far (NaN without /proc)."""
    total = 0
    for proc in world.procs:
        try:
            stat = Path(f"/proc/{proc.pid}/stat").read_text()
        except OSError:
            return math.nan
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, fields 3, 4, ...
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
    return total / os.sysconf("SC_CLK_TCK")


@dataclass
class Trial:
    name: str
    round: int
    series: list[float]  # per step, seconds, the slowest rank
    cpu_s: float  # the ranks' CPU time over the whole trial


def run_trial(
    world: World, run: RunConfig, name: str, r: int, index: int, hook: bool = True
) -> Trial:
    """One clean trial in `world`, timed both ways; `hook` False: plain DDP, without the
    harness's comm hook."""
    trial_id = f"bench-{name}-r{r}-{index}"
    before = cpu_seconds(world)
    outcome = world.run(run, TrialSpec(trial_id, 0, FaultConfig(), hook=hook))
    cpu = cpu_seconds(world) - before
    if outcome.parts is None:
        raise RuntimeError(f"benchmark trial {trial_id} crashed: {outcome.crash}")
    per_rank = [part.step_times for part in outcome.parts]
    series = [max(times) for times in zip(*per_rank, strict=True)]
    return Trial(name, r, series, cpu)


@dataclass
class Timings:
    """Per configuration and round: its ratio to the bare run, by wall time and by CPU time;
    and every trial (for step_times.csv)."""

    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    trials: list[Trial] = field(default_factory=list)

    def ratio(self, name: str) -> float:
        return statistics.median(self.wall[name])

    def cpu_ratio(self, name: str) -> float:
        return statistics.median(self.cpu[name])

    def seconds(self, name: str, cycle: int) -> float:
        return amortized_step([t.series for t in self.trials if t.name == name], cycle)

    def cpu_step(self, base: RunConfig) -> float:
        """CPU seconds of one rank's step without detectors: each bare trial net of its round's
        one-step trial, per step after the first, per rank; the median."""
        fixed = {t.round: t.cpu_s for t in self.trials if t.name == "one_step"}
        steps, ranks = base.workload.steps, base.topology.world_size
        return statistics.median(
            (t.cpu_s - fixed[t.round]) / (steps - 1) / ranks
            for t in self.trials
            if t.name == "none"
        )


def time_configs(
    worlds: Worlds,
    base: RunConfig,
    runs: dict[str, RunConfig],
    rounds: int,
    cycle: int,
    plain_base: bool = False,
) -> Timings:
    """Each configuration's step cost over that of `base`, in `rounds` rounds.

    Within a round every configuration's trial sits between two trials of `base`, and is
    compared with their mean: the load of the machine drifts over seconds, so the baseline is
    taken from the same seconds. Odd rounds go through the configurations backwards. Each
    round starts with a one-step trial: the fixed cost that CPU times are net of. With
    `plain_base`, `base` and the one-step trials run on plain DDP, without the harness's comm
    hook (what the hook itself costs is timed against them).
    """
    timings = Timings(wall={name: [] for name in runs}, cpu={name: [] for name in runs})
    world = worlds.get(base)
    one_step = replace(base, workload=replace(base.workload, steps=1))

    def trial(name: str, run: RunConfig, r: int) -> Trial:
        hook = name not in ("none", "one_step") or not plain_base
        timings.trials.append(run_trial(world, run, name, r, len(timings.trials), hook))
        return timings.trials[-1]

    # A fresh world's first trial also pays for its ranks' start (imports, rendezvous).
    run_trial(world, one_step, "warmup", -1, -1)
    for r in range(rounds):
        fixed = trial("one_step", one_step, r).cpu_s
        before = trial("none", base, r)
        for name in list(runs) if r % 2 == 0 else reversed(list(runs)):
            mine, after = trial(name, runs[name], r), trial("none", base, r)
            wall = [amortized_step([t.series], cycle) for t in (mine, before, after)]
            timings.wall[name].append(2 * wall[0] / (wall[1] + wall[2]))
            bare = (before.cpu_s + after.cpu_s) / 2 - fixed
            timings.cpu[name].append((mine.cpu_s - fixed) / bare if bare > 0 else math.nan)
            before = after
    return timings
