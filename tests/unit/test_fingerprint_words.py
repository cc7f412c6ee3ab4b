"""detectors/fingerprint.py: the same bits give the same words, any changed bit different ones;
checked on the CPU's XXH3 path (`bits_fingerprint`) and on the linear mixing (`mixed_words`,
the GPU's path, which runs on the CPU too)."""

from __future__ import annotations

import pytest
import torch
import xxhash

from detectors import fingerprint
from detectors.fingerprint import MAX_FOLD, bits_fingerprint, fingerprint_words, mixed_words, signs
from detectors.titan_replay import xor_digest
from injectors import bits

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def sample(dtype: torch.dtype, n: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def mixed(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(mixed_words(t).tolist())


FINGERPRINTS = {"xxh3": bits_fingerprint, "mixed": mixed}


@pytest.fixture(params=list(FINGERPRINTS))
def words(request):
    return FINGERPRINTS[request.param]


def test_cpu_fingerprint_is_xxh3_128_of_the_bytes_as_two_signed_words():
    t = sample(torch.float32)
    digest = xxhash.xxh3_128_intdigest(t.numpy().tobytes())
    low, high = digest & (2**64 - 1), digest >> 64
    signed = [w - 2**64 if w >= 2**63 else w for w in (low, high)]
    assert bits_fingerprint(t) == tuple(signed)


def test_fingerprint_words_is_the_same_two_words_as_an_int64_tensor():
    t = sample(torch.bfloat16)
    got = fingerprint_words(t)
    assert got.dtype == torch.int64 and got.shape == (2,)
    assert tuple(got.tolist()) == bits_fingerprint(t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_bits_give_the_same_words(words, dtype):
    t = sample(dtype)
    assert words(t) == words(t.clone()) == words(t.clone().reshape(8, 8))


def test_the_words_are_two_64_bit_integers(words):
    got = words(sample(torch.float32))
    assert len(got) == 2 and all(-(2**63) <= w < 2**63 for w in got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_view_at_an_odd_offset_fingerprints_as_its_copy(words, dtype):
    """Words depend on the bits alone, not where they are stored (a 16-bit slice starting
    mid-word is copied into zero-padded words)."""
    t = sample(dtype, 67)
    view = t[3:]
    assert view.storage_offset() == 3
    assert words(view) == words(view.clone())


def test_a_non_contiguous_tensor_fingerprints_as_its_contiguous_copy(words):
    t = sample(torch.float32, 64).reshape(8, 8).t()
    assert not t.is_contiguous()
    assert words(t) == words(t.contiguous())


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_single_bit_flip_changes_the_words(words, dtype):
    t = sample(dtype, 9)  # 16-bit: the last element sits in a zero-padded word
    clean = words(t)
    for index in (0, 4, 8):
        for bit in range(bits.width(dtype)):
            flipped = t.clone()
            bits.flip(flipped, index, bit)
            assert words(flipped) != clean, (index, bit)


def test_negative_zero_is_not_zero(words):
    """Exact on bit patterns, not on values: -0.0 == 0.0 but their sign bits differ."""
    assert words(torch.zeros(4)) != words(torch.tensor([0.0, -0.0, 0.0, 0.0]))


def test_the_words_depend_on_the_dtypes_bytes_not_only_the_values(words):
    # 1.0 is exact in both, but its bytes differ, so do the words.
    assert words(torch.ones(8, dtype=torch.float16)) != words(torch.ones(8, dtype=torch.bfloat16))


def test_swapping_two_elements_changes_the_words_where_an_xor_fold_cannot_see_it(words):
    """titan_replay's XOR digest is order-insensitive (its docstring's blind spot); the
    fingerprint is order-aware: swapping elements 0 and 2 changes the low halves of words 0 and
    1, which the linear mixing's xor-shift maps to changes with at most 34 factors of two."""
    t = torch.tensor([1.5, 7.0, -3.25, 7.0, 0.5, 0.5, 0.5, 0.5])
    swapped = t[[2, 1, 0, 3, 4, 5, 6, 7]]
    assert xor_digest(swapped) == xor_digest(t)
    assert words(swapped) != words(t)


def test_the_same_bit_flipped_both_ways_in_two_words_changes_the_words(words):
    """Bit 0 set in element 0 (word 0: +1) and cleared in element 2 (word 1: -1): a plain sum
    of the words cancels, and so does titan_replay's XOR fold; the fingerprint does not."""
    t = torch.tensor([1.0, 2.0, 1.0 + 2**-23, 3.0, 4.0, 5.0, 6.0, 7.0])
    changed = t.clone()
    bits.flip(changed, 0, 0)
    bits.flip(changed, 2, 0)
    as_words = [v.view(torch.int64).sum().item() for v in (t, changed)]
    assert as_words[0] == as_words[1] and xor_digest(changed) == xor_digest(t)
    assert words(changed) != words(t)


def test_the_linear_mixings_xor_shift_is_logical_and_bijective():
    """w ^ (w >>> 29) with a logical shift: torch's `>>` on int64 copies the sign in, and
    w ^ (w >> 29) would clear the top bit of every word and map both 0 and -1 to 0."""
    mask = (1 << 64) - 1
    unsigned = [0, 1, 1 << 63, mask, (1 << 63) - 1, 0x0123456789ABCDEF, 0xFEDCBA9876543210]
    signed = torch.tensor([w - (1 << 64) if w >> 63 else w for w in unsigned])
    got = [w & mask for w in fingerprint._xorshift(signed).tolist()]
    assert got == [w ^ (w >> 29) for w in unsigned]
    assert signed.tolist() == [w - (1 << 64) if w >> 63 else w for w in unsigned]  # untouched
    # Its inverse, y ^ (y >>> 29) ^ (y >>> 58), gives every word back.
    assert [y ^ (y >> 29) ^ (y >> 58) for y in got] == unsigned


def test_mixed_words_fold_a_tensor_above_max_fold_words():
    """More than MAX_FOLD 64-bit words are mixed down a level first: still one change, seen."""
    t = sample(torch.float64, MAX_FOLD * 3 + 17, seed=1)
    clean = mixed(t)
    for index in (0, MAX_FOLD, t.numel() - 1):
        for bit in (0, 40, 63):
            flipped = t.clone()
            bits.flip(flipped, index, bit)
            assert mixed(flipped) != clean


def test_xxh3_sees_a_change_in_a_large_tensor():
    t = sample(torch.float32, 1 << 16)
    flipped = t.clone()
    bits.flip(flipped, (1 << 16) - 1, 5)
    assert bits_fingerprint(flipped) != bits_fingerprint(t)


def test_different_tensors_rarely_collide(words):
    seen = {words(sample(torch.float32, 32, seed=s)) for s in range(200)}
    assert len(seen) == 200


# signs: a fixed +1/-1 vector per name


def test_signs_are_plus_or_minus_one_float32_of_the_asked_length():
    s = signs("layer.weight", 1000)
    assert s.dtype == torch.float32 and s.shape == (1000,)
    assert set(s.unique().tolist()) == {-1.0, 1.0}


def test_signs_are_balanced():
    total = float(signs("balanced", 40_000).sum())
    assert abs(total) < 5 * 200  # five standard deviations of a +1/-1 walk (sqrt(40000))


def test_signs_are_fixed_by_the_name():
    a = signs("fixed.name", 257).clone()
    fingerprint._SIGNS.clear()  # recomputed from the name alone, not remembered
    assert torch.equal(signs("fixed.name", 257), a)


def test_different_names_get_different_signs():
    assert not torch.equal(signs("encoder.weight", 256), signs("decoder.weight", 256))
