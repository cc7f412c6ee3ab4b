"""Compact, cheap summaries of tensors that detectors compare across ranks.

`bits_fingerprint` is exact on bit patterns. The tensor's bytes are read as 32-bit integers
(16-bit dtypes two elements to a word; 64-bit dtypes as 64-bit integers) and summed, wrapping,
in up to 4,096 contiguous chunks of at least 4,096 words (a tensor under 8,192 words is one
chunk); the chunk sums are folded exactly into two words: their plain sum and their sum
weighted by position. Integer sums are exact (modulo the word size), so the result depends on
the bits alone, never on the order of summation: replicas with identical weights agree on any
machine, device and thread count. Any single changed element changes the plain sum (by the
nonzero difference of its old and new pattern); swapping two elements changes the weighted sum
unless both sit in the same chunk. One read pass at about the speed of `torch.sum`, on the
tensor's own device.

`signs` gives a fixed Rademacher (+1/-1) vector per tensor name: a projection onto it is linear,
continuous (small rounding differences stay small) and moved by any single-element change.
"""

from __future__ import annotations

import functools
import zlib

import torch

# Chunks of at least this many words: shorter rows make the row-wise sum up to several times
# slower than a flat one when the data is in the cache (measured on this machine's CPU).
MIN_CHUNK = 4096
# At most this many chunk sums to fold: the fold stays a negligible pass for any tensor size.
MAX_CHUNKS = 4096


def bits_fingerprint(tensor: torch.Tensor) -> tuple[int, int]:
    """Two words that change when any bit of `tensor` does (see the module docstring)."""
    words = _words(tensor)
    acc = torch.int64 if words.dtype == torch.int64 else torch.int32
    n = words.numel()
    chunks = min(n // MIN_CHUNK, MAX_CHUNKS)
    if chunks <= 1:  # one chunk: its sum, weighted by 1, is both words (a flat sum is faster)
        whole = int(words.sum(dtype=acc))
        return whole, whole
    width = n // chunks
    # Summing in the words' own width wraps: the sum is exact modulo 2^32 (or 2^64).
    sums = torch.as_strided(words, (chunks, width), (width, 1)).sum(1, dtype=acc)
    if chunks * width < n:  # the last n % chunks words, fewer than `chunks`
        rest = words.reshape(-1)[chunks * width :].sum(0, keepdim=True, dtype=acc)
        sums = torch.cat([sums, rest])
    # In int64 (the product promotes), exactly: folded modulo 2^32, two swapped elements whose
    # patterns differ by a multiple of 2^23 (1.0 and 2.0) would cancel in chunks 512 apart.
    # Elementwise, because integer matrix products are not implemented on GPUs.
    plain, weighted = (sums * _fold(sums.numel(), sums.device)).sum(1).tolist()
    return plain, weighted


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers, contiguous, without a copy where it is already so."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    size = t.element_size()
    if size == 4:
        return t.view(torch.int32)
    if size == 8:
        return t.view(torch.int64)
    flat = t.reshape(-1)
    if (flat.numel() * size) % 4:  # no whole 32-bit words: one element at a time (slower)
        return flat.view({2: torch.int16, 1: torch.int8}[size])
    # 16- and 8-bit elements in 32-bit words: summing them one by one into int32 is several
    # times slower than a read pass. A copy aligns a view that starts mid-word, so that the
    # words, and the fingerprint, depend on the bits alone and not on where they are stored.
    if (flat.storage_offset() * size) % 4:
        flat = flat.clone()
    return flat.view(torch.int32)


@functools.cache
def _fold(chunks: int, device: torch.device) -> torch.Tensor:
    """Rows of ones and of positions 1..chunks, which fold the chunk sums into two words."""
    positions = torch.arange(1, chunks + 1, dtype=torch.int64, device=device)
    return torch.stack([torch.ones_like(positions), positions])


_SIGNS: dict[tuple[str, int], torch.Tensor] = {}


def signs(name: str, numel: int) -> torch.Tensor:
    """A float32 +1/-1 vector fixed by the name alone, the same on every rank and run."""
    key = (name, numel)
    if key not in _SIGNS:
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        _SIGNS[key] = torch.randint(0, 2, (numel,), generator=gen).float().mul_(2).sub_(1)
    return _SIGNS[key]
