"""Fast-forward snapshots inside a rank: a golden run saves its state after the steps the
campaign plans (harness/campaign/fastforward.py), and a trial starting from one loads its checks'
state. Written with checksums (harness/runtime/checkpoint.py) like every checkpoint.

A sharded model's snapshot holds its full (unsharded) state, gathered to rank 0, in the same one
file as a replica's: loading it reshards by slicing, so a trial that starts from it is exactly
where the golden run was (torch.distributed.checkpoint.state_dict, full_state_dict)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from harness.config.schema import golden_id
from harness.core.dtensors import is_dtensor
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
    state = _training_state(model, optimizer)  # every rank: a sharded model gathers its state
    try:
        if info.rank == 0:
            checkpoint.save(snapshot, state)
        states = {check.name: check.state_dict() for check in checks}
        checkpoint.save(checks_path(snapshot, info.rank), states)
    except OSError:
        return


def _sharded(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The weights and optimizer state, whole (for rank 0, under sharding)."""
    if not _sharded(model):
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights, moments = get_state_dict(model, optimizer, options=options)
    return {"model": weights, "optimizer": moments}


def restore(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load a snapshot's or checkpoint's state; a sharded model takes its own shards of it."""
    if not _sharded(model):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    # torch's loader maps only the settings a group already has; a schedule's base rate
    # (`initial_lr`, set at the first step) is not there yet in a run that starts mid-way.
    for group, saved in zip(
        optimizer.param_groups, state["optimizer"]["param_groups"], strict=True
    ):
        group.update({k: v for k, v in saved.items() if k != "params" and k not in group})
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )


def restore_shards(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Load a sharded checkpoint (torch.distributed.checkpoint): each rank reads its shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for group in optimizer.param_groups:
        # The loader reads only the settings a group already has: the schedule's base rate is
        # a fresh optimizer's rate, as the recipe's first step sets it (Workload.prepare_update).
        group.setdefault("initial_lr", group["lr"])
    weights, moments = get_state_dict(model, optimizer)
    state = {"model": weights, "optimizer": moments}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def load_checks(snapshot: Path, checks: list[Detector], info: RankInfo) -> None:
    """Hand each check the state its golden twin held at the snapshot, if one was saved (a
    recovery checkpoint carries none: checks restart after a rollback)."""
    path = checks_path(snapshot, info.rank)
    if not path.exists():
        return
    states = checkpoint.load(path)
    for check in checks:
        check.load_state_dict(states[check.name])
