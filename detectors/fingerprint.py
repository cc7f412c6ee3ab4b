"""Compact, cheap summaries of tensors that detectors compare across ranks.

`bits_fingerprint` is exact on bit patterns and order-aware. The tensor's bytes are read as
64-bit integers ("words"; 16- and 32-bit elements share a word) in rows of ROW words, and each
row is mixed into one word by a dot product with fixed, position-dependent weights, wrapping
modulo 2^64 (`torch.mv` on the CPU: one read pass of the data, no temporary). The row words are
mixed again, ROW at a time, until at most MAX_FOLD remain; those are folded into two words by
two rows of random odd weights. Integer arithmetic is exact modulo 2^64, so the result
depends on the bits alone, never on the order of summation: replicas with identical weights
agree on any machine, device and thread count.

What it catches, and why (the tests check each; ROW = 32 words):
- any single changed element, in any dtype: every weight is odd, so a nonzero change of a word
  stays nonzero after the multiplication modulo 2^64, at every level;
- two elements swapped, or the same bit flipped in opposite directions in two elements, in
  one row: the change is d * (w_i - w_j) for two distinct weights. The row weights are odd with
  distinct residues modulo 64, so w_i - w_j has at most 5 factors of two, and the change
  vanishes only when d has 59 or more: when it is confined to the top 5 bits of a 64-bit word,
  the sign and top exponent bits of the odd-indexed float32 elements (every fourth bfloat16).
  No map that is linear modulo 2^64 can do better there: 2^63 times any odd weight is 2^63.
  At any greater distance the two effective weights are products of random odd words, and the
  change vanishes with probability about 2^-(63 - k) for a change d with k factors of two.
- bursts and other multi-element changes: a random change collides with probability about
  2^-64 (a change confined to those top bits: far more often); the tests measure it.

Cost: one `torch.mv` of the int64 view, about 1.9x the time of `torch.sum` on this machine's
CPU (the 1.25x target of docs/design.md section 6 is not met; a fused kernel would). On a GPU,
where integer matrix products are not implemented, the rows are mixed elementwise.

`signs` gives a fixed Rademacher (+1/-1) vector per tensor name: a projection onto it is linear,
continuous (small rounding differences stay small) and moved by any single-element change.
"""

from __future__ import annotations

import functools
import random
import zlib

import torch

ROW = 32
MAX_FOLD = 4096


def bits_fingerprint(tensor: torch.Tensor) -> tuple[int, int]:
    """Two words that change when any bit of `tensor` does (see the module docstring)."""
    plain, weighted = fingerprint_words(tensor).tolist()
    return plain, weighted


def fingerprint_words(tensor: torch.Tensor) -> torch.Tensor:
    """`bits_fingerprint` as two int64 on the tensor's device, unread."""
    words = _words(tensor)
    while words.numel() > MAX_FOLD:
        words = _mix(words)
    return (words * _fold(words.numel(), words.device)).sum(1)


def _mix(words: torch.Tensor) -> torch.Tensor:
    """One word per row of ROW words: the row's dot product with the weights, modulo 2^64."""
    weights = _weights(words.device)
    rows = words.numel() // ROW
    body = words[: rows * ROW].view(rows, ROW)
    mixed = torch.mv(body, weights) if words.device.type == "cpu" else (body * weights).sum(1)
    rest = words[rows * ROW :]
    if rest.numel():
        mixed = torch.cat([mixed, (rest * weights[: rest.numel()]).sum(0, keepdim=True)])
    return mixed


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 64-bit integers, without a copy where they already are whole words
    that start on a word boundary; otherwise copied into zero-padded words, so that the words,
    and the fingerprint, depend on the bits alone and not on where they are stored."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    if nbytes % 8 == 0 and (flat.storage_offset() * flat.element_size()) % 8 == 0:
        return flat.view(torch.uint8).view(torch.int64)
    padded = torch.zeros(-(-nbytes // 8) * 8, dtype=torch.uint8, device=flat.device)
    padded[:nbytes] = flat.view(torch.uint8)
    return padded.view(torch.int64)


@functools.cache
def _weights(device: torch.device) -> torch.Tensor:
    """ROW odd weights with distinct residues modulo 64 and random high bits (fixed seed)."""
    rng = random.Random("bits_fingerprint")
    residues = rng.sample(range(1, 64, 2), ROW)
    unsigned = [(rng.getrandbits(58) << 6) | r for r in residues]
    signed = [w - (1 << 64) if w >= 1 << 63 else w for w in unsigned]
    return torch.tensor(signed, dtype=torch.int64, device=device)


@functools.cache
def _fold(count: int, device: torch.device) -> torch.Tensor:
    """Two rows of random odd weights (fixed by `count`), which fold the last words into two.
    Weights linear in the position would cancel a change pattern like +d, -d, -d, +d (a strided
    burst down one column of the rows), as plain sums cancel +d, -d."""
    rng = random.Random(f"bits_fingerprint:{count}")
    unsigned = [rng.getrandbits(64) | 1 for _ in range(2 * count)]
    signed = [w - (1 << 64) if w >= 1 << 63 else w for w in unsigned]
    return torch.tensor(signed, dtype=torch.int64, device=device).view(2, count)


_SIGNS: dict[tuple[str, int], torch.Tensor] = {}


def signs(name: str, numel: int) -> torch.Tensor:
    """A float32 +1/-1 vector fixed by the name alone, the same on every rank and run."""
    key = (name, numel)
    if key not in _SIGNS:
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        _SIGNS[key] = torch.randint(0, 2, (numel,), generator=gen).float().mul_(2).sub_(1)
    return _SIGNS[key]
