"""Benchmark 5: campaign throughput, trials per minute of the campaign engine against a naive
loop that spawns a world per trial and trains it from step 0 (docs/design.md, section 6).

The engine's side is a whole campaign through `run_campaign`, as `sdc-bench` runs it: one
spawned world for every run, the golden runs first (their time is counted against the
trials), each faulty trial fast-forwarded from its golden run's snapshot, every row written
and fsynced. The naive side runs some of the same trials, each in a world of its own, from
step 0, and without golden runs at all (so it is flattered: a real naive loop also needs them).

The figure is the engine's campaign, `default` (the `mlp` workload, faults at step 10 of 30),
where training a trial costs less than spawning a world: that is what serving and
fast-forwarding save, and what a laptop campaign is made of. The same comparison on `gpt` is
shown for information: there a 30-step trial costs seconds of training, and no engine can save
more than the share of it before the fault plus the spawn.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import compose_run
from benchmarks.timing import Figure
from harness.campaign.run import run_campaign
from harness.config.schema import RunConfig, TrialSpec
from harness.launch.world import World

GPT = ("workload=gpt", "campaign.seeds=1", "campaign.noise_seeds=2",
       "campaign.scenarios=[{site:grad,model:bitflip,ranks:[1],bit:exponent_msb,"
       "grid:{steps:[[3],[8],[13],[18],[23],[28]]}}]")  # fmt: skip


@dataclass(frozen=True)
class Plan:
    campaign: tuple[str, ...] = ("campaign=default",)
    naive: int = 3  # trials, each in a world of its own
    gpt: bool = True  # the same comparison on the gpt workload, for information

    @classmethod
    def quick(cls) -> Plan:
        """One-rank worlds, three steps, two trials."""
        small = ("campaign=single", "fault=grad_bitflip", "topology.nodes=1", "fault.ranks=[0]",
                 "fault.steps=[1]", "workload.steps=3", "campaign.seeds=2")  # fmt: skip
        return cls(campaign=small, naive=1, gpt=False)


def served(run: RunConfig, workdir: Path) -> float:
    """Seconds per trial of the whole campaign through the engine, golden runs included."""
    out = Path(tempfile.mkdtemp(dir=workdir, prefix="served-"))
    started = time.perf_counter()
    run_campaign(run, out)
    return (time.perf_counter() - started) / len(run.trials)


def naive(run: RunConfig, specs: list[TrialSpec], workdir: Path) -> float:
    """Seconds per trial, each in a freshly spawned world, trained from step 0."""
    started = time.perf_counter()
    for spec in specs:
        world = World(run.topology, workdir / "naive", workdir / "store")
        try:
            if world.run(run, spec).parts is None:
                raise RuntimeError(f"throughput trial {spec.trial_id} crashed")
        finally:
            world.close()
    return (time.perf_counter() - started) / len(specs)


def _faulty(run: RunConfig, count: int) -> list[TrialSpec]:
    """`count` faulty trials spread over the campaign's list (clean ones would flatter no one)."""
    faulty = [t for t in run.trials if not t.fault.clean]
    return faulty[:: max(1, len(faulty) // count)][:count]


def compare(overrides: tuple[str, ...], naive_trials: int, workdir: Path) -> tuple[float, float]:
    """(seconds per trial through the engine, seconds per trial in a naive loop)."""
    run = compose_run(*overrides)
    return served(run, workdir), naive(run, _faulty(run, naive_trials), workdir)


def run(workdir: Path, plan: Plan) -> list[Figure]:
    """Figure 5: the speed-up and each side's trials per minute; the gpt comparison as info."""
    engine, loop = compare(plan.campaign, plan.naive, workdir)
    name = " ".join(plan.campaign)
    figures = [
        Figure("throughput_speedup", f"campaign throughput, engine / a world per trial ({name})",
               loop / engine, target=10, op=">=",
               note="engine: golden runs included, trials fast-forwarded; naive: no golden runs"),
        Figure("throughput_served", "trials per minute, the engine", 60.0 / engine, "/min"),
        Figure("throughput_naive", f"trials per minute, a world per trial ({plan.naive} trials)",
               60.0 / loop, "/min"),
    ]  # fmt: skip
    if plan.gpt:
        engine, loop = compare(GPT, plan.naive, workdir)
        figures.append(
            Figure("throughput_speedup_gpt", "campaign throughput on gpt (6 faults, steps 3-28)",
                   loop / engine, note="info: training dominates a 30-step gpt trial")
        )  # fmt: skip
    return figures
