"""Fast-forward (docs/design.md, section 6): until its fault first strikes, a trial is its
golden run bit for bit (same seed, same data, checks that only observe), so it starts from the
golden run's snapshot of the step before instead of training from step 0. The golden run
carries the same checks, in observe mode, and each rank saves its checks' state with the
snapshot, so a check that remembers earlier steps (grad_stats' running loss maximum) judges the
trial as it would have from step 0.

What a fast-forwarded trial does not replay: alerts before the fault's first step. They are
false positives, which campaigns measure on clean trials, and those always run from step 0.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from harness.config.schema import FaultConfig, RunConfig, Segment, TrialSpec, golden_id
from harness.runtime import checkpoint, snapshots


def golden_specs(run: RunConfig) -> list[TrialSpec]:
    """The golden runs: one per seed that trials or the noise band use, each saving the
    snapshots its trials start from."""
    seeds = range(run.workload.seed, run.workload.seed + max(run.seeds, run.noise_seeds))
    return [
        TrialSpec(golden_id(s), s, FaultConfig(), golden=True, snapshots=snapshot_steps(run, s))
        for s in seeds
    ]


def snapshot_steps(run: RunConfig, seed: int) -> tuple[int, ...]:
    """The steps whose end state the golden run of `seed` saves for its trials to start from
    (a trial whose fault first strikes at step s starts from the snapshot after s - 1)."""
    if not run.fast_forward:
        return ()
    starts = {t.fault.first_step for t in run.trials if t.seed == seed}
    return tuple(sorted(s - 1 for s in starts if s > 0))


def _verified(store: Path, seed: int, step: int, world: int) -> Path | None:
    """The snapshot after `step` of the golden run of `seed`, if it and every rank's check
    state match their checksums."""
    snapshot = snapshots.snapshot_path(store, seed, step)
    files = [snapshot, *(snapshots.checks_path(snapshot, r) for r in range(world))]
    return snapshot if all(checkpoint.verify(f) for f in files) else None


def has_snapshots(store: Path, golden: TrialSpec, run: RunConfig) -> bool:
    """Whether every snapshot the golden run saves is in the store and verifies."""
    world = run.topology.world_size
    return all(_verified(store, golden.seed, step, world) for step in golden.snapshots)


def fast_forwarded(run: RunConfig, spec: TrialSpec, store: Path) -> TrialSpec:
    """`spec`, starting from its golden snapshot when one verifies; else `spec` as it is (it then
    trains from step 0, with the same result, only slower)."""
    start = spec.fault.first_step
    if spec.golden or spec.segment is not None or not run.fast_forward or start == 0:
        return spec
    world = run.topology.world_size
    snapshot = _verified(store, spec.seed, start - 1, world)
    if snapshot is None:
        return spec
    if run.recovery.enabled:
        _inherit_checkpoints(store, spec, start)
    identity = tuple(range(world))
    return replace(
        spec, segment=Segment(start, str(snapshot), identity, tuple((r,) for r in identity))
    )


def _inherit_checkpoints(store: Path, spec: TrialSpec, start: int) -> None:
    """The checkpoints the trial would have written before `start` are the golden run's: link
    them into the trial's store, where recovery looks for a restore point."""
    target = store / spec.trial_id
    target.mkdir(parents=True, exist_ok=True)
    for step, path in checkpoint.saved(store / golden_id(spec.seed)):
        if step < start:
            checkpoint.place(path, target)


def drop_snapshots(store: Path, run: RunConfig) -> None:
    """Once every trial has run, the golden runs' stores are no longer needed."""
    if run.checkpoint.keep:
        return
    for golden in golden_specs(run):
        shutil.rmtree(store / golden.trial_id, ignore_errors=True)
