"""Convolutions as `matmul_checksum` checks them (a helper of detectors/matmul_checksum.py, not a
check of its own): F.conv1d, conv2d and conv3d, ungrouped, forward only.

A convolution is a product at every output position: the channel vector y[n, :, pos] is the
weight W [Co, Ci, k...] applied to the input patch under that position. Summed over the output
channels, y[n, :, pos] e = (W's filters summed) applied to the same patch (+ the bias's sum):
one convolution with a single summed filter, 1/Co of the product's work. Each output position
is a row of the row checksum in detectors/product_bounds.py, with q = Ci x prod(k) (the patch)
and p = Co, the patch's norm standing for ||L_i|| (a convolution of x squared with a filter of
ones) and ||W||_F for ||R||_F; the same bound, the same `sigmas`.

Not checked: a grouped convolution (`groups` > 1), and backward (its input and weight gradients
are transposed convolutions; they count as unchecked FLOPs in campaign.json's coverage).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from detectors.norms import row_norms
from harness.core.matmuls import MatmulCall

F32 = torch.float32
# Each convolution by the number of its spatial dimensions.
FUNCS: dict[Callable, int] = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
OPTIONS = ("stride", "padding", "dilation", "groups")


def _parts(call: MatmulCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict]:
    """Input, weight, bias and the geometry (stride, padding, dilation, groups), by name."""
    args, kwargs = call.args, call.kwargs
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    options = dict(zip(OPTIONS, args[3:], strict=False))
    options.update({k: v for k, v in kwargs.items() if k in OPTIONS})
    return args[0], args[1], bias, options


def readable(t: object) -> bool:
    """A floating-point tensor the checks read (here and in detectors/product_bounds.py): not
    float64, whose figures would need float64 throughout where the checks' are float32 (its
    products are left out)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64


def checkable(call: MatmulCall) -> bool:
    x, weight, bias, options = _parts(call)
    tensors = [x, weight] + ([] if bias is None else [bias])
    batched = all(readable(t) for t in tensors) and x.dim() == FUNCS[call.func] + 2
    return batched and options.get("groups", 1) == 1 and "out" not in call.kwargs


def forward(call: MatmulCall, output: torch.Tensor, rows: bool) -> dict[str, torch.Tensor | int]:
    """The figures of detectors/product_bounds.py's `bounded_ratio` for every output position, as
    the kernel of dtype `output.dtype` read its operands (an autocast kernel's casts repeated);
    the positions' norms with `rows` (a 16-bit output, whose bound reads them)."""
    x, weight, bias, options = _parts(call)
    x = x.to(output.dtype).to(F32)
    weight = weight.to(output.dtype).to(F32)
    summed = weight.sum(0, keepdim=True)
    expected = call.func(x, summed, None, **options).squeeze(1)
    figures: dict[str, torch.Tensor | int] = {}
    if bias is not None:
        bias = bias.to(output.dtype)
        expected = expected + bias.sum(dtype=F32)
        figures["addend_norm"] = torch.linalg.vector_norm(bias, dtype=F32)
    if rows:
        figures["row_norm"] = row_norms(output, 1)
    patches = call.func(x.square(), torch.ones_like(summed), None, **options).squeeze(1)
    return figures | {
        "actual": output.sum(1, dtype=F32),
        "expected": expected,
        "left_norm": patches.clamp_min_(0).sqrt_(),
        "right_fro": torch.linalg.vector_norm(weight),
        "right_sums_norm": torch.linalg.vector_norm(summed),
        "inner": weight[0].numel(),
        "length": weight.shape[0],
    }


def forward_flops(call: MatmulCall, output: torch.Tensor) -> int:
    """2 x output elements x patch size: the product FLOPs of the convolution's forward."""
    return 2 * output.numel() * math.prod(call.args[1].shape[1:])
