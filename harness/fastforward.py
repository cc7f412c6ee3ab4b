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

import os
import shutil
from dataclasses import replace
from pathlib import Path

from torch import nn

from harness import checkpoint
from harness.config import RunConfig, Segment, TrialSpec, golden_id
from harness.plugins import Detector, RankInfo


def snapshot_path(store: Path, seed: int, step: int) -> Path:
    return store / golden_id(seed) / f"ff_{step:06d}.pt"


def _checks_path(snapshot: Path, rank: int) -> Path:
    return snapshot.with_name(f"{snapshot.stem}.rank{rank}.pt")


def save_snapshot(
    snapshot: Path, model: nn.Module, optimizer, checks: list[Detector], info: RankInfo
) -> None:
    """Rank 0 saves the weights and optimizer state (the replicas are identical); every rank
    saves its own checks' state. A snapshot is only a shortcut: one that cannot be written (a
    full disk) is skipped, and its trials train from step 0."""
    try:
        if info.rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            checkpoint.save(snapshot, state)
        states = {check.name: check.state_dict() for check in checks}
        checkpoint.save(_checks_path(snapshot, info.rank), states)
    except OSError:
        return


def load_checks(snapshot: Path, checks: list[Detector], info: RankInfo) -> None:
    """Hand each check the state its golden twin held at the snapshot, if one was saved (a
    recovery checkpoint carries none: checks restart after a rollback)."""
    path = _checks_path(snapshot, info.rank)
    if not path.exists():
        return
    states = checkpoint.load(path)
    for check in checks:
        check.load_state_dict(states[check.name])


def _verified(store: Path, seed: int, step: int, world: int) -> Path | None:
    """The snapshot after `step` of the golden run of `seed`, if it and every rank's check
    state match their checksums."""
    snapshot = snapshot_path(store, seed, step)
    files = [snapshot, *(_checks_path(snapshot, r) for r in range(world))]
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
    for path in (store / golden_id(spec.seed)).glob("step_*.pt"):
        if int(path.stem.split("_")[1]) >= start:
            continue
        for source in (path, path.with_name(path.name + ".sha256")):
            destination = target / source.name
            if destination.exists():
                continue
            try:
                os.link(source, destination)
            except OSError:
                shutil.copyfile(source, destination)


def drop_snapshots(store: Path, run: RunConfig) -> None:
    """Once every trial has run, the golden runs' stores are no longer needed."""
    if run.checkpoint.keep:
        return
    for golden in run.golden_specs():
        shutil.rmtree(store / golden.trial_id, ignore_errors=True)
