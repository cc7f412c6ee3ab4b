"""Where a fault can land: the tensors each site reaches on a model (`targets`, `matching`), and
the autograd pieces through which an injector changes a forward output, a loss, or a matrix
multiply's output or gradient (harness's step, docs/design.md section 3)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from harness.core.dtensors import is_dtensor, local
from harness.core.matmuls import ForwardModules
from harness.core.plugins import matches

if TYPE_CHECKING:
    from harness.config.schema import FaultConfig

MOMENTS = ("exp_avg", "exp_avg_sq")
# The sites whose targets are modules, one drawn up front: what they strike is a forward value.
MODULE_SITES = ("activation", "matmul")
# The sites where a sharded rank holds only its own chunk of each parameter (dim 0, as FSDP2's
# `fully_shard` splits it: `torch.chunk`, so the last ranks of a short dim 0 hold nothing).
SHARD_HELD = ("allreduce", "weight", "optimizer")
# The sites of what training makes of a gradient: a frozen parameter has none of them.
TRAINED_ONLY = ("grad", "allreduce", "optimizer")
# The sites whose tensors carry over from step to step: a strike finds what the last one left.
STATE_SITES = ("weight", "optimizer")
RIDERS = "riders"


def number(x: float) -> float | str:
    """JSON has no NaN or infinity: non-finite values are written as strings."""
    return x if math.isfinite(x) else str(x)


def targets(
    site: str, model: nn.Module, forward: ForwardModules | None = None
) -> list[tuple[str, int | None]]:
    """The named tensors a site can reach on `model`, with their sizes where known up front.
    `forward` (what one forward runs, harness/core/matmuls.py) narrows the module sites to the
    modules that run and return a floating-point tensor (activation) and those in whose forward
    a matrix multiply runs (matmul); without it (a user's loop, whose forward the harness has
    not seen) every module that could."""
    params = list(model.named_parameters())
    sharded = any(is_dtensor(p) for _, p in params)
    if sharded and site in SHARD_HELD:
        # FSDP's last ranks may hold nothing of a short dim 0: a fault drawn there would never
        # strike, so only the parameters this rank's shard holds part of are reachable.
        params = [(n, p) for n, p in params if local(p).numel()]
    if site in TRAINED_ONLY:
        # A frozen parameter (requires_grad False) gets no gradient, so no reduction and no
        # moments either: a fault named there could never strike, and `*` must not draw one.
        params = [(n, p) for n, p in params if p.requires_grad]
    if site == "optimizer":
        # Sharded: a rank's own shard of the moments, whose size shows when it is at hand.
        return [(f"{n}.{k}", None if sharded else p.numel()) for n, p in params for k in MOMENTS]
    if site == "activation":
        # What a fault can corrupt: a module's floating-point output (a Llama decoder layer or
        # attention returns a tuple).
        ran = None if forward is None else set(forward.outputs)
        return [(n, None) for n, _ in model.named_modules() if n and (ran is None or n in ran)]
    if site == "matmul":
        if forward is not None:
            multiplying = set(forward.multiplying)
            return [(n, None) for n, _ in model.named_modules() if n in multiplying]
        return [
            (n, None)
            for n, m in model.named_modules()
            if n and any(isinstance(x, nn.Linear) for x in m.modules())
        ]
    if site == "loss":
        return [("loss", 1)]
    if site in ("allreduce", "weight") and sharded:
        # Sharded: the reduced shard a rank receives, and the weights it updates, are its own
        # chunk of each parameter, whose size shows when it is at hand.
        return [(n, None) for n, _ in params]
    return [(n, p.numel()) for n, p in params]


def matching(
    fault: FaultConfig, model: nn.Module, forward: ForwardModules | None = None
) -> list[tuple[str, int | None]]:
    if fault.site == "allreduce" and fault.tensor == RIDERS:
        return [(RIDERS, None)]
    reachable = targets(fault.site, model, forward)
    return [(n, size) for n, size in reachable if matches(n, fault.tensor)]


class ReplaceValue(torch.autograd.Function):
    """Forward gives the corrupted value; backward passes the gradient through unchanged, as
    when faulty hardware computed one wrong value and everything downstream used it."""

    @staticmethod
    def forward(ctx, clean: torch.Tensor, corrupted: torch.Tensor) -> torch.Tensor:
        return corrupted.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class CorruptGrad(torch.autograd.Function):
    """Forward passes the operand through; backward hands the gradient computed for it to
    `corrupt`, which changes it in place before it flows on."""

    @staticmethod
    def forward(ctx, operand: torch.Tensor, corrupt) -> torch.Tensor:
        ctx.corrupt = corrupt
        return operand.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Contiguous, so that elements are indexed in the operand's own order (a grouped
        # product's expert weights arrive transposed).
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.corrupt(grad)
        return grad, None
