"""The guard's reduction of a user's DDP bucket (harness/runtime/comm.py's hook dispatches here
outside the campaigns' trainer), in one of two ways:
- transparent: exactly what DDP's default allreduce does to the bucket, so a user's own loop
  with the guard attached trains bit-identically to the loop without it (riders then pay for a
  small collective of their own);
- wrapped: a comm hook the user already has (say, compression) does the reduction. Riders are
  taken from the local bucket before that hook starts (it may reduce the bucket in place,
  asynchronously), and `LINEAR_HOOKS` tells the sketch what each of torch's own hooks sums.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from harness.core import inflight
from harness.core.plugins import Bucket
from harness.core.stopwatch import HOOK

if TYPE_CHECKING:
    from harness.runtime.comm import HookState

# Torch's comm hooks whose reduction is a plain sum of each rank's bucket divided by the world
# size, and the dtype each sums in (None: the bucket's own): what the sketch can verify.
LINEAR_HOOKS: dict[Callable, torch.dtype | None] = {
    default_hooks.allreduce_hook: None,
    default_hooks.fp16_compress_hook: torch.float16,
    default_hooks.bf16_compress_hook: torch.bfloat16,
}


def future_value(future: torch.futures.Future) -> torch.Tensor:
    """What a collective's future holds: its tensor."""
    value = future.value()
    return value[0] if isinstance(value, list) else value


def reduced(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """The guard's hook: DDP's own bucket, reduced as DDP or the user's hook would; its own
    time, apart from the plug-ins', charged to the hook."""
    with state.bus.charged(HOOK):
        return _reduction(state, bucket)


def _reduction(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future:
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
        # As DDP's default reduction scales: each gradient times 1/W as it is copied into the
        # bucket (reducer.cpp, copy_grad_to_bucket). Dividing by W rounds otherwise unless W is
        # a power of two.
        buffer.mul_(1.0 / state.world_size)
        slot = torch.empty(state.slots, dtype=torch.float32, device=buffer.device)
        spans = state.pack(state.bus.riders(step, view), slot)
        futures = [dist.all_reduce(buffer, async_op=True).get_future()]
    else:
        # Riders first: the wrapped hook may start reducing the bucket in place, asynchronously.
        # It divides by the world size itself, and may compress to another dtype on the way.
        inner_state, inner_hook = state.inner
        view.contribution = 1.0 / state.world_size
        view.wire = LINEAR_HOOKS.get(inner_hook)
        slot = torch.empty(state.slots, dtype=torch.float32, device=buffer.device)
        spans = state.pack(state.bus.riders(step, view), slot)
        futures = [inner_hook(inner_state, bucket)]
    if spans:
        # A payload that cannot share the bucket's own collective pays for one.
        futures.append(dist.all_reduce(slot, async_op=True).get_future())
        inflight.hold(slot)

    def reduced(fut: torch.futures.Future) -> torch.Tensor:
        with state.bus.charged(HOOK):
            done = [future_value(f) for f in fut.value()]
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
