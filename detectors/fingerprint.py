"""Compact, cheap summaries of tensors that detectors compare across ranks.

`bits_fingerprint` is exact on bit patterns and order-aware: two 64-bit words that depend on
every bit of the tensor and on where each bit is, never on the order of a summation, so
replicas with identical weights agree on any machine and thread count.

On the CPU it is XXH3-128 (the `xxhash` package) of the tensor's bytes: one read pass, 1.0-1.26x
the time of `torch.sum` over the same bytes on this machine's CPU, depending on its load
(benchmarks/kernels.py; docs/design.md section 6 asks for 1.25x). XXH3 adds each 8-byte word
into a 64-bit accumulator, and the product of its two 32-bit halves, XORed with a secret that
depends on its position, into another; between blocks of 1 KiB the accumulators are scrambled
by bijections, and the final 512-bit state is folded into 128 bits. It is not linear, so no
structured change cancels by construction: any change (a single flip in any dtype, a swap at
any distance, opposite flips of one bit, a burst) goes unseen with probability about 2^-128,
the rate of a random function, which SMHasher's tests of XXH3 support (sparse keys, single-bit
changes, permutations, cyclic keys). That is a probability, not a proof: there is no blind
window, but no guarantee either. The tests check every pattern above and measure the
collision rate (tests/test_fingerprint.py).

On a GPU (where a copy to the host would cost more than the check, and where no XXH3 kernel
exists) `mixed_words` runs instead, elementwise; the CPU can run it too. A CPU rank and a GPU
rank therefore fingerprint the same tensor differently: a world's ranks must compute on one
kind of device. The spawned world places every rank on one kind; a torchrun world whose hosts
resolve different kinds is refused before its first trial (harness/launch/torchrun_world.py).

`mixed_words` is a linear mixing with proofs instead of probabilities. The bytes are read as
64-bit integers ("words"; 16- and 32-bit elements share a word) in rows of ROW words, and each
row is mixed into one word by a dot product with fixed, position-dependent weights, wrapping
modulo 2^64. The row words are mixed again, ROW at a time, until at most MAX_FOLD remain; those
are folded into two words by two rows of random odd weights. What it catches, and why (the
tests check each; ROW = 32 words):
- any single changed element, in any dtype: every weight is odd, so a nonzero change of a word
  stays nonzero after the multiplication modulo 2^64, at every level;
- two elements swapped, or the same bit flipped in opposite directions in two elements, in
  one row: the change is d * (w_i - w_j) for two distinct weights. The row weights are odd with
  distinct residues modulo 64, so w_i - w_j has at most 5 factors of two, and the change
  vanishes only when d has 59 or more: when it is confined to the top 5 bits of a 64-bit word,
  the sign and top exponent bits of the odd-indexed float32 elements (every fourth bfloat16).
  No map that is linear modulo 2^64 can do better there: 2^63 times any odd weight is 2^63.
  At any greater distance the two effective weights are products of random odd words, and the
  change vanishes with probability about 2^-(63 - k) for a change d with k factors of two: for
  the top bit alone (k = 63) always, so flipping the sign of any two float64 elements, or of
  any two odd-indexed float32 elements (every fourth bfloat16), however far apart, leaves both
  words as they were on this path (the CPU's XXH3 sees it). A bijective non-linear step on each
  word before the mixing (a xor-shift) would move that bit down; not yet made.
- bursts: the same bit flipped in k words of a row changes its word by 2^p times a sum of k
  odd weights, p the bit's position in its 64-bit word. For odd k that sum is odd and the
  change never vanishes; for even k it vanishes with probability about 2^-(63 - p): 1 in 128
  for an exponent bit of float64 (p = 56; hypothesis found 8 adjacent float64 elements with
  bit 56 flipped that collide), 2^-23 below bit 40. Other random multi-element changes collide
  with probability about 2^-64; the tests measure it.
Its cost on the CPU is one `torch.mv` of the int64 view: 1.85-2.2x a read pass, since torch has
no vectorised integer matrix-vector product (`mm` and multiply-then-sum are slower still).

`signs` gives a fixed Rademacher (+1/-1) vector per tensor name: a projection onto it is linear,
continuous (small rounding differences stay small) and moved by any single-element change.
"""

from __future__ import annotations

import functools
import random
import zlib

import torch
import xxhash

ROW = 32
MAX_FOLD = 4096
_MASK = (1 << 64) - 1


def bits_fingerprint(tensor: torch.Tensor) -> tuple[int, int]:
    """Two words that change when any bit of `tensor` does (see the module docstring)."""
    if tensor.device.type == "cpu":
        return _hashed(tensor)
    plain, weighted = mixed_words(tensor).tolist()
    return plain, weighted


def fingerprint_words(tensor: torch.Tensor) -> torch.Tensor:
    """`bits_fingerprint` as two int64 on the tensor's device, unread."""
    if tensor.device.type == "cpu":
        return torch.tensor(_hashed(tensor), dtype=torch.int64)
    return mixed_words(tensor)


def _hashed(tensor: torch.Tensor) -> tuple[int, int]:
    """XXH3-128 of the tensor's bytes, as two signed 64-bit words."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
    digest = xxhash.xxh3_128_intdigest(data)
    return _signed(digest & _MASK), _signed(digest >> 64)


def _signed(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def mixed_words(tensor: torch.Tensor) -> torch.Tensor:
    """The linear mixing's two words (module docstring), on the tensor's device, unread."""
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
    return torch.tensor([_signed(w) for w in unsigned], dtype=torch.int64, device=device)


@functools.cache
def _fold(count: int, device: torch.device) -> torch.Tensor:
    """Two rows of random odd weights (fixed by `count`), which fold the last words into two.
    Weights linear in the position would cancel a change pattern like +d, -d, -d, +d (a strided
    burst down one column of the rows), as plain sums cancel +d, -d."""
    rng = random.Random(f"bits_fingerprint:{count}")
    unsigned = [rng.getrandbits(64) | 1 for _ in range(2 * count)]
    signed = [_signed(w) for w in unsigned]
    return torch.tensor(signed, dtype=torch.int64, device=device).view(2, count)


_SIGNS: dict[tuple[str, int], torch.Tensor] = {}


def signs(name: str, numel: int) -> torch.Tensor:
    """A float32 +1/-1 vector fixed by the name alone, the same on every rank and run."""
    key = (name, numel)
    if key not in _SIGNS:
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        _SIGNS[key] = torch.randint(0, 2, (numel,), generator=gen).float().mul_(2).sub_(1)
    return _SIGNS[key]
