"""Where each rank computes: `topology.device=cpu|cuda` (docs/design.md, section 3).

Unset, a gloo world runs on the CPU, on any machine: `sdc-bench` with no overrides is the
simulated world on the CPU (docs/design.md section 4), whose rows a GPU would not reproduce, so
a GPU is used only when asked for (`topology.device=cuda`) or by NCCL, which runs on nothing
else. Rank r of a machine uses `cuda:(local rank % GPUs)`, so several ranks may share one GPU
over gloo (a valid test rig); NCCL refuses that, and the CPU.
"""

from __future__ import annotations

import torch

from harness.errors import ConfigError

DEVICES = ("cpu", "cuda")


def resolve(requested: str | None, backend: str, ranks_here: int, gpus: int) -> str:
    """The device kind a topology runs on, with `ranks_here` ranks on a machine of `gpus` GPUs;
    a ConfigError (naming the key) when the combination cannot work."""
    if requested is not None and requested not in DEVICES:
        raise ConfigError(
            "topology.device", f"'{requested}' is not allowed; allowed: {', '.join(DEVICES)}"
        )
    # Without a GPU, an unset device under NCCL stays the CPU, so that the refusal below names
    # the backend the user set rather than the device they did not.
    device = requested or ("cuda" if backend == "nccl" and gpus else "cpu")
    if device == "cuda" and gpus == 0:
        raise ConfigError("topology.device", "'cuda' needs a GPU and this machine has none")
    if backend == "nccl" and device != "cuda":
        raise ConfigError(
            "topology.backend", "'nccl' needs topology.device=cuda; with device=cpu use gloo"
        )
    if backend == "nccl" and ranks_here > gpus:
        raise ConfigError(
            "topology.backend",
            f"'nccl' needs a GPU per rank: {ranks_here} ranks on this machine, {gpus} GPUs; "
            "gloo lets ranks share a GPU",
        )
    return device


def gpu_count() -> int:
    """GPUs this process can use (0 without CUDA); does not initialise CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(kind: str, local_rank: int, gpus: int) -> torch.device:
    """The device of the machine's `local_rank`-th rank."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", local_rank % gpus)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it times the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
