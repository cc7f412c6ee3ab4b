"""Checkpoints in the off-node store: written atomically with a checksum, verified on load."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch


class CorruptCheckpoint(RuntimeError):
    pass


def step_path(folder: Path, step: int) -> Path:
    """Where the checkpoint saved after `step` lives in `folder`: the one naming scheme that the
    trainer, the guard, recovery and fast-forward share."""
    return folder / f"step_{step:06d}.pt"


def saved(folder: Path) -> list[tuple[int, Path]]:
    """The checkpoints in `folder` as (step, path), oldest first; set-aside ones excluded."""
    return sorted((int(p.stem.removeprefix("step_")), p) for p in folder.glob("step_*.pt"))


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(path: Path, state: dict[str, Any]) -> None:
    """Write `state` to `path` and its SHA-256 to `path.sha256`, each by rename, data first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    _fsync_write(path, data)
    _fsync_write(path.with_name(path.name + ".sha256"), hashlib.sha256(data).hexdigest().encode())
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _verified_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    digest_file = path.with_name(path.name + ".sha256")
    if not digest_file.exists():
        raise CorruptCheckpoint(f"{path}: no checksum file")
    if hashlib.sha256(data).hexdigest() != digest_file.read_text().strip():
        raise CorruptCheckpoint(f"{path}: checksum mismatch")
    return data


def verify(path: Path) -> bool:
    """Whether the file matches the checksum written with it."""
    try:
        _verified_bytes(path)
    except (CorruptCheckpoint, OSError):
        return False
    return True


def load(path: Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint, after its checksum verifies; tensors only (weights_only=True)."""
    return torch.load(io.BytesIO(_verified_bytes(path)), weights_only=True, map_location=device)
