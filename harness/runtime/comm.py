"""The one DDP comm hook: the sites around the collective (docs/design.md, section 3, steps 2-5).

    local gradients (grad site, local checks) -> allreduce -> averaged gradients (allreduce
    site, checks on the result)

Plug-ins may append a few float32 numbers (`Plugin.rider`) that are summed with the bucket.
Three ways to reduce: in the campaigns' trainer, gradients reduced in a fixed layout of the
harness's own, whatever DDP's buckets are at the time (below), with a fixed rider slot appended,
whether or not a check rides, so detectors and recovery never change the trajectory; in a
user's loop under the guard, DDP's own bucket reduced as DDP or the user's comm hook would
(harness/runtime/user_comm.py).

Why a fixed layout: gloo and NCCL round a sum in an order that depends on the buffer's length
and on each element's position in it. A fresh DDP puts every parameter in one bucket and
rebuilds to a 1 MiB bucket plus 25 MiB buckets, in the order gradients became ready, after its
first step; a run that starts mid-way (fast-forward, recovery, resume) would reduce its first
step in another layout than the run it must match bit for bit. So the trainer's DDP keeps one
bucket per dtype for its whole life (`harness_ddp`) and the hook reduces it in `fixed_layout`'s
chunks: parameters in reverse definition order (roughly the order backward produces them), a
first chunk up to 1 MiB, then up to 25 MiB, never splitting a parameter. A chunk is what a
plug-in sees as a bucket, and `fault.bucket` indexes chunks.

When a chunk is reduced: as soon as backward has made its gradients, as DDP's own buckets are,
so that the reduction overlaps the rest of backward. Each parameter of the layout has a
post-accumulate-grad hook; when a chunk's last gradient is accumulated and every earlier chunk
has been launched, the hook copies the chunk into its payload (allocated once, with its rider
slot) and launches its allreduce. Chunks launch strictly in chunk order, so every rank issues
the same collectives in the same order, whatever order its backward makes gradients in. DDP
keeps its one bucket per dtype and calls this hook when every gradient of it is ready: the end
of backward, where any chunk not yet launched is, and where the plug-ins see the results in
chunk order once every chunk's has arrived, before DDP copies them into the gradients. Why not
DDP with a layout it never rebuilds: DDP rebuilds its buckets in gradient-ready order after the
first step whatever its caps say; why not hooks alone, without DDP's bucket: DDP also
broadcasts the initial weights and, every forward, the buffers, and its `no_sync` and its
refusal of a parameter that gets no gradient stay as users know them. Only the backward of a
forward that DDP synchronises reduces (a forward hook on DDP arms the step's reduction, as DDP
prepares its own), so accumulation under `no_sync` reduces once, on the last micro-batch. A
chunk's local view is the head of the payload, so the collective overwrites it, as it always
did for a 16-bit chunk: a check that re-reads its local bucket after the reduction (nan_inf
naming the element of an alarm) reads the sum there. The price of the layout itself:
overhead.csv's `hook` row measures the hook against plain DDP.

DDP checks the hook's parameter names and its `dist.GradBucket` annotation, so this module must
not use postponed annotations.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.core import inflight
from harness.core.bus import PluginBus
from harness.core.plugins import Bucket
from harness.runtime import user_comm
from harness.runtime.user_comm import future_value

FIRST_CHUNK_BYTES = 1 << 20
CHUNK_BYTES = 25 << 20
# DDP's bucket cap in MiB: above any model's size, so DDP never splits a dtype's gradients.
_ONE_BUCKET_MB = 1 << 30


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
    """DDP with one bucket per dtype for its whole life, reduced by the harness's hook, each
    fixed chunk launched during backward as soon as its gradients are ready."""
    ddp = DDP(model, bucket_cap_mb=_ONE_BUCKET_MB)
    ddp.register_comm_hook(state, comm_hook)
    state.launch_early(ddp)
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
        self.chunk_of = {name: i for i, names in enumerate(self.layout) for name in names}
        # The reduction of the backward under way, in the fixed layout; None between them.
        self.reduction: _Reduction | None = None

    def launch_early(self, ddp: DDP) -> None:
        """Launch each chunk during backward, once its gradients are accumulated, on the
        backward of a forward that `ddp` synchronises (its condition for preparing its own
        reduction: grad enabled, outside `no_sync`)."""

        def arm(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
                self.reduction = _Reduction(self)

        ddp.register_forward_hook(arm)
        for name, index in self.chunk_of.items():
            self.params[name].register_post_accumulate_grad_hook(
                lambda _param, index=index: self._accumulated(index)
            )

    def _accumulated(self, index: int) -> None:
        reduction = self.reduction
        if reduction is None:
            return
        reduction.waiting[index] -= 1
        if reduction.waiting[index] == 0:
            reduction.launch()

    def pack(self, riders: list[tuple[int, torch.Tensor]], slot: torch.Tensor) -> list:
        """The riders written into `slot` (zeroed first), and where each lies in it."""
        slot.zero_()
        spans, at = [], 0
        for owner, payload in riders:
            n = payload.numel()
            if at + n > self.slots:
                raise RuntimeError(f"riders need more than {self.slots} slots")
            slot[at : at + n] = payload.reshape(-1)
            spans.append((owner, at, n))
            at += n
        return spans


def comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Local plug-ins, the collective, then the plug-ins on the averaged result."""
    if state.transparent or state.inner is not None:
        return user_comm.reduced(state, bucket)
    return _fixed_layout(state, bucket)


class HookSlot:
    """What the guard registers DDP's comm hook with: DDP takes one hook for its life, and a
    module may be guarded again once its guard has closed (the HF Trainer reuses its DDP
    wrapper for a second `train()`), the new guard's state put in the slot."""

    state: HookState
    open = True  # false once the guard that holds it has closed


def slotted_hook(slot: HookSlot, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """`comm_hook` with the slot's state."""
    return comm_hook(slot.state, bucket)


def _fixed_layout(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP's bucket is ready: backward has made all of its gradients. Every chunk of it not yet
    launched is launched now; the last of DDP's buckets waits for every chunk's result and
    hands them to the plug-ins in chunk order (the others' futures complete with it)."""
    reduction = state.reduction or _Reduction(state)
    state.reduction = reduction
    views = {
        state.names[id(p)]: g for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True)
    }
    mine = [i for i, names in enumerate(state.layout) if names[0] in views]
    assert sum(len(state.layout[i]) for i in mine) == len(views), "a DDP bucket split a dtype"
    reduction.into |= views
    for index in mine:
        reduction.waiting[index] = 0
    reduction.launch()
    if not bucket.is_last():
        later: torch.futures.Future = torch.futures.Future()
        reduction.others.append((later, bucket.buffer()))
        return later
    state.reduction = None
    return reduction.finish(bucket.buffer())


class _Reduction:
    """One backward's reduction in the fixed layout: how many gradients each chunk still waits
    for, the chunks launched (in chunk order), and DDP's bucket views the results go into."""

    def __init__(self, state: HookState):
        self.state = state
        self.step = state.step
        self.waiting = [len(names) for names in state.layout]
        self.launched: list[_Launched] = []
        self.into: dict[str, torch.Tensor] = {}
        self.others: list[tuple[torch.futures.Future, torch.Tensor]] = []
        if state.kept and state.kept[0].step != self.step:
            state.kept = []

    def launch(self) -> None:
        """Launch every chunk whose gradients are all ready, in chunk order from the first not
        launched: one that still waits holds back every later one."""
        layout = self.state.layout
        while len(self.launched) < len(layout) and self.waiting[len(self.launched)] <= 0:
            self.launched.append(_launch(self.state, self.step, len(self.launched)))

    def finish(self, buffer: torch.Tensor) -> torch.futures.Future:
        everything = [f for chunk in self.launched for f in chunk.futures]

        def reduced(_: torch.futures.Future) -> torch.Tensor:
            try:
                for chunk in self.launched:
                    chunk.deliver(self.state, self.step, self.into)
            except BaseException as error:
                for later, _ in self.others:
                    later.set_exception(error)
                raise
            for later, other in self.others:
                later.set_result(other)
            return buffer

        return torch.futures.collect_all(everything).then(reduced)


@dataclass
class _Launched:
    """A chunk whose collective is under way, and what its result needs to reach the plug-ins."""

    view: Bucket
    names: tuple[str, ...]
    sizes: list[int]
    spans: list[tuple[int, int, int]]
    shared: bool
    slot: torch.Tensor
    futures: list[torch.futures.Future]

    def deliver(self, state: HookState, step: int, into: dict[str, torch.Tensor]) -> None:
        result = future_value(self.futures[0])
        n = sum(self.sizes)
        # The rider region: in the chunk's own result, in a collective of its own, or unsent.
        alone = future_value(self.futures[1]) if len(self.futures) > 1 else self.slot
        summed = result[n:] if self.shared else alone
        _deliver(state, step, self.view, self.names, self.sizes, self.spans, result, summed, into)


def _launch(state: HookState, step: int, index: int) -> _Launched:
    """Chunk `index` from its parameters' accumulated gradients: the local plug-ins, then its
    collective. The payload is allocated once, the rider slot after the gradients in a float32
    chunk, so the chunk is copied once into what is sent."""
    names = state.layout[index]
    grads = [state.params[name].grad for name in names]
    sizes = [g.numel() for g in grads]
    n = sum(sizes)
    shared = grads[0].dtype == torch.float32
    payload = grads[0].new_empty(n + state.slots if shared else n)
    torch.cat([g.reshape(-1) for g in grads], out=payload[:n])
    like = dict(zip(names, grads, strict=True))
    view = Bucket(
        index=index,
        buffer=payload[:n],
        tensors=_named_views(payload[:n], names, sizes, like),
        is_last=index == len(state.layout) - 1,
    )
    state.bus.local_grad(step, view)
    view.buffer.div_(state.world_size)
    slot = payload[n:] if shared else payload.new_empty(state.slots, dtype=torch.float32)
    spans = state.pack(state.bus.riders(step, view), slot)
    if state.keep_contributions:
        state.kept.append(
            KeptChunk(step, view, list(names), sizes, spans, shared, payload.clone(), slot.clone())
        )
    state.bus.contribution(step, index, [payload] if shared or not spans else [payload, slot])
    futures = [dist.all_reduce(payload, async_op=True).get_future()]
    inflight.hold(payload)
    if spans and not shared:
        # A payload that cannot share the chunk's own collective pays for one.
        futures.append(dist.all_reduce(slot, async_op=True).get_future())
        inflight.hold(slot)
    return _Launched(view, names, sizes, spans, shared, slot, futures)


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
        inflight.hold(*parts)
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
    inflight.hold(*parts)
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


def _named_views(
    flat: torch.Tensor, names: tuple[str, ...], sizes: list[int], like: dict[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    views, at = [], 0
    for name, n in zip(names, sizes, strict=True):
        views.append((name, flat[at : at + n].view_as(like[name])))
        at += n
    return views
