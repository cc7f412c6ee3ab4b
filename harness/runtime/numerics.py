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

`installed("emulated")` enters the mode harness/core/emulation.py defines, once per rank; its
contract is stated there.

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

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.core.emulation import EmulatedProducts
from harness.errors import ConfigError

NUMERICS = ("emulated", "native")
KEY = "topology.cpu_numerics"


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
