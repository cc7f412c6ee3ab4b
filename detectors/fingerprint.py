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

`mixed_words` is a linear mixing with proofs instead of probabilities, after one bijective step.
The bytes are read as 64-bit integers ("words"; 16- and 32-bit elements share a word), and each
word w is first mapped to L(w) = w ^ (w >>> 29), a logical shift. L is a bijection and linear
over XOR: a change that flips the bits d of a word (its XOR difference) flips the bits L(d) of
its mapped word. The mapped words are mixed in rows of ROW words, each row into one word by a
dot product with fixed, position-dependent weights, wrapping modulo 2^64. The row words are
mixed again, ROW at a time, until at most MAX_FOLD remain; those are folded into two words by
two rows of random odd weights. Every weight is odd, so a word's change reaches each of the two
words multiplied by an odd number (a product of weights) and keeps its factors of two: k of
them, k the lowest set bit of L(d) (a - b and a ^ b have the same lowest set bit), at every
level, so the map is needed once, before the first. What it catches, and why (the tests check
each; ROW = 32 words):
- any change in which an odd number of the changed words have the smallest k: it is 2^k times a
  sum of an odd number of odd numbers. So any single changed element, in any dtype; two changed
  words of different k; the same bit of a word flipped in an odd number of words.
- natural faults have a small k: a flip of bit p of a word maps to 2^p ^ 2^(p - 29) (p >= 29)
  or 2^p, so k = p - 29 or p, at most 34 (the sign bit of a float64 or of an odd-indexed
  float32; without the map it was 63). Any change confined to one element of 32 bits or fewer
  has k <= 34 too: k >= 35 needs bits 0-34 of d to equal its bits 29-63, which no change
  within one 32-bit half of a word meets (the tests check it by rank); it takes a float64 or
  two elements of a word, as 2^39 ^ 2^10 does (k = 39).
- two changed words in one row: their mapped words change by 2^k a and 2^k b (a, b odd), and
  the row word by 2^k (a w_i + b w_j), which vanishes only for one ratio a/b modulo 2^(64 - k).
  Opposite changes (b = -a: two float64 elements swapped) vanish only when k >= 59, since the
  row weights are odd with distinct residues modulo 64, so w_i - w_j has at most 5 factors of
  two; equal changes (b = a) only when k >= 53, since w_i + w_j has at most 11 for these
  weights. That window, L(d) confined to bits 59-63 (53-63), is no natural fault: L^-1(2^t) has
  bits t, t - 29 and t - 58 (those >= 0), so d would repeat its top bits 29 and 58 places down,
  for bits 59-63 one pattern in bits 1-5, 30-34 and 59-63. No two single-bit flips in two
  words of a row cancel, whatever their bits and directions (checked exhaustively for these
  weights). Without the map the window held d itself: two float64 elements that differ only in
  their sign and top 4 exponent bits, swapped, could cancel.
- at any greater distance the effective weights are products of random odd words, and changes
  of the same k cancel in each of the two words with probability about 2^-(63 - k): about that
  where they meet in a row before the fold, its square where they meet only in the fold (whose
  two rows of weights are independent). Two sign flips (k = 34): at most about 2^-29; without
  the map always, however far apart (2^63 times any odd weight is 2^63), and so was negating a
  float64 tensor of an even number of elements. Any bijection has a preimage of 2^63, which
  still cancels in any two words: here L^-1(2^63) = 2^63 ^ 2^34 ^ 2^5, bits 63, 34 and 5 of a
  float64, or the sign and bit 2 of an odd-indexed float32 with bit 5 of its neighbour. The
  shift chooses where it lies. 29 is no multiple of 16, so no bit of an element lands on the
  same bit of another (a shift by 32 puts it at 2^63 ^ 2^31, the signs of both float32 elements
  of a word: negating a float32 tensor of an even number of words would go unseen), and a
  single flip keeps k <= max(63 - 29, 28) = 34.
- bursts: the same bit flipped in n words changes each mapped word by 2^k times an odd number.
  For odd n the change never vanishes; for even n it vanishes with probability about
  2^-(63 - k), at most 2^-29 for one bit: 2^-36 for an exponent bit of float64 (p = 56, k = 27;
  without the map 1 in 128, and 8 adjacent float64 elements with bit 56 flipped collided). A
  burst of L^-1(2^56), bits 56 and 27 together, still collides once in 128 positions. Other
  random multi-element changes collide with probability about 2^-64; the tests measure it.
Its cost on the CPU, for 25 MiB of float32 on one thread of this machine, is 6.6-7.0x
`torch.sum` of the same bytes: the map's three elementwise passes over the int64 view (a shift,
a mask and a XOR, into one new tensor; torch has no logical shift of int64) take 4.6-5.0x, and
the mixing, one `torch.mv`, 2.1-2.4x, as before the map; torch has no vectorised integer
matrix-vector product (`mm` and multiply-then-sum are slower still).

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
SHIFT = 29
_MASK = (1 << 64) - 1
_LOW = (1 << (64 - SHIFT)) - 1  # clears the copies of the sign that `>>` shifts in


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
    words = _xorshift(_words(tensor))
    while words.numel() > MAX_FOLD:
        words = _mix(words)
    return (words * _fold(words.numel(), words.device)).sum(1)


def _mix(words: torch.Tensor) -> torch.Tensor:
    """One word per row of ROW words: the row's dot product with the weights, modulo 2^64.
    `words` are the mixing's own (the map's or a level's), multiplied in place on a GPU: the
    fingerprint holds one copy of the tensor at most."""
    weights = _weights(words.device)
    rows = words.numel() // ROW
    body = words[: rows * ROW].view(rows, ROW)
    mixed = torch.mv(body, weights) if words.device.type == "cpu" else body.mul_(weights).sum(1)
    rest = words[rows * ROW :]
    if rest.numel():
        mixed = torch.cat([mixed, (rest * weights[: rest.numel()]).sum(0, keepdim=True)])
    return mixed


def _xorshift(words: torch.Tensor) -> torch.Tensor:
    """Each word w as w ^ (w >>> SHIFT), a logical shift (torch's `>>` on int64 is arithmetic,
    and w ^ (w >> SHIFT) would lose the top bit). Bijective and linear over GF(2); one new
    tensor, in three elementwise passes."""
    mapped = words >> SHIFT
    mapped &= _LOW
    mapped ^= words
    return mapped


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
