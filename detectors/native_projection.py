"""`allreduce_sketch`'s projection and norm of a bucket in one read, by a small C kernel
(detectors/projection.c) where eager torch needs two passes and a float32 copy of a 16-bit
bucket (docs/performance.md, "Fused checks").

Entry contract: a contiguous CPU bucket of float32 or bfloat16 and the sketch's weights (u, v, z:
float32, as `allreduce_sketch.step_weights` draws them for its layout); `project` returns the
projection and the sum of squares as two float64 host numbers, or None where the kernel does not
apply (another dtype or device) or cannot be built, and the caller runs the eager path, the
reference: the two agree within the float32 projection's rounding
(tests/unit/test_native_projection.py).

The kernel is built once per source, compiler and CPU, and loaded once per process
(detectors/native_build.py); where it cannot be built (no compiler), the first failure says so
once in the process's log and every later call runs eagerly. A bucket it does not apply to is
said once per dtype, device and layout.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from detectors import native_build

SOURCE = Path(__file__).with_name("projection.c")
WHO = "allreduce_sketch: native projection"
DTYPES = {torch.float32: "project_float32", torch.bfloat16: "project_bfloat16"}


def applies(bucket: torch.Tensor) -> bool:
    """Whether `project` computes this bucket's figures (not None)."""
    return _kernel(bucket) is not None


def _kernel(bucket: torch.Tensor) -> Callable[..., None] | None:
    kernels = load()
    if kernels is None:  # not built: said by the build
        return None
    placed = bucket.device.type == "cpu" and bucket.is_contiguous()
    kernel = kernels.get(bucket.dtype) if placed else None
    if kernel is None:
        layout = "" if bucket.is_contiguous() else "non-contiguous "
        native_build.say_once(
            (WHO, bucket.dtype, bucket.device.type, layout),
            "%s does not apply to a %s%s bucket on %s; the eager path runs instead, with the "
            "same verdicts", WHO, layout, bucket.dtype, bucket.device.type,
        )  # fmt: skip
    return kernel


def project(bucket: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> tuple[float, float] | None:
    """(projection, sum of squares) of `bucket` (module docstring), float64 on the host (the
    kernel ran there: nothing waits to read them), or None: eager instead."""
    kernel = _kernel(bucket)
    if kernel is None:
        return None
    u, v, z = weights
    if u.numel() * v.numel() + z.numel() != bucket.numel():  # the kernel reads what they cover
        raise ValueError(f"weights for {u.numel()} x {v.numel()} + {z.numel()} elements, "
                         f"not the bucket's {bucket.numel()}")  # fmt: skip
    out = (ctypes.c_double * 2)()
    kernel(bucket.data_ptr(), bucket.numel(), u.numel(), v.numel(),
           u.data_ptr(), v.data_ptr(), z.data_ptr(), ctypes.addressof(out))  # fmt: skip
    return out[0], out[1]


@functools.cache
def load() -> dict[torch.dtype, Callable[..., None]] | None:
    """The kernel of this process by the dtype it reads, built on first use (module
    docstring); None if it cannot be built."""
    return _bound(native_build.library(SOURCE, WHO))


def load_from(compiler: str, cache: Path) -> dict[torch.dtype, Callable[..., None]] | None:
    """The kernel built by `compiler` into (or found in) `cache`, by the dtype it reads; None,
    said in the log, if it cannot be built."""
    return _bound(native_build.library_from(SOURCE, WHO, compiler, cache))


def _bound(library: ctypes.CDLL | None) -> dict[torch.dtype, Callable[..., None]] | None:
    if library is None:
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    kernels = {}
    for dtype, name in DTYPES.items():
        kernel = getattr(library, name)
        kernel.argtypes = [pointer, size, size, size, pointer, pointer, pointer, pointer]
        kernel.restype = None
        kernels[dtype] = kernel
    return kernels
