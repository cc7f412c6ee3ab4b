"""Compact, cheap summaries of tensors that detectors compare across ranks.

`bits_fingerprint` is exact on bit patterns: integer sums of the tensor's bit patterns (mod 2^32)
over up to 65,536 contiguous chunks, folded into two words with position weights. Any single
changed element changes it; swapping two elements changes it unless both sit in the same chunk
(tensors up to 65,536 elements have one element per chunk, so every swap shows). It is one read
pass at about the speed of `torch.sum` on the CPU, and runs on the tensor's own device.

`signs` gives a fixed Rademacher (+1/-1) vector per tensor name: a projection onto it is linear,
continuous (small rounding differences stay small) and moved by any single-element change.
"""

from __future__ import annotations

import zlib

import torch

CHUNKS = 65536
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def bits_fingerprint(tensor: torch.Tensor) -> tuple[int, int]:
    v = tensor.detach().reshape(-1).view(_INT_VIEW[tensor.element_size()])
    acc = torch.int64 if v.dtype == torch.int64 else torch.int32
    n = v.numel()
    chunks = max(1, min(n, CHUNKS))
    body = n - n % chunks
    sums = v[:body].view(chunks, -1).sum(1, dtype=acc).to(torch.int64)
    if body < n:
        sums = torch.cat([sums, v[body:].sum(dtype=acc).to(torch.int64).view(1)])
    weights = torch.arange(1, sums.numel() + 1, dtype=torch.int64, device=sums.device)
    return int(sums.sum()), int((sums * weights).sum())


_SIGNS: dict[tuple[str, int], torch.Tensor] = {}


def signs(name: str, numel: int) -> torch.Tensor:
    """A float32 +1/-1 vector fixed by the name alone, the same on every rank and run."""
    key = (name, numel)
    if key not in _SIGNS:
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        _SIGNS[key] = torch.randint(0, 2, (numel,), generator=gen).float().mul_(2).sub_(1)
    return _SIGNS[key]
