"""How a CPU rank computes 16-bit matrix products: `topology.cpu_numerics=emulated|native`.

torch's CPU kernels here have no native bfloat16 or float16 matrix product (AVX2, no AMX): a
bfloat16 GEMM runs about 45x slower than a float32 one, and `torch.autocast("cpu", bfloat16)`
takes the same path. `emulated` computes each 16-bit product the way a GPU's tensor cores do,
through the float32 kernels instead:

    out = round16(float32(a) @ float32(b))

16-bit operands (bfloat16 and float16 values are exact in float32, and so is the product of two
of them), float32 accumulation, the output rounded once to the operands' dtype. This is the
CPU's model of a GPU's bf16/fp16 GEMM; it differs from a given GPU only in the order of the
float32 additions, which no two GPU kernels agree on either. It is deterministic: the float32
kernels under the rank's pins (harness/runtime/environment.py) give the same bits for the same
inputs.

Contract of `installed("emulated")`, a TorchFunctionMode entered once by the rank:
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

Whatever the numerics, `installed` pins F.scaled_dot_product_attention to the math backend
(`SDPBackend.MATH`), on the CPU and on cuda: a fused kernel never forms the score product Q K^T
or the value product P V, so neither could be struck or checked there; on the math backend the
products' watch computes the call as those two products and changes no bit
(harness/core/attention.py). The cost is the math backend's: its scores in memory, at the
harness's context lengths a few MB.

On cuda the GPU computes its own 16-bit products: `emulated` is refused there, and the unset
key resolves to `emulated` on the CPU and `native` on cuda (`resolve`). The value a world ran
with is recorded in campaign.json's environment and in the report's header.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from harness.errors import ConfigError

NUMERICS = ("emulated", "native")
KEY = "topology.cpu_numerics"
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


def resolve(requested: str | None, device: str | None) -> str | None:
    """The numerics a world on `device` computes with: `requested`, or unset `emulated` on the
    CPU and `native` on cuda (None while the device is unknown: under torchrun each machine
    resolves it). A ConfigError for `emulated` on cuda, which would otherwise be ignored."""
    if requested == "emulated" and device == "cuda":
        raise ConfigError(
            KEY, "'emulated' models a GPU's 16-bit products on the CPU; on cuda use native or "
            "leave it unset"
        )  # fmt: skip
    if requested is not None or device is None:
        return requested
    return "emulated" if device == "cpu" else "native"


@contextmanager
def installed(requested: str | None, device: str) -> Iterator[None]:
    """While open, this rank's 16-bit products on `device` (a torch device string) are computed
    as `requested` resolves there, and attention on the math backend."""
    emulated = resolve(requested, torch.device(device).type) == "emulated"
    with sdpa_kernel(SDPBackend.MATH), EmulatedProducts() if emulated else nullcontext():
        yield


class EmulatedProducts(TorchFunctionMode):
    """16-bit products through float32 kernels, rounded once (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None) -> Any:
        kwargs = kwargs or {}
        if func not in PRODUCTS or "out" in kwargs:
            return func(*args, **kwargs)
        autocast = _autocast_dtype()
        if autocast is not None:  # what autocast would hand the kernel: its dtype's operands
            args, kwargs = _cast(args, kwargs, lambda t: t.to(autocast))
        dtypes = {a.dtype for a in (*args, *kwargs.values()) if _floating(a)}
        if len(dtypes) != 1 or not dtypes <= set(SIXTEEN_BIT):
            return func(*args, **kwargs)
        (low,) = dtypes
        wide_args, wide_kwargs = _cast(args, kwargs, lambda t: t.float())
        with torch.autocast("cpu", enabled=False):
            return func(*wide_args, **wide_kwargs).to(low)


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
