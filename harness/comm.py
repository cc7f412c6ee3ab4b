"""The one DDP comm hook: the sites around the collective (DESIGN section 3, steps 2-5).

    local gradients (grad site, local checks) -> allreduce -> averaged gradients (allreduce
    site, checks on the result)

Plug-ins may append a few float32 numbers (`Plugin.rider`) that are summed with the bucket.
Three ways to reduce:
- harness (default): the bucket in a canonical (name) order with a fixed rider slot appended,
  whether or not a check rides, so detectors and recovery never change the trajectory;
- transparent: exactly what DDP's default allreduce does to the bucket, so a user's own loop
  with the guard attached trains bit-identically to the loop without it (riders then pay for a
  small collective of their own);
- wrapped: a comm hook the user already has (say, compression) does the reduction.

DDP checks the hook's parameter names and its `dist.GradBucket` annotation, so this module must
not use postponed annotations.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.plugins import Bucket, PluginBus


def rider_slots(world_size: int) -> int:
    """Float32 slots appended to every float32 bucket's allreduce, whether or not a check rides
    on them: gloo's ring sums an element in an order that depends on the buffer's length and on
    its position, so a buffer that grew only when a detector is on would change the
    trajectory."""
    return 8 + 4 * world_size


class HookState:
    """What the comm hook needs; its owner sets `step` before each backward."""

    def __init__(
        self,
        bus: PluginBus,
        model: nn.Module,
        world_size: int,
        transparent: bool = False,
        inner: tuple[Any, Callable] | None = None,
    ):
        self.bus = bus
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.world_size = world_size
        self.slots = rider_slots(world_size)
        self.transparent = transparent
        self.inner = inner
        self.step = 0

    def pack(self, riders: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, list]:
        slot = torch.zeros(self.slots, dtype=torch.float32)
        spans, at = [], 0
        for owner, payload in riders:
            n = payload.numel()
            if at + n > self.slots:
                raise RuntimeError(f"riders need more than {self.slots} slots")
            slot[at : at + n] = payload.reshape(-1)
            spans.append((owner, at, n))
            at += n
        return slot, spans


def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Local plug-ins, the collective, then the plug-ins on the averaged result."""
    step = state.step
    names = [state.names[id(p)] for p in bucket.parameters()]
    view = Bucket(
        index=bucket.index(),
        buffer=bucket.buffer(),
        tensors=list(zip(names, bucket.gradients(), strict=True)),
        is_last=bucket.is_last(),
    )
    state.bus.local_grad(step, view)
    buffer = view.buffer
    if state.inner is not None:
        inner_state, inner_hook = state.inner
        reduction = inner_hook(inner_state, bucket)  # it divides by the world size itself
    else:
        buffer.div_(state.world_size)
    slot, spans = state.pack(state.bus.riders(step, view))
    shared = not (state.transparent or state.inner) and buffer.dtype == torch.float32
    if state.inner is not None:
        futures = [reduction]
    elif state.transparent:
        futures = [dist.all_reduce(buffer, async_op=True).get_future()]
    else:
        # The collective sees the bucket in name order, whatever order DDP laid it out in: DDP
        # rebuilds its buckets after the first step, and a world resumed from a checkpoint
        # starts again with the initial layout. gloo's rounding depends on positions, so only
        # a canonical layout lets a recovered run end bit-identical to an uninterrupted one.
        ordered = sorted(view.tensors, key=lambda named: named[0])
        flat = [t.reshape(-1) for _, t in ordered] + ([slot] if shared else [])
        futures = [dist.all_reduce(torch.cat(flat), async_op=True).get_future()]
    if spans and not shared:
        # A payload that cannot share the bucket's own collective pays for one.
        futures.append(dist.all_reduce(slot, async_op=True).get_future())
    future = torch.futures.collect_all(futures)

    def reduced(fut: torch.futures.Future) -> torch.Tensor:
        done = [f.value()[0] if isinstance(f.value(), list) else f.value() for f in fut.value()]
        result, at = done[0], 0
        if state.inner is None and not state.transparent:
            for _, t in ordered:
                t.copy_(result[at : at + t.numel()].view_as(t))
                at += t.numel()
            result = buffer
        view.buffer = result
        view.tensors = _views(result, buffer, view.tensors)
        summed = done[0][at:] if shared else (done[1] if spans else slot)
        view.riders = {owner: summed[a : a + k] for owner, a, k in spans}
        state.bus.reduced_grad(step, view)
        return result

    return future.then(reduced)


def _views(
    result: torch.Tensor, buffer: torch.Tensor, named: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """The named gradients as views into `result`, which a wrapped hook may have allocated anew."""
    if result.data_ptr() == buffer.data_ptr():
        return named
    base = buffer.storage_offset()
    return [
        (name, result[t.storage_offset() - base :][: t.numel()].view_as(t)) for name, t in named
    ]
