"""Fast-forward snapshots inside a rank: a golden run saves its state after the steps the
campaign plans (harness/campaign/fastforward.py), and a trial starting from one loads its checks'
state. Written with checksums (harness/runtime/checkpoint.py) like every checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from harness.config.schema import golden_id
from harness.core.plugins import Detector, RankInfo
from harness.runtime import checkpoint


def snapshot_path(store: Path, seed: int, step: int) -> Path:
    return store / golden_id(seed) / f"ff_{step:06d}.pt"


def checks_path(snapshot: Path, rank: int) -> Path:
    return snapshot.with_name(f"{snapshot.stem}.rank{rank}.pt")


def save_snapshot(
    snapshot: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    checks: list[Detector],
    info: RankInfo,
) -> None:
    """Rank 0 saves the weights and optimizer state (the replicas are identical); every rank
    saves its own checks' state. A snapshot is only a shortcut: one that cannot be written (a
    full disk) is skipped, and its trials train from step 0."""
    try:
        if info.rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            checkpoint.save(snapshot, state)
        states = {check.name: check.state_dict() for check in checks}
        checkpoint.save(checks_path(snapshot, info.rank), states)
    except OSError:
        return


def load_checks(snapshot: Path, checks: list[Detector], info: RankInfo) -> None:
    """Hand each check the state its golden twin held at the snapshot, if one was saved (a
    recovery checkpoint carries none: checks restart after a rollback)."""
    path = checks_path(snapshot, info.rank)
    if not path.exists():
        return
    states = checkpoint.load(path)
    for check in checks:
        check.load_state_dict(states[check.name])
