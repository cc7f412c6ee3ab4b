"""Benchmark 5: campaign throughput, trials per minute of one world serving many trials against
a naive loop that spawns a world per trial (and, like every trial today, trains from step 0).

The engine does not yet fast-forward trials from golden checkpoints (DESIGN section 6), so both
sides train every trial from step 0 and the figure measures what serving saves: spawning and
joining the processes, importing torch, and the gloo rendezvous. The trials are a campaign's:
the `grad_bitflip` preset on the `gpt` workload with `nan_inf`, checkpoints every 10 steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import compose_run
from benchmarks.timing import Figure
from harness.config import RunConfig, TrialSpec
from harness.world import World


@dataclass(frozen=True)
class Plan:
    served: int = 8  # trials through one world
    naive: int = 3  # trials, each in a world of its own
    overrides: tuple[str, ...] = ()

    @classmethod
    def quick(cls) -> Plan:
        """One-rank worlds (the quickest to spawn) and three tiny steps."""
        small = ("topology.nodes=1", "fault.ranks=[0]", "fault.steps=[1]", "workload.steps=3",
                 "workload.micro_batch_size=2", "workload.context=16")  # fmt: skip
        return cls(served=2, naive=1, overrides=small)


def campaign_run(plan: Plan) -> RunConfig:
    seeds = max(plan.served, plan.naive)
    preset = ("campaign=single", "fault=grad_bitflip", "workload=gpt", "detectors=[nan_inf]")
    return compose_run(*preset, f"campaign.seeds={seeds}", *plan.overrides)


def served(run: RunConfig, specs: list[TrialSpec], workdir: Path) -> float:
    """Seconds for `specs` through one world, its spawn and close included."""
    started = time.perf_counter()
    world = World(run.topology, workdir / "served", workdir / "store")
    try:
        for spec in specs:
            _check(world.run(run, spec), spec)
    finally:
        world.close()
    return time.perf_counter() - started


def naive(run: RunConfig, specs: list[TrialSpec], workdir: Path) -> float:
    """Seconds for `specs`, each in a freshly spawned world."""
    started = time.perf_counter()
    for spec in specs:
        world = World(run.topology, workdir / "naive", workdir / "store")
        try:
            _check(world.run(run, spec), spec)
        finally:
            world.close()
    return time.perf_counter() - started


def _check(outcome, spec: TrialSpec) -> None:
    if outcome.parts is None:
        raise RuntimeError(f"throughput trial {spec.trial_id} crashed: {outcome.crash}")


def run(workdir: Path, plan: Plan) -> list[Figure]:
    """Figure 5: the speed-up, and each side's trials per minute."""
    campaign = campaign_run(plan)
    specs = list(campaign.trials)
    per_trial_served = served(campaign, specs[: plan.served], workdir) / plan.served
    per_trial_naive = naive(campaign, specs[: plan.naive], workdir) / plan.naive
    per_minute_served, per_minute_naive = 60.0 / per_trial_served, 60.0 / per_trial_naive
    steps = campaign.workload.steps
    note = f"{steps}-step gpt trials; no fast-forward from golden checkpoints yet"
    return [
        Figure("throughput_speedup", "campaign throughput, one world / a world per trial",
               per_minute_served / per_minute_naive, target=10, op=">=", note=note),
        Figure("throughput_served", f"trials per minute, one world ({plan.served} trials)",
               per_minute_served, "/min"),
        Figure("throughput_naive", f"trials per minute, a world per trial ({plan.naive} trials)",
               per_minute_naive, "/min"),
        Figure("throughput_world_s", "what a world per trial adds: spawn, rendezvous, close",
               per_trial_naive - per_trial_served, "s"),
    ]  # fmt: skip
