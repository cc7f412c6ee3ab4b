"""What a run computed on, and the pins that make its rows reproduce on other machines.

torch chooses its CPU kernels by instruction set once, when it loads (ATEN_CPU_CAPABILITY), and
MKL, under every float32 matmul here, chooses its code path by CPU vendor and model (MKL_CBWR).
Either choice changes the last bits of a golden run, and with them which trials are "masked".
So every rank gets the same choices in its environment before it imports torch: the spawned
world sets them around each Process.start(), and torchrun's command line carries them.

A record states what ran: each rank reports the settings it computes with, read in the rank
(`RankEnvironment`), a rank whose settings are not the plan's pins is refused before its first
trial (`refusal`), and campaign.json's environment is built from the ranks' reports (`record`).
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.errors import ConfigError
from harness.runtime import numerics

CPU_KERNELS = ("avx2", "avx512", "default", "native")
# torch's own test before it uses a capability (a pin the CPU lacks would crash on SIGILL).
NEEDS = {
    "avx2": ("avx2", "fma3"),
    "avx512": ("avx512_f", "avx512_bw", "avx512_dq", "avx512_vl", "fma3"),
}
ONEDNN_ISA = {"avx2": "AVX2", "avx512": "AVX512_CORE", "default": "SSE41"}
# What a rank's numbers may depend on beyond the pins: recorded as the rank sees it.
RECORDED_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "MKL_CBWR",
    "ONEDNN_MAX_CPU_ISA",
    "OPENBLAS_CORETYPE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
)
UNKNOWN = "unknown"
ROOT = Path(__file__).resolve().parents[2]
# The variables as this process had them when it loaded torch (imported above), which is when
# torch, MKL and oneDNN read theirs: a variable set later changes nothing, so it is not recorded.
AT_LOAD = {name: os.environ[name] for name in RECORDED_VARIABLES if name in os.environ}


def architecture() -> str:
    return str(torch.cpu.get_capabilities().get("architecture", platform.machine()))


def on_x86() -> bool:
    return architecture() in ("x86_64", "x86-64", "amd64", "AMD64")


def check_cpu_kernels(key: str, value: object) -> str:
    """A pin this machine can run: an x86 capability the CPU lacks is refused here, not met by a
    SIGILL in every rank."""
    if value not in CPU_KERNELS:
        raise ConfigError(key, f"'{value}' is not allowed; allowed: {', '.join(CPU_KERNELS)}")
    caps = torch.cpu.get_capabilities()
    if on_x86() and value in NEEDS and not all(caps.get(f, False) for f in NEEDS[value]):
        usable = [k for k in CPU_KERNELS if k not in NEEDS or all(caps.get(f) for f in NEEDS[k])]
        raise ConfigError(key, f"this CPU has no {value}; allowed here: {', '.join(usable)}")
    return str(value)


def pins(cpu_kernels: str) -> dict[str, str]:
    """The variables that pin a rank's kernels here. `native` pins nothing; on a machine that
    is not x86-64, an x86 capability (avx2, avx512) does not apply and pins nothing either,
    while `default` (torch's portable kernels) applies everywhere."""
    if cpu_kernels == "native" or (cpu_kernels in NEEDS and not on_x86()):
        return {}
    found = {"ATEN_CPU_CAPABILITY": cpu_kernels}
    if torch.backends.mkl.is_available():
        # The only MKL branch that gives the same bits on Intel and AMD CPUs alike (SSE2
        # code); AVX2 is Intel's alone, and MKL falls back to its own choice elsewhere.
        found["MKL_CBWR"] = "COMPATIBLE"
    if on_x86() and torch.backends.mkldnn.is_available():
        found["ONEDNN_MAX_CPU_ISA"] = ONEDNN_ISA[cpu_kernels]
    return found


@contextmanager
def pinned(cpu_kernels: str) -> Iterator[None]:
    """This process's environment with the pins set, for starting ranks; restored after."""
    settings = pins(cpu_kernels)
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def commit() -> str:
    """The project's commit, "+dirty" with uncommitted changes to tracked files."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    return head + ("+dirty" if dirty else "") if head else UNKNOWN


def math_library() -> str:
    """BLAS and oneDNN as torch was built with them (torch.__config__.show())."""
    shown = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", shown)
    parts = [f"blas={blas.group(1) if blas else UNKNOWN}"]
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", shown)
    if mkl:
        parts.append(f"MKL {mkl.group(1)}")
    onednn = re.search(r"MKL-DNN v([\w.]+)", shown)
    if onednn:
        parts.append(f"oneDNN {onednn.group(1)}")
    return ", ".join(parts)


@dataclass(frozen=True)
class RankEnvironment:
    """What one rank computes with, read in that rank (`report`)."""

    host: str
    commit: str
    python: str
    torch: str
    cpu: str
    machine: str
    cpu_kernels: str
    cpu_capability: str  # the kernels torch runs here
    math_library: str
    variables: dict[str, str]  # RECORDED_VARIABLES as this rank had them when torch loaded
    threads: int
    device: str  # the device kind: cpu or cuda
    backend: str
    cpu_numerics: str  # how its 16-bit products are computed (harness/runtime/numerics.py)


def report(
    cpu_kernels: str, device: str, backend: str, cpu_numerics: str | None
) -> RankEnvironment:
    """This rank's settings, as it runs: `device` and `backend` those it joined its world with,
    `cpu_numerics` the key as the plan has it (resolved here, for this rank's device)."""
    return RankEnvironment(
        host=platform.node(),
        commit=commit(),
        python=platform.python_version(),
        torch=torch.__version__,
        cpu=str(torch.cpu.get_capabilities().get("cpu_name") or platform.processor()),
        machine=architecture(),
        cpu_kernels=cpu_kernels,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        math_library=math_library(),
        variables=dict(AT_LOAD),
        threads=torch.get_num_threads(),
        device=torch.device(device).type,
        backend=backend,
        cpu_numerics=str(numerics.resolve(cpu_numerics, torch.device(device).type)),
    )


def refusal(cpu_kernels: str, reports: list[RankEnvironment]) -> ConfigError | None:
    """None when every rank runs the pins of `cpu_kernels`; otherwise the error, naming the
    variables the first such rank lacks (or torch's kernels it does not run), and the variables
    to start it with. A rank that got a pin after torch loaded (a torchrun started without the
    printed variables) computes otherwise, and its rows would not reproduce."""
    wanted = pins(cpu_kernels)
    for rank, env in enumerate(reports):
        wrong = [
            f"{name}={env.variables.get(name, '(unset)')}"
            for name, value in wanted.items()
            if env.variables.get(name) != value
        ]
        capability = wanted.get("ATEN_CPU_CAPABILITY", "").upper()
        if capability and env.cpu_capability != capability:
            wrong.append(f"torch's {env.cpu_capability} kernels")
        if wrong:
            start = " ".join(f"{k}={v}" for k, v in wanted.items())
            return ConfigError(
                "topology.cpu_kernels",
                f"'{cpu_kernels}' but rank {rank} on {env.host} runs with {', '.join(wrong)}; "
                f"start every rank with {start}",
            )
    return None


def record(reports: list[RankEnvironment]) -> dict[str, str]:
    """campaign.json's environment: each field as every rank reported it, or, where the ranks
    differ (per-rank threads, hosts of other kinds under cpu_kernels=native), each rank's value
    in rank order, joined by ','."""
    fields = {
        "commit": [e.commit for e in reports],
        "python": [e.python for e in reports],
        "torch": [e.torch for e in reports],
        "cpu": [e.cpu for e in reports],
        "machine": [e.machine for e in reports],
        "cpu_kernels": [e.cpu_kernels for e in reports],
        "cpu_capability": [e.cpu_capability for e in reports],
        "math_library": [e.math_library for e in reports],
        "math_settings": [
            " ".join(f"{k}={v}" for k, v in sorted(e.variables.items())) or "none" for e in reports
        ],
        "threads": [str(e.threads) for e in reports],
        "device": [e.device for e in reports],
        "backend": [e.backend for e in reports],
        "cpu_numerics": [e.cpu_numerics for e in reports],
    }
    return {
        name: values[0] if len(set(values)) == 1 else ",".join(values)
        for name, values in fields.items()
    }
