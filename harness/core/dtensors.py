"""Sharded parameters (FSDP2's DTensors) where replicated code meets them, without importing
`torch.distributed.tensor`: that import costs 0.4 s in every command and rank process, and a
replicated run never makes a DTensor. A DTensor can exist only once its module is loaded, so
a module not loaded means none is at hand."""

from __future__ import annotations

import itertools
import sys

import torch


def is_dtensor(t: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's own part: a DTensor's local shard (its storage, not a copy), else `t`."""
    return t.to_local() if is_dtensor(t) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective: every rank of its mesh calls it), else `t`."""
    return t.full_tensor() if is_dtensor(t) else t


def places(model: torch.nn.Module, world_size: int) -> list[int]:
    """Each world rank's place in its shard group: its coordinate along the mesh dimension its
    shards are split over. Ranks at the same place hold the same shards, so under HSDP they are
    one shard's replicas; every rank is at place 0 of a replicated world."""
    p = next(model.parameters())
    if not is_dtensor(p):
        return [0] * world_size
    dim = next(i for i, placement in enumerate(p.placements) if placement.is_shard())
    ranks = p.device_mesh.mesh
    place = {int(ranks[at]): at[dim] for at in itertools.product(*map(range, ranks.shape))}
    return [place[r] for r in range(world_size)]
