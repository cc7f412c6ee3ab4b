"""Property tests of the order-aware weight fingerprint (detectors/fingerprint.py): XXH3-128 of
the bytes, as the CPU computes it, and the linear mixing that a GPU computes, run here on the
CPU (the same integer arithmetic either way)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from detectors.fingerprint import bits_fingerprint, mixed_words

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Longer than MAX_FOLD words, with a remainder, so that every level of mixing is exercised.
SIZES = st.sampled_from([7, 300, 40_003, 150_001])
# The same examples on every run: a property that holds only with high probability (the linear
# mixing's bursts) must not fail CI at random.
FAST = settings(max_examples=30, deadline=None, derandomize=True)
FINGERPRINTS = {"xxh3": bits_fingerprint, "mixed": lambda t: tuple(mixed_words(t).tolist())}
METHODS = pytest.mark.parametrize("method", list(FINGERPRINTS))


def _tensor(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=gen) * 3).to(dtype)


def _flip(x: torch.Tensor, index: int, bit: int) -> None:
    as_int = INT[x.element_size()]
    x.view(as_int)[index] ^= torch.tensor(1).bitwise_left_shift(bit).to(as_int)


def _word_bit(x: torch.Tensor, index: int, bit: int) -> int:
    """The position of an element's bit in the 64-bit word the linear mixing reads it in."""
    size = x.element_size()
    return 8 * size * (index % (8 // size)) + bit


def _in_top_window(method: str, x: torch.Tensor, index: int, bit: int) -> bool:
    """The linear mixing's documented blind window: bits 59-63 of a 64-bit word."""
    return method == "mixed" and _word_bit(x, index, bit) >= 59


@METHODS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@FAST
@given(numel=SIZES, data=st.data())
def test_every_single_flip_changes_it_in_every_dtype(method, dtype, numel, data):
    x = _tensor(numel, dtype, numel)
    index = data.draw(st.integers(0, numel - 1))
    bit = data.draw(st.integers(0, 8 * x.element_size() - 1))
    flipped = x.clone()
    _flip(flipped, index, bit)
    assert FINGERPRINTS[method](flipped) != FINGERPRINTS[method](x)


@METHODS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@FAST
@given(numel=SIZES, data=st.data())
def test_a_swap_at_any_distance_changes_it(method, dtype, numel, data):
    x = _tensor(numel, dtype, numel + 1)
    i = data.draw(st.integers(0, numel - 1))
    j = data.draw(st.integers(0, numel - 1).filter(lambda k: k != i))
    assume(not torch.equal(x[i], x[j]))
    swapped = x.clone()
    swapped[i], swapped[j] = x[j], x[i]
    assert FINGERPRINTS[method](swapped) != FINGERPRINTS[method](x)


@METHODS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@FAST
@given(numel=SIZES, data=st.data())
def test_opposite_flips_of_one_bit_change_it(method, dtype, numel, data):
    """Bit b set in one element and cleared in another: the sum of the words is unchanged."""
    x = _tensor(numel, dtype, numel + 2)
    width = 8 * x.element_size()
    bit = data.draw(st.integers(0, width - 1))
    i = data.draw(st.integers(0, numel - 1))
    j = data.draw(st.integers(0, numel - 1).filter(lambda k: k != i))
    assume(not (_in_top_window(method, x, i, bit) and _in_top_window(method, x, j, bit)))
    as_int = INT[x.element_size()]
    mask = torch.tensor(1).bitwise_left_shift(bit).to(as_int)
    before = x.clone()
    before.view(as_int)[i] &= ~mask  # i has the bit clear, j has it set ...
    before.view(as_int)[j] |= mask
    after = before.clone()
    _flip(after, i, bit)  # ... then i gains it and j loses it
    _flip(after, j, bit)
    assert FINGERPRINTS[method](after) != FINGERPRINTS[method](before)


@METHODS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@FAST
@given(numel=SIZES, data=st.data())
def test_bursts_adjacent_or_strided_change_it(method, dtype, numel, data):
    x = _tensor(numel, dtype, numel + 3)
    length = data.draw(st.integers(2, 16))
    stride = data.draw(st.sampled_from([1, 2, 16, 32, 64, 4096]))
    start = data.draw(st.integers(0, numel - 1))
    bit = data.draw(st.integers(0, 8 * x.element_size() - 1))
    hit = range(start, min(numel, start + length * stride), stride)
    assume(not all(_in_top_window(method, x, k, bit) for k in hit))
    # The linear mixing misses an even burst of high bits with probability 2^-(63 - p)
    # (detectors/fingerprint.py): it is held to bursts it must catch but for 2^-23 at most.
    if method == "mixed" and len(hit) % 2 == 0:
        assume(min(_word_bit(x, k, bit) for k in hit) < 40)
    burst = x.clone()
    for k in hit:
        _flip(burst, k, bit)
    assert FINGERPRINTS[method](burst) != FINGERPRINTS[method](x)


def test_the_linear_mixings_documented_blind_window_is_real_and_xxh3_has_none():
    """Two opposite sign-bit flips in odd-indexed float32 elements (bit 63 of their words) cancel
    in the linear mixing: 2^63 times an odd weight is 2^63. The tests above exclude exactly this
    window for it, and nothing for XXH3, which sees this change."""
    x = _tensor(64, torch.float32, 5).abs()
    flipped = x.clone()
    flipped[1], flipped[3] = -x[1], -x[3]
    assert FINGERPRINTS["mixed"](flipped) == FINGERPRINTS["mixed"](x)
    assert FINGERPRINTS["xxh3"](flipped) != FINGERPRINTS["xxh3"](x)


@METHODS
def test_random_changes_collide_as_rarely_as_stated(method):
    """Stated: a random change collides with probability about 2^-128 (XXH3-128) or 2^-64 (the
    linear mixing). Measured: none in 20,000 random multi-element changes; and the top 12 bits
    of the first word, taken alone, collide at the rate 2^-12 of a uniform hash (about 4.9
    expected), so the words are well mixed. (Top bits: in the linear mixing a multiplication
    carries upward, so they depend on every bit of a change.)"""
    fingerprint = FINGERPRINTS[method]
    rng = random.Random(0)
    x = _tensor(10_000, torch.float32, 7)
    base = fingerprint(x)
    words = x.view(torch.int32)
    full = top = 0
    for _ in range(20_000):
        changed = words.clone()
        for index in rng.sample(range(x.numel()), rng.randint(1, 8)):
            changed[index] = rng.getrandbits(32) - (1 << 31)
        got = fingerprint(changed.view(torch.float32))
        full += got == base
        top += got[0] >> 52 == base[0] >> 52
    assert full == 0
    assert 0 <= top <= 15, top


@METHODS
def test_the_same_bits_give_the_same_fingerprint_wherever_they_are_stored(method):
    fingerprint = FINGERPRINTS[method]
    for dtype in DTYPES:
        x = _tensor(40_003, dtype, 9)
        shifted = torch.empty(x.numel() + 1, dtype=dtype)[1:]
        shifted.copy_(x)
        assert fingerprint(x) == fingerprint(shifted) == fingerprint(x.view(1, -1))
        strided = torch.stack([x, -x], 1)[:, 0]  # every other element of a larger tensor
        assert fingerprint(strided) == fingerprint(x)


def test_the_even_burst_the_linear_mixing_misses_changes_the_cpu_fingerprint():
    """Found by the burst property: 8 adjacent float64 elements with bit 56 flipped cancel in
    the linear mixing (a sum of 8 odd weights, times 2^56, is 0 modulo 2^64 once in 128)."""
    x = _tensor(150001, torch.float64, 150004)
    burst = x.clone()
    for k in range(2985, 2993):
        _flip(burst, k, 56)
    assert torch.equal(mixed_words(burst), mixed_words(x))  # the documented weakness
    assert bits_fingerprint(burst) != bits_fingerprint(x)  # the CPU's check is not blind to it


# The top bit of a word alone (a float64's sign; an odd-indexed float32's) cancels in the linear
# mixing in any two words however far apart: 2^63 times any odd weight is 2^63.
BLIND_TOP_BIT = pytest.mark.xfail(
    strict=True, reason="the linear mixing's top-bit blind spot, reproduced; not yet fixed"
)


@BLIND_TOP_BIT
@pytest.mark.parametrize(
    ("dtype", "numel", "indices"),
    [(torch.float64, 100_000, (5, 99_999)), (torch.float32, 200_000, (5, 199_999))],
    ids=["float64", "float32-odd"],
)
def test_two_sign_flips_far_apart_change_the_linear_mixing(dtype, numel, indices):
    x = _tensor(numel, dtype, 11)
    flipped = x.clone()
    for index in indices:
        flipped[index] = -x[index]
    assert bits_fingerprint(flipped) != bits_fingerprint(x)
    assert FINGERPRINTS["mixed"](flipped) != FINGERPRINTS["mixed"](x)


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.float64, marks=BLIND_TOP_BIT), torch.float32],
    ids=["float64", "float32"],
)
def test_negating_a_whole_tensor_changes_the_linear_mixing(dtype):
    """An even number of words (100,000 float64; 200,000 float32). float64: every word changes
    by 2^63. float32: every word by +-2^31 +- 2^63, seen; a xor-shift by 32 would map that to 2^63
    alone, and the test guards against it."""
    x = _tensor(200_000 if dtype == torch.float32 else 100_000, dtype, 12)
    assert FINGERPRINTS["mixed"](-x) != FINGERPRINTS["mixed"](x)


@BLIND_TOP_BIT
def test_the_old_even_burst_is_seen():
    """8 adjacent float64 elements with bit 56 flipped cancelled (a sum of 8 odd weights, times
    2^56, is 0 modulo 2^64 once in 128 positions)."""
    x = _tensor(150001, torch.float64, 150004)
    burst = x.clone()
    for k in range(2985, 2993):
        _flip(burst, k, 56)
    assert not torch.equal(mixed_words(burst), mixed_words(x))
