"""Where each rank computes: `topology.device=cpu|cuda` (docs/design.md, section 3).

Unset, a run uses cuda when every rank the launcher starts on this machine has a GPU of its own,
else the CPU: the spawned simulation on a machine without a GPU runs as it always has. Rank r of
a machine uses `cuda:(local rank % GPUs)`, so several ranks may share one GPU over gloo (a
valid test rig); NCCL refuses that, and the CPU.
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
    device = requested or ("cuda" if 0 < ranks_here <= gpus else "cpu")
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
