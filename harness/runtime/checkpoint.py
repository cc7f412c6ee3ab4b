"""Checkpoints in the off-node store: written atomically with a checksum, verified on load.

A replica's checkpoint is one file (`step_N.pt`, rank 0 writes it, `step_N.pt.sha256` beside
it); a sharded run's is a torch.distributed.checkpoint folder (`step_N.dcp`, every rank writes
its shards) whose files' checksums rank 0 lists in it (`SHARDS`) once every rank has written: a
folder whose list is missing or does not match (a save cut short, a file changed) does not
verify."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from pathlib import Path
from typing import Any

import torch

SHARDS = "shards.sha256"


class CorruptCheckpoint(RuntimeError):
    pass


def step_path(folder: Path, step: int) -> Path:
    """Where the checkpoint saved after `step` lives in `folder`: the one naming scheme that the
    trainer, the guard, recovery and fast-forward share."""
    return folder / f"step_{step:06d}.pt"


def saved(folder: Path) -> list[tuple[int, Path]]:
    """The checkpoints in `folder` as (step, path), oldest first; set-aside ones excluded."""
    found = [*folder.glob("step_*.pt"), *folder.glob("step_*.dcp")]
    return sorted((int(p.stem.removeprefix("step_")), p) for p in found)


def place(source: Path, folder: Path) -> None:
    """The checkpoint `source` (with its checksum) in `folder` too, each file by a hard link
    where both share a file system, put in place by rename: a reader never sees half of one."""
    destination = folder / source.name
    if source.is_dir():
        if destination.exists():  # a folder is complete once renamed: this one already is
            return
        tmp = folder / f".{source.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp, copy_function=_link_or_copy)
        try:
            os.replace(tmp, destination)
        except OSError:  # another writer put the same folder in place first
            shutil.rmtree(tmp, ignore_errors=True)
        return
    for path in (source, source.with_name(source.name + ".sha256")):
        tmp = folder / f".{path.name}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        _link_or_copy(path, tmp)
        os.replace(tmp, folder / path.name)


def _link_or_copy(source: Path | str, destination: Path | str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copyfile(source, destination)


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
    # Bytes, not text: a checksum file whose bytes were changed may not decode at all.
    if hashlib.sha256(data).hexdigest().encode() != digest_file.read_bytes().strip():
        raise CorruptCheckpoint(f"{path}: checksum mismatch")
    return data


def save_shards(path: Path, state: dict[str, Any], rank: int) -> Path:
    """Every rank's shards of `state` into the folder `path` with the suffix `.dcp`
    (torch.distributed.checkpoint; every rank calls it together), sealed by rank 0 once the save
    has returned, that is once every rank's shards and the metadata are written; the folder.

    Written into a folder of its own, then put in place by rename: a folder already at `path`
    may hold hard links to another store's files (a golden run's snapshot, `place`), which a
    save into it would truncate and rewrite in that store too."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp  # sharded runs only: 0.7 s of import

    path = path.with_suffix(".dcp")
    tmp = path.with_name(f".{path.name}.tmp")
    together = dist.barrier if dist.is_initialized() else lambda: None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save cut short
    together()  # no rank makes the folder before rank 0 has cleared it
    dcp.save(state, checkpoint_id=tmp)
    if rank == 0:
        seal_shards(tmp)
        replaced = path.with_name(f".{path.name}.replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        if path.exists():
            os.replace(path, replaced)
        os.replace(tmp, path)
        shutil.rmtree(replaced, ignore_errors=True)  # its links: the other store keeps its files
    together()  # in place when any rank returns
    return path


def seal_shards(folder: Path) -> None:
    """Once every rank's part of a sharded checkpoint is written: the checksum of each file."""
    sums = [
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n"
        for p in sorted(folder.iterdir())
        if p.name != SHARDS
    ]
    _fsync_write(folder / SHARDS, "".join(sums).encode())


def verify(path: Path) -> bool:
    """Whether the file, or every file of a sharded checkpoint, matches its checksum."""
    try:
        if path.is_dir():
            return _shards_verify(path)
        _verified_bytes(path)
    except (CorruptCheckpoint, OSError):
        return False
    return True


def _shards_verify(folder: Path) -> bool:
    try:
        lines = (folder / SHARDS).read_text().splitlines()
        listed = dict(line.split("  ", 1)[::-1] for line in lines)
    except ValueError:  # a list changed out of text (UnicodeDecodeError) or out of its lines
        return False
    present = {p.name for p in folder.iterdir()} - {SHARDS}
    return (
        bool(listed)
        and present == set(listed)
        and all(
            hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest
            for name, digest in listed.items()
        )
    )


def load(path: Path, device: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint, after its checksum verifies; tensors only (weights_only=True)."""
    return torch.load(io.BytesIO(_verified_bytes(path)), weights_only=True, map_location=device)
