"""The checks' C kernels (detectors/*.c), built with the system's C compiler and loaded
through ctypes: no torch headers and no new dependency, about 0.2 s a kernel.

Entry contract: `library(source, who)` returns the loaded library of `source`, or None, said
in the log under `who`'s name, where it cannot be built (no compiler); the caller holds it once
per process (so says it once) and runs its eager path instead, the reference.

A build is made once per source, compiler and CPU (`CC`, else `cc`; `-O3 -march=native
-ffp-contract=off`) into a cache folder that a world's ranks, later trials and runs share
(`$SDC_BENCH_CACHE/kernels`, beside the golden store, else `$XDG_CACHE_HOME/sdc-bench/kernels`,
else `~/.cache/sdc-bench/kernels`: a build is the machine's, not a campaign's): each process
writes its build under a name of its own and renames it into place, then its SHA-256 beside it,
so ranks building at once never load a half-written file; a cached build is loaded only where
it matches that digest, and built again where it does not (a damaged copy would kill every
rank that maps it).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

# What a check whose kernels could not be built records in its trial (`Detector.warn`: the
# row's `warnings`), so that the record states what ran, not only the log.
EAGER_INSTEAD = "native kernels not built on this machine: checked eagerly, the same verdicts"

# -march=native: the host's widest vectors. -ffp-contract=off: no multiply and add fused into
# one rounding, so a kernel's sums are the same bits on every CPU, whatever its vector width
# (an AVX-512 build and an SSE one agree bit for bit), as the harness's pinned CPU kernels need.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")


# What this process has said a kernel does not apply to (`say_once`).
said: set[tuple] = set()


def say_once(kind: tuple, message: str, *args: object) -> None:
    """`message % args` in the log the first time this process meets `kind` (a kernel's name
    and what it did not apply to): the eager path runs there instead, with the same verdicts."""
    if kind not in said:
        said.add(kind)
        logger.warning(message, *args)


def library(source: Path, who: str) -> ctypes.CDLL | None:
    """`source`'s kernel, built unless cached (module docstring); None if it cannot be built,
    said as `who`'s."""
    return library_from(source, who, os.environ.get("CC", "cc"), cache_folder())


def library_from(source: Path, who: str, compiler: str, cache: Path) -> ctypes.CDLL | None:
    """`source` built by `compiler` into (or found in) `cache`; None, said in the log, if it
    cannot be built."""
    try:
        return ctypes.CDLL(str(build(source, compiler, cache)))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        logger.warning(
            "%s unavailable (%s); the eager path runs instead, with the same verdicts",
            who, detail.strip().splitlines()[0] if detail else error,
        )  # fmt: skip
        return None


def cache_folder() -> Path:
    root = os.environ.get("SDC_BENCH_CACHE")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "sdc-bench" / "kernels"


def build(source: Path, compiler: str, cache: Path) -> Path:
    """The shared library for this source, compiler and CPU, built unless already cached."""
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler '{compiler}'")
    text = source.read_bytes()
    # -march=native: a build is only good on the CPU it was made for, so a cache shared across
    # hosts (a home folder on a cluster's file system) keys it by the CPU's flags too.
    key = hashlib.sha256(
        b"\0".join([text, compiler.encode(), " ".join(FLAGS).encode(), _cpu().encode()])
    ).hexdigest()[:16]
    target = cache / f"{source.stem}-{key}.so"
    digest = target.with_name(f"{target.name}.sha256")
    if target.exists() and digest.exists():
        if _digest(target) == digest.read_text().strip():
            return target
        logger.warning("%s does not match its digest (a damaged copy): built again", target)
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".{source.stem}-{key}.{os.getpid()}.so"
    written = cache / f".{digest.name}.{os.getpid()}"
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", str(partial), str(source)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        # The library, then its digest, each by rename: a digest in place vouches for a whole
        # library, and a build that is not whole is never mapped (its ranks died of SIGBUS).
        written.write_text(_digest(partial))
        os.replace(partial, target)
        os.replace(written, digest)
    finally:
        partial.unlink(missing_ok=True)
        written.unlink(missing_ok=True)
    return target


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
