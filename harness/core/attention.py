"""Scaled dot-product attention as its two products, the way ATen's math backend computes it, so
that the products' watch (harness/core/matmuls.py) hands the score product Q K^T and the value
product P V to plug-ins like any other product: a fault can strike either, a check can verify
either, forward and backward.

Contract of `decomposed(args, kwargs, multiply)`: it returns, bit for bit, what
`F.scaled_dot_product_attention(*args, **kwargs)` returns on the math backend
(`SDPBackend.MATH`), forward and backward, in float32 and 16 bits, with and without autocast
(tests/unit/test_attention.py). It performs the math backend's operations in its order: autocast's
cast to its 16-bit dtype; 16-bit operands widened to float32 (unless
`torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp` lets the math backend reduce in 16
bits); Q and K each scaled by sqrt(scale); a boolean or causal mask turned into a float mask of 0
and -inf; grouped-query attention's keys and values repeated; the score product; the mask added
in place (after the product: a fault in a score the mask discards is still in the product a
check sees); the safe softmax; dropout; the value product; the cast back to the operands' dtype.
`multiply(left, right, role)` computes each of the two products, `role` naming it ("attention
scores", then "attention values").

Fused backends (flash, memory-efficient, cuDNN) never form Q K^T, so there is nothing to strike
or check inside them: `runs_math` says whether a call would run on the math backend, where
decomposing it changes no bit. The harness's ranks pin the math backend
(harness/runtime/numerics.py); in a user's job under the guard, a fused call is computed by its
fused kernel unless a fault is due in it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

SIXTEEN_BIT = (torch.float16, torch.bfloat16)
# F.scaled_dot_product_attention's parameters, in order.
PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False,
                            "scale": None, "enable_gqa": False}  # fmt: skip


def arguments(args: tuple | list, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, defaults filled in."""
    named = dict(DEFAULTS)
    named.update(zip(PARAMETERS, args, strict=False))
    named.update(kwargs)
    return named


def runs_math(args: tuple | list, kwargs: dict[str, Any]) -> bool:
    """Whether this call of F.scaled_dot_product_attention runs on the math backend, as the
    dispatcher would choose it now (backend pins included)."""
    a = arguments(args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    if not all(isinstance(t, torch.Tensor) and not t.is_nested for t in (q, k, v)):
        return False
    choice = torch._fused_sdp_choice(
        q, k, v, a["attn_mask"], a["dropout_p"], a["is_causal"], scale=a["scale"],
        enable_gqa=a["enable_gqa"],
    )  # fmt: skip
    return choice == int(SDPBackend.MATH)


def decomposed(
    args: tuple | list,
    kwargs: dict[str, Any],
    multiply: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor],
) -> torch.Tensor:
    """F.scaled_dot_product_attention on the math backend, its two products made by `multiply`
    (module docstring)."""
    a = arguments(args, kwargs)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    device = q.device.type
    if torch.is_autocast_enabled(device):  # autocast casts the call's floating-point tensors
        low = torch.get_autocast_dtype(device)
        q, k, v, mask = (_cast(t, low) for t in (q, k, v, mask))
    with torch.autocast(device, enabled=False):
        return _math(q, k, v, mask, a, multiply)


def _math(q, k, v, mask, a: dict[str, Any], multiply) -> torch.Tensor:
    dtype = q.dtype
    if dtype in SIXTEEN_BIT and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        q, k, v = q.float(), k.float(), v.float()
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(q.size(-1))
    root = math.sqrt(abs(scale))
    q = q * (root if scale >= 0 else -root)
    if a["is_causal"]:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=q.device).masked_fill_(
            mask.logical_not(), float("-inf")
        )
    if a["enable_gqa"]:
        repeat = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)
    scores = multiply(q, k.transpose(-2, -1) * root, "attention scores")
    if mask is not None:
        scores.add_(mask)
    probabilities = torch._safe_softmax(scores, -1)
    if a["dropout_p"] > 0.0:
        probabilities = F.dropout(probabilities, a["dropout_p"], training=True)
    return multiply(probabilities, v, "attention values").to(dtype)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
        return t.to(dtype)
    return t
