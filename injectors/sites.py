"""Where a fault can land: the tensors each site reaches on a model (`targets`, `matching`), and
the autograd and torch-function pieces through which an injector changes a forward output, a
loss, or a matrix multiply's output or gradient (harness's step, docs/design.md section 3)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from harness.core.plugins import matches

if TYPE_CHECKING:
    from harness.config.schema import FaultConfig

MOMENTS = ("exp_avg", "exp_avg_sq")
RIDERS = "riders"
# The matrix multiplies a matmul fault can strike, with the position of their second operand.
MATMULS = {
    F.linear: 1, torch.matmul: 1, torch.Tensor.matmul: 1, torch.Tensor.__matmul__: 1,
    torch.mm: 1, torch.bmm: 1, torch.addmm: 2, torch.baddbmm: 2,
}  # fmt: skip


def number(x: float) -> float | str:
    """JSON has no NaN or infinity: non-finite values are written as strings."""
    return x if math.isfinite(x) else str(x)


def targets(site: str, model: nn.Module) -> list[tuple[str, int | None]]:
    """The named tensors a site can reach on `model`, with their sizes where known up front."""
    params = list(model.named_parameters())
    if site == "optimizer":
        return [(f"{n}.{k}", p.numel()) for n, p in params for k in MOMENTS]
    if site == "activation":
        return [(n, None) for n, _ in model.named_modules() if n]
    if site == "matmul":
        return [
            (n, None)
            for n, m in model.named_modules()
            if n and any(isinstance(x, nn.Linear) for x in m.modules())
        ]
    if site == "loss":
        return [("loss", 1)]
    return [(n, p.numel()) for n, p in params]


def matching(fault: FaultConfig, model: nn.Module) -> list[tuple[str, int | None]]:
    if fault.site == "allreduce" and fault.tensor == RIDERS:
        return [(RIDERS, None)]
    return [(n, size) for n, size in targets(fault.site, model) if matches(n, fault.tensor)]


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
        grad = grad.clone()
        ctx.corrupt(grad)
        return grad, None


class FirstMatmul(TorchFunctionMode):
    """Active during one module's forward: the first matrix multiply in it is corrupted, its
    output (`output`) or, through its second operand, the gradient backward computes for it."""

    def __init__(self, output, gradient):
        super().__init__()
        self.output, self.gradient, self.done = output, gradient, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.done or func not in MATMULS:
            return func(*args, **kwargs)
        self.done = True
        if self.gradient is not None:
            args = list(args)
            at = MATMULS[func]
            args[at] = CorruptGrad.apply(args[at], self.gradient)
            return func(*args, **kwargs)
        return self.output(func(*args, **kwargs))
