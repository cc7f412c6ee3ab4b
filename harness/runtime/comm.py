"""The one DDP comm hook: the sites around the collective (docs/design.md, section 3, steps 2-5).

    local gradients (grad site, local checks) -> allreduce -> averaged gradients (allreduce
    site, checks on the result)

Plug-ins may append a few float32 numbers (`Plugin.rider`) that are summed with the bucket.
Three ways to reduce:
- harness (the campaigns' trainer): gradients reduced in a fixed layout of the harness's own,
  whatever DDP's buckets are at the time (below), with a fixed rider slot appended, whether or
  not a check rides, so detectors and recovery never change the trajectory;
- transparent: exactly what DDP's default allreduce does to the bucket, so a user's own loop
  with the guard attached trains bit-identically to the loop without it (riders then pay for a
  small collective of their own);
- wrapped: a comm hook the user already has (say, compression) does the reduction. Riders are
  taken from the local bucket before that hook starts (it may reduce the bucket in place,
  asynchronously), and `LINEAR_HOOKS` tells the sketch what each of torch's own hooks sums.

Why a fixed layout: gloo and NCCL round a sum in an order that depends on the buffer's length
and on each element's position in it. A fresh DDP puts every parameter in one bucket and
rebuilds to a 1 MiB bucket plus 25 MiB buckets, in the order gradients became ready, after its
first step; a run that starts mid-way (fast-forward, recovery, resume) would reduce its first
step in another layout than the run it must match bit for bit. So the trainer's DDP keeps one
bucket per dtype for its whole life (`harness_ddp`) and the hook reduces it in `fixed_layout`'s
chunks: parameters in reverse definition order (roughly the order backward produces them), a
first chunk up to 1 MiB, then up to 25 MiB, never splitting a parameter. A chunk is what a
plug-in sees as a bucket, and `fault.bucket` indexes chunks. The price: the reduction starts
when backward ends, instead of overlapping with it; overhead.csv measures the hook against
plain DDP.

DDP checks the hook's parameter names and its `dist.GradBucket` annotation, so this module must
not use postponed annotations.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.core.plugins import Bucket, PluginBus

FIRST_CHUNK_BYTES = 1 << 20
CHUNK_BYTES = 25 << 20
# DDP's bucket cap in MiB: above any model's size, so DDP never splits a dtype's gradients.
_ONE_BUCKET_MB = 1 << 30


# Torch's comm hooks whose reduction is a plain sum of each rank's bucket divided by the world
# size, and the dtype each sums in (None: the bucket's own): what the sketch can verify.
LINEAR_HOOKS: dict[Callable, torch.dtype | None] = {
    default_hooks.allreduce_hook: None,
    default_hooks.fp16_compress_hook: torch.float16,
    default_hooks.bf16_compress_hook: torch.bfloat16,
}


def rider_slots(world_size: int) -> int:
    """Float32 slots appended to every float32 chunk's allreduce, whether or not a check rides
    on them: a buffer that grew only when a detector is on would change the trajectory."""
    return 8 + 4 * world_size


def fixed_layout(model: nn.Module) -> list[tuple[str, ...]]:
    """The harness's reduction chunks: parameter names, per dtype, in reverse definition order,
    closed at FIRST_CHUNK_BYTES (a dtype's first chunk) or CHUNK_BYTES."""
    chunks: list[tuple[str, ...]] = []
    open_: dict[torch.dtype, list[str]] = {}
    size: dict[torch.dtype, int] = {}
    closed: dict[torch.dtype, int] = {}
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        open_.setdefault(p.dtype, []).append(name)
        size[p.dtype] = size.get(p.dtype, 0) + p.numel() * p.element_size()
        cap = FIRST_CHUNK_BYTES if closed.get(p.dtype, 0) == 0 else CHUNK_BYTES
        if size[p.dtype] >= cap:
            chunks.append(tuple(open_.pop(p.dtype)))
            size[p.dtype] = 0
            closed[p.dtype] = closed.get(p.dtype, 0) + 1
    chunks += [tuple(names) for names in open_.values()]
    return chunks


def harness_ddp(model: nn.Module, state: "HookState") -> DDP:
    """DDP with one bucket per dtype for its whole life, reduced by the harness's hook."""
    ddp = DDP(model, bucket_cap_mb=_ONE_BUCKET_MB)
    ddp.register_comm_hook(state, comm_hook)
    return ddp


@dataclass
class KeptChunk:
    """One chunk's local contribution to a step's reduction, as it was before the collective
    (checked there): what a retry of the reduction, or a sub-group reduction, sends again."""

    step: int
    view: Bucket
    names: list[str]
    sizes: list[int]
    spans: list[tuple[int, int, int]]  # (rider owner, offset, length) in the rider region
    shared: bool  # the rider region rides in the chunk's own collective
    payload: torch.Tensor  # the chunk, with the rider region when shared
    slot: torch.Tensor  # the rider region

    def parts(self) -> list[torch.Tensor]:
        """Fresh copies of what the chunk sends into a reduction: the chunk with its rider
        region, or the chunk and the rider region's own collective when they cannot share one."""
        return [self.payload.clone()] + (
            [] if self.shared or not self.spans else [self.slot.clone()]
        )


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
        self.layout = fixed_layout(model)
        self.step = 0
        # With `keep_contributions`, each chunk's local contribution of the step is kept for
        # `retry_reduction` and for locating the node that breaks a reduction.
        self.keep_contributions = False
        self.kept: list[KeptChunk] = []
        self.params = dict(model.named_parameters())

    def pack(
        self, riders: list[tuple[int, torch.Tensor]], device: torch.device
    ) -> tuple[torch.Tensor, list]:
        slot = torch.zeros(self.slots, dtype=torch.float32, device=device)
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
    if state.transparent or state.inner is not None:
        return _user_layout(state, bucket)
    return _fixed_layout(state, bucket)


def _fixed_layout(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """Every chunk of the bucket's parameters, each one collective, launched together; the
    plug-ins on the results run in chunk order once all have arrived."""
    step = state.step
    grads = {
        state.names[id(p)]: g for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
    }
    mine = [(i, names) for i, names in enumerate(state.layout) if names[0] in grads]
    assert sum(len(names) for _, names in mine) == len(grads), "a DDP bucket split a dtype"
    launched = []
    if state.kept and state.kept[0].step != step:
        state.kept = []
    for k, (index, names) in enumerate(mine):
        sizes = [grads[n].numel() for n in names]
        dtype = grads[names[0]].dtype
        flat = torch.cat([grads[n].reshape(-1) for n in names])
        view = Bucket(
            index=index,
            buffer=flat,
            tensors=_named_views(flat, names, sizes, grads),
            is_last=bucket.is_last() and k == len(mine) - 1,
        )
        state.bus.local_grad(step, view)
        view.buffer.div_(state.world_size)
        slot, spans = state.pack(state.bus.riders(step, view), view.buffer.device)
        shared = dtype == torch.float32
        payload = torch.cat([view.buffer, slot]) if shared else view.buffer
        if state.keep_contributions:
            state.kept.append(
                KeptChunk(step, view, names, sizes, spans, shared, payload.clone(), slot.clone())
            )
        state.bus.contribution(step, index, [payload] if shared or not spans else [payload, slot])
        futures = [dist.all_reduce(payload, async_op=True).get_future()]
        if spans and not shared:
            # A payload that cannot share the chunk's own collective pays for one.
            futures.append(dist.all_reduce(slot, async_op=True).get_future())
        launched.append((view, names, sizes, spans, shared, slot, futures))
    everything = [f for *_, futures in launched for f in futures]

    def reduced(_: torch.futures.Future) -> torch.Tensor:
        for view, names, sizes, spans, shared, slot, futures in launched:
            result = _value(futures[0])
            summed = result[sum(sizes) :] if shared else (_value(futures[1]) if spans else slot)
            _deliver(state, step, view, names, sizes, spans, result, summed, grads)
        return bucket.buffer()

    return torch.futures.collect_all(everything).then(reduced)


def _deliver(state, step, view, names, sizes, spans, result, summed, grads) -> None:
    """A chunk's reduced result to the plug-ins, then into the gradients `grads` by name."""
    n = sum(sizes)
    view.buffer = result[:n]
    view.tensors = _named_views(view.buffer, names, sizes, grads)
    view.riders = {owner: summed[a : a + k] for owner, a, k in spans}
    view.rider_region = summed if result.numel() > n or spans else None
    state.bus.reduced_grad(step, view)
    for name, reduced_view in view.tensors:
        grads[name].copy_(reduced_view)


def retry_reduction(state: HookState, step: int) -> None:
    """Reduce the step's chunks again from the local contributions kept before the collective
    (checked there, so still good), through the same plug-ins, into the parameters' gradients.
    A transient fault of the first reduction is gone; one that repeats alarms again."""
    grads = {name: p.grad for name, p in state.params.items() if p.grad is not None}
    for kept in state.kept:
        parts = kept.parts()
        state.bus.contribution(step, kept.view.index, parts)
        for part in parts:
            dist.all_reduce(part)
        n = sum(kept.sizes)
        summed = parts[0][n:] if kept.shared else (parts[1] if kept.spans else kept.slot)
        _deliver(
            state, step, kept.view, kept.names, kept.sizes, kept.spans, parts[0], summed, grads
        )


def reduce_in_group(
    state: HookState, step: int, kept: KeptChunk, group: Any, members: tuple[int, ...]
) -> list[torch.Tensor]:
    """One kept chunk reduced over the world ranks `members` alone (a diagnostic reduction,
    harness/runtime/locate.py), through the plug-ins' group hooks; the reduced parts. Members
    only."""
    parts = kept.parts()
    state.bus.group_contribution(step, kept.view.index, parts, members)
    for part in parts:
        dist.all_reduce(part, group=group)
    n = sum(kept.sizes)
    summed = Bucket(
        index=kept.view.index,
        buffer=parts[0][:n],
        tensors=_named_views(parts[0][:n], kept.names, kept.sizes, state.params),
        is_last=kept.view.is_last,
    )
    summed.rider_region = parts[0][n:] if kept.shared else (parts[1] if kept.spans else None)
    state.bus.group_reduced(step, summed, members)
    return parts


def _value(future: torch.futures.Future) -> torch.Tensor:
    value = future.value()
    return value[0] if isinstance(value, list) else value


def _named_views(
    flat: torch.Tensor, names: tuple[str, ...], sizes: list[int], like: dict[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    views, at = [], 0
    for name, n in zip(names, sizes, strict=True):
        views.append((name, flat[at : at + n].view_as(like[name])))
        at += n
    return views


def _user_layout(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """The guard's hook: DDP's own bucket, reduced as DDP or the user's hook would."""
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
    if state.inner is None:
        buffer.div_(state.world_size)
        slot, spans = state.pack(state.bus.riders(step, view), view.buffer.device)
        futures = [dist.all_reduce(buffer, async_op=True).get_future()]
    else:
        # Riders first: the wrapped hook may start reducing the bucket in place, asynchronously.
        # It divides by the world size itself, and may compress to another dtype on the way.
        inner_state, inner_hook = state.inner
        view.contribution = 1.0 / state.world_size
        view.wire = LINEAR_HOOKS.get(inner_hook)
        slot, spans = state.pack(state.bus.riders(step, view), view.buffer.device)
        futures = [inner_hook(inner_state, bucket)]
    if spans:
        # A payload that cannot share the bucket's own collective pays for one.
        futures.append(dist.all_reduce(slot, async_op=True).get_future())

    def reduced(fut: torch.futures.Future) -> torch.Tensor:
        done = [_value(f) for f in fut.value()]
        result = done[0]
        view.buffer = result
        view.tensors = _views(result, buffer, view.tensors)
        view.riders = {owner: done[1][a : a + k] for owner, a, k in spans}
        state.bus.reduced_grad(step, view)
        return result

    return torch.futures.collect_all(futures).then(reduced)


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
