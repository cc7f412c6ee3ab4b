"""The plug-ins' view of a sharded step: each of harness/runtime/sharding.py's collective sites
handed to the bus as a `Bucket` of named tensors, as the DDP hook hands it its chunks
(harness/runtime/comm.py). A bucket is one FSDP group, `Bucket.index` its place in wrap order.

- local gradients (site `grad`, checks before the reduction): the reduce-scatter input holds
  each parameter's gradient in dim-0 chunks spread over the rows of a (shard group, shard numel)
  buffer. The plug-ins see each parameter whole, indexed as under DDP, in a parameter-major copy
  written back into the input after them: two copies of the local gradient a step, the price of
  naming its elements as the replicated checks do. Then the riders (`Plugin.rider`): each
  plug-in's few numbers per receiver, taken from the reduce-scatter input as sent, its rows
  (`Bucket.shards`), and summed over the world in one small all-reduce of their own (FSDP's
  reduce-scatter buffers are its own: riding in them would copy the whole gradient). The
  receiver gets its row back with its shard, `Bucket.riders` as under DDP.
- received (site `allreduce`, checks after the reduction): this rank's own shard, a view of its
  chunk of each parameter (padding left out), no copy; an element's index is its place in the
  chunk. Under HSDP, the result of the all-reduce across replicas: the gradient the optimizer
  steps on.
- gathered (site `gather`): the parameters as all-gathered for this rank's forward, whole,
  copied and written back as the local gradients are. Backward's re-gather is left alone: one
  corrupt transfer corrupts one use of the weights.

Entry contract: `bind` gives the bus before the first step, the trainer sets `step` before each
forward; the sites run inside FSDP's collectives, on every rank of a shard group together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from harness.core import inflight
from harness.core.bus import PluginBus
from harness.core.plugins import Bucket
from harness.core.stopwatch import HOOK
from harness.runtime.sharding import GroupLayout, ShardSites, predivide


class ShardedBuckets:
    """The sites of `sharding.shard`, bound to a plug-in bus."""

    def __init__(self, hsdp: bool, world_size: int):
        self.groups = 0  # FSDP groups, set once the sites are installed
        # The reduced shard the optimizer steps on: HSDP's all-reduce follows the reduce-scatter.
        self.final_stage = "all_reduce" if hsdp else "reduce_scatter"
        self.world_size = world_size
        # What FSDP divides a summed (float16) input by before the reduce-scatter.
        self.predivided_by = predivide(world_size)
        # Per group: what a rank contributes of its input (`Bucket.contribution`), this rank's
        # row of the summed riders, and where each plug-in's lies in it.
        self.riders: dict[int, tuple[float, torch.Tensor, list[tuple[int, int, int]]]] = {}
        self.bus: PluginBus | None = None
        self.step = 0

    def bind(self, bus: PluginBus) -> None:
        self.bus = bus

    def sites(self) -> ShardSites:
        """The sites, each one's own time (apart from the plug-ins') charged to the hook."""
        return ShardSites(
            self._charged(self._local), self._charged(self._received), self._charged(self._gathered)
        )

    def _charged(self, site: Callable[..., None]) -> Callable[..., None]:
        def timed(*args: Any) -> None:
            with self._bus().charged(HOOK):
                site(*args)

        return timed

    def _local(self, layout: GroupLayout, flat: torch.Tensor, averaged: bool) -> None:
        bus = self._bus()
        divided_by = 1 if averaged else self.predivided_by
        self._whole(layout, flat, lambda bucket: bus.local_grad(self.step, bucket), divided_by)
        # Averaged over the shard group, then under HSDP over the replicas: 1 / world in all.
        # Summed (float16), the input was divided before this site and the rest comes after
        # the received shard's (harness/runtime/sharding.py).
        contribution = 1 / self.world_size if averaged else 1.0
        rows = self._bucket(layout, flat, [], contribution)
        riders = bus.riders(self.step, rows)
        if not riders:
            return
        region = torch.cat([payload.view(layout.world, -1) for _, payload in riders], dim=1)
        spans, at = [], 0
        for owner, payload in riders:
            k = payload.numel() // layout.world
            spans.append((owner, at, k))
            at += k
        dist.all_reduce(region)
        inflight.hold(region)
        self.riders[layout.index] = (contribution, region[layout.rank], spans)

    def _received(self, layout: GroupLayout, stage: str, shard: torch.Tensor) -> None:
        if stage != self.final_stage:
            return
        tensors = []
        for span in layout.spans:
            held = min(span.length, max(0, math.prod(span.shape) - layout.rank * span.length))
            tensors.append((span.name, shard[span.offset : span.offset + held]))
        bucket = self._bucket(layout, shard, tensors)
        if layout.index in self.riders:
            bucket.contribution, summed, spans = self.riders.pop(layout.index)
            bucket.riders = {owner: summed[a : a + k] for owner, a, k in spans}
            bucket.rider_region = summed
        self._bus().reduced_grad(self.step, bucket)

    def _gathered(self, layout: GroupLayout, backward: bool, flat: torch.Tensor) -> None:
        if not backward:
            self._whole(layout, flat, lambda bucket: self._bus().gathered(self.step, bucket))

    def _whole(self, layout: GroupLayout, flat: torch.Tensor, visit, divided_by: float = 1) -> None:
        """`visit` a parameter-major copy of a (shard group, shard numel) buffer, then write
        the copy back into it; with no plug-in on the bus (the runs without checks or faults),
        no copy at all."""
        if not self._bus().plugins:
            return
        rows = flat.view(layout.world, -1)
        copy = flat.new_empty(flat.numel())
        tensors, at = [], 0
        for span in layout.spans:
            n = layout.world * span.length
            copy[at : at + n].view(layout.world, span.length).copy_(
                rows[:, span.offset : span.offset + span.length]
            )
            tensors.append((span.name, copy[at : at + math.prod(span.shape)].view(span.shape)))
            at += n
        visit(self._bucket(layout, copy, tensors, divided_by=divided_by))
        at = 0
        for span in layout.spans:
            n = layout.world * span.length
            rows[:, span.offset : span.offset + span.length].copy_(
                copy[at : at + n].view(layout.world, span.length)
            )
            at += n

    def _bucket(
        self,
        layout: GroupLayout,
        buffer: torch.Tensor,
        tensors: list[tuple[str, torch.Tensor]],
        contribution: float = 1.0,
        divided_by: float = 1,
    ) -> Bucket:
        return Bucket(
            layout.index,
            buffer,
            tensors,
            is_last=layout.index == self.groups - 1,
            contribution=contribution,
            divided_by=divided_by,
            shards=layout.world,
            shard=layout.rank,
        )

    def _bus(self) -> PluginBus:
        assert self.bus is not None, "bind the bus before the first step"
        return self.bus
