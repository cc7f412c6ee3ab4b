"""`allreduce_sketch`'s projection and norm of a bucket in one read, by a small C kernel
(detectors/projection.c) where eager torch needs two passes and a float32 copy of a 16-bit
bucket (docs/performance.md, "Fused checks").

Entry contract: a contiguous CPU bucket of float32 or bfloat16 and the sketch's weights (u, v, z:
float32, as `allreduce_sketch.step_weights` draws them for its layout); `project` returns the
projection and the sum of squares as a float64 tensor of two, or None where the kernel does not
apply (another dtype or device) or cannot be built, and the caller runs the eager path, the
reference: the two agree within the float32 projection's rounding
(tests/unit/test_native_projection.py).

The kernel is built once per source, compiler and CPU with the C compiler (`CC`, else `cc`;
`-O3 -march=native -ffp-contract=off`, about 0.2 s) into a cache folder that a world's ranks,
later trials and runs share (`$SDC_BENCH_CACHE/kernels`, beside the golden store, else
`$XDG_CACHE_HOME/sdc-bench/kernels`, else `~/.cache/sdc-bench/kernels`: a build is the
machine's, not a campaign's): each rank writes its build under a name of its own and renames
it into place, so ranks building at once never load a half-written file. Where the build fails
(no compiler), the first failure says so once in the process's log and every later call runs
eagerly.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("projection.c")
# -march=native: the host's widest vectors. -ffp-contract=off: no multiply and add fused into
# one rounding, so the kernel's sums are the same bits on every CPU, whatever its vector width
# (an AVX-512 build and an SSE one agree bit for bit), as the harness's pinned CPU kernels need.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
DTYPES = {torch.float32: "project_float32", torch.bfloat16: "project_bfloat16"}


def project(bucket: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """(projection, sum of squares) of `bucket` (module docstring), or None: eager instead."""
    if bucket.device.type != "cpu" or not bucket.is_contiguous():
        return None
    kernels = load()
    kernel = kernels.get(bucket.dtype) if kernels is not None else None
    if kernel is None:
        return None
    u, v, z = weights
    if u.numel() * v.numel() + z.numel() != bucket.numel():  # the kernel reads what they cover
        raise ValueError(f"weights for {u.numel()} x {v.numel()} + {z.numel()} elements, "
                         f"not the bucket's {bucket.numel()}")  # fmt: skip
    out = torch.empty(2, dtype=torch.float64)
    kernel(bucket.data_ptr(), bucket.numel(), u.numel(), v.numel(),
           u.data_ptr(), v.data_ptr(), z.data_ptr(), out.data_ptr())  # fmt: skip
    return out


@functools.cache
def load() -> dict[torch.dtype, Callable[..., None]] | None:
    """The kernel of this process by the dtype it reads, built on first use (module
    docstring); None if it cannot be built."""
    return load_from(os.environ.get("CC", "cc"), _cache())


def load_from(compiler: str, cache: Path) -> dict[torch.dtype, Callable[..., None]] | None:
    """The kernel built by `compiler` into (or found in) `cache`, by the dtype it reads; None,
    said in the log, if it cannot be built."""
    try:
        library = ctypes.CDLL(str(_build(compiler, cache)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        logger.warning(
            "allreduce_sketch: native projection unavailable (%s); the eager projection runs "
            "instead, with the same verdicts", detail.strip().splitlines()[0] if detail else error,
        )  # fmt: skip
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    kernels = {}
    for dtype, name in DTYPES.items():
        kernel = getattr(library, name)
        kernel.argtypes = [pointer, size, size, size, pointer, pointer, pointer, pointer]
        kernel.restype = None
        kernels[dtype] = kernel
    return kernels


def _cache() -> Path:
    root = os.environ.get("SDC_BENCH_CACHE")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sdc-bench" / "kernels"


def _build(compiler: str, cache: Path) -> Path:
    """The shared library for this source, compiler and CPU, built unless already cached."""
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler '{compiler}'")
    source = SOURCE.read_bytes()
    # -march=native: a build is only good on the CPU it was made for, so a cache shared across
    # hosts (a home folder on a cluster's file system) keys it by the CPU's flags too.
    key = hashlib.sha256(
        b"\0".join([source, compiler.encode(), " ".join(FLAGS).encode(), _cpu().encode()])
    ).hexdigest()[:16]
    target = cache / f"projection-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".projection-{key}.{os.getpid()}.so"
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", str(partial), str(SOURCE)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _cpu() -> str:
    """The machine and its CPU's feature flags (Linux), what -march=native builds for."""
    flags = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    return f"{platform.machine()} {flags}"
