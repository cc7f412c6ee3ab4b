"""The emulated tensor-core product (`topology.cpu_numerics=emulated`, chosen and recorded by
harness/runtime/numerics.py): each 16-bit matrix product computed through the float32 kernels
and rounded once, out = round16(float32(a) @ float32(b)).

Contract of `EmulatedProducts`, a TorchFunctionMode a rank enters once:
- Covered functions (`PRODUCTS`: F.linear, torch.matmul and `@`, mm, bmm, addmm, baddbmm,
  F.scaled_dot_product_attention) whose floating-point tensor arguments are all one 16-bit
  dtype run in float32 and return the float32 result rounded to that dtype.
- Under `torch.autocast("cpu", dtype=bfloat16|float16)` the mode sees these functions with
  autocast's float32 operands (autocast casts below the torch-function layer), so it casts them
  to autocast's dtype itself, as autocast would, and computes as above with autocast off for the
  float32 call: the product's inputs and output are what autocast gives, its arithmetic the
  GPU's.
- Backward needs no code of its own: autograd differentiates the casts around the float32
  call, so a 16-bit output gradient is widened exactly, the input and weight gradients are
  float32 products of 16-bit values, and each is rounded to 16 bits by its cast's backward:
  again the tensor-core product, for both gradients. The backward runs outside the mode.
- Everything else passes through unchanged: float32 (and mixed-dtype) products, every other
  function, and every function outside autocast's reach. A float32 workload computes the same
  bits with the mode on or off.
- Attention runs on the math backend, in float32 (the math backend widens 16-bit operands), and
  rounds only its output (a flash-attention kernel also rounds the probabilities to 16 bits
  before its second product; that rounding is not modelled).

`widened` is the same computation's first half, for the products' watch
(harness/core/matmuls.py): it computes a watched 16-bit product itself, so that checks see the
float32 product before its rounding (detectors/matmul_checksum.py), and gives the same bits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
# The functions emulated; each is on CPU autocast's lower-precision list, so under autocast
# each would otherwise run the slow 16-bit kernel.
PRODUCTS = frozenset(
    {
        F.linear,
        torch.matmul,
        torch.Tensor.matmul,  # `a @ b` reaches the mode as Tensor.matmul
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.addmm,
        torch.Tensor.addmm,
        torch.baddbmm,
        torch.Tensor.baddbmm,
        F.scaled_dot_product_attention,
    }
)


class EmulatedProducts(TorchFunctionMode):
    """16-bit products through float32 kernels, rounded once (module docstring)."""

    def __enter__(self):
        global _emulating
        _emulating += 1
        return super().__enter__()

    def __exit__(self, *exc):
        global _emulating
        _emulating -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        wide = _widened(func, args, kwargs)
        if wide is None:
            return func(*args, **kwargs)
        wide_args, wide_kwargs, low = wide
        with torch.autocast("cpu", enabled=False):
            return func(*wide_args, **wide_kwargs).to(low)


# Open EmulatedProducts modes: the products' watch computes a 16-bit product the same way itself
# (`widened`), to hand checks the float32 product before its rounding.
_emulating = 0


def widened(func, args: tuple | list, kwargs: dict) -> tuple[tuple, dict, torch.dtype] | None:
    """While emulated numerics are installed, a 16-bit product's float32 arguments and its
    16-bit dtype: `func(*args, **kwargs)` with autocast off, rounded to that dtype, is the bits
    the emulation gives. None for a call the emulation passes through, or without it."""
    return _widened(func, tuple(args), kwargs) if _emulating else None


def _widened(func, args: tuple, kwargs: dict) -> tuple[tuple, dict, torch.dtype] | None:
    if func not in PRODUCTS or "out" in kwargs:
        return None
    autocast = _autocast_dtype()
    if autocast is not None:  # what autocast would hand the kernel: its dtype's operands
        args, kwargs = _cast(args, kwargs, lambda t: t.to(autocast))
    dtypes = {a.dtype for a in (*args, *kwargs.values()) if _floating(a)}
    if len(dtypes) != 1 or not dtypes <= set(SIXTEEN_BIT):
        return None
    (low,) = dtypes
    wide_args, wide_kwargs = _cast(args, kwargs, lambda t: t.float())
    return wide_args, wide_kwargs, low


def _autocast_dtype() -> torch.dtype | None:
    """CPU autocast's dtype while it is on and 16-bit, else None."""
    if not torch.is_autocast_enabled("cpu"):
        return None
    dtype = torch.get_autocast_dtype("cpu")
    return dtype if dtype in SIXTEEN_BIT else None


def _floating(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _cast(args: tuple, kwargs: dict, cast) -> tuple[tuple, dict]:
    """The arguments with every floating-point tensor but float64 converted by `cast`: autocast
    leaves float64 alone, and a float64 operand then keeps the product native."""

    def one(value: object) -> object:
        return cast(value) if _floating(value) and value.dtype != torch.float64 else value

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}
