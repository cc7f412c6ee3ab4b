"""injectors/bits.py and the fault models' corrupt functions, checked against references built
here: struct and numpy bit manipulation, and the IEEE-754 layout derived from torch.finfo."""

from __future__ import annotations

import math
import random
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.config.schema import FaultConfig
from harness.errors import ConfigError
from injectors import bits
from injectors.bitflip import BitFlip, choose_bit
from injectors.burst import Burst
from injectors.crash import Crash, InjectedCrash
from injectors.drop import Drop
from injectors.duplicate import Duplicate
from injectors.scale import Scale
from injectors.stale import Stale
from injectors.stuck import Stuck
from injectors.swap import Swap
from injectors.value import Value

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CLASSES = ("sign", "exponent_msb", "exponent", "mantissa")
# Values exact in all three dtypes (bfloat16 keeps 8 significant bits).
EXACT = [1.0, -2.5, 0.15625, 3.0, -0.0, 96.0]


def mantissa_bits(dtype: torch.dtype) -> int:
    """From the format's epsilon (2^-mantissa bits), not from the code under test's table."""
    return -int(math.log2(torch.finfo(dtype).eps))


def reference_pattern(dtype: torch.dtype, x: float) -> int:
    """The unsigned bit pattern of x in dtype, by struct and numpy."""
    if dtype == torch.float32:
        return struct.unpack("<I", struct.pack("<f", x))[0]
    if dtype == torch.float16:
        return int(np.array([x], dtype=np.float16).view(np.uint16)[0])
    # bfloat16 is the top half of float32 (exact for values bfloat16 holds).
    return struct.unpack("<I", struct.pack("<f", x))[0] >> 16


def reference_value(dtype: torch.dtype, pattern: int) -> float:
    if dtype == torch.float32:
        return struct.unpack("<f", struct.pack("<I", pattern))[0]
    if dtype == torch.float16:
        return float(np.array([pattern], dtype=np.uint16).view(np.float16)[0])
    return struct.unpack("<f", struct.pack("<I", pattern << 16))[0]


def stored_pattern(t: torch.Tensor, index: int = 0) -> int:
    """Read back what a tensor holds through numpy (bfloat16 widened exactly to float32)."""
    if t.dtype == torch.bfloat16:
        return int(t.float().numpy().view(np.uint32)[index]) >> 16
    unsigned = {torch.float32: np.uint32, torch.float16: np.uint16, torch.float64: np.uint64}
    return int(t.numpy().view(unsigned[t.dtype])[index])


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or (
        a == b and math.copysign(1, a) == math.copysign(1, b)
    )


def fault(**fields) -> FaultConfig:
    return FaultConfig(site="grad", **fields)


# The layout of each format


@pytest.mark.parametrize("dtype", DTYPES)
def test_bit_classes_follow_the_ieee_layout(dtype):
    width, m = torch.finfo(dtype).bits, mantissa_bits(dtype)
    assert bits.width(dtype) == width
    assert bits.class_bits(dtype, "sign") == [width - 1]
    assert bits.class_bits(dtype, "exponent_msb") == [width - 2]
    assert bits.class_bits(dtype, "mantissa") == list(range(m))
    assert bits.class_bits(dtype, "exponent") == list(range(m, width - 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_exponent_and_mantissa_partition_the_word(dtype):
    parts = [bits.class_bits(dtype, c) for c in ("sign", "exponent", "mantissa")]
    assert sorted(b for p in parts for b in p) == list(range(bits.width(dtype)))
    assert set(bits.class_bits(dtype, "exponent_msb")) <= set(bits.class_bits(dtype, "exponent"))


# Reading and writing patterns


@pytest.mark.parametrize(
    ("dtype", "x", "hex_text"),
    [
        (torch.float32, 1.0, "0x3f800000"),
        (torch.float32, -1.0, "0xbf800000"),
        (torch.float32, -0.0, "0x80000000"),
        (torch.bfloat16, 1.0, "0x3f80"),
        (torch.bfloat16, -2.0, "0xc000"),
        (torch.float16, 1.0, "0x3c00"),
        (torch.float16, -2.0, "0xc000"),
        (torch.float64, 1.0, "0x3ff0000000000000"),
    ],
)
def test_pattern_and_hex_of_known_values(dtype, x, hex_text):
    """IEEE-754 encodings of 1 and -2; the pattern is unsigned even with the sign bit set."""
    flat = torch.tensor([0.5, x], dtype=dtype)
    assert bits.pattern(flat, 1) == int(hex_text, 16)
    assert bits.to_hex(flat, 1) == hex_text


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x", EXACT)
def test_pattern_matches_struct_and_numpy(dtype, x):
    assert bits.pattern(torch.tensor([x], dtype=dtype), 0) == reference_pattern(dtype, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_pattern_stores_an_unsigned_pattern_with_the_sign_bit_set(dtype):
    flat = torch.zeros(3, dtype=dtype)
    top = 1 << (bits.width(dtype) - 1)
    bits.write_pattern(flat, 1, top | reference_pattern(dtype, 1.5))
    assert flat.tolist() == [0.0, -1.5, 0.0]


# Flipping a bit of each class, against the reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("x", EXACT)
def test_flip_of_each_bit_in_a_class_matches_the_reference(dtype, name, x):
    for bit in bits.class_bits(dtype, name):
        flat = torch.tensor([7.0, x, -7.0], dtype=dtype)
        bits.flip(flat, 1, bit)
        expected = reference_pattern(dtype, x) ^ (1 << bit)
        assert stored_pattern(flat, 1) == expected, (name, bit)
        assert same(flat[1].item(), reference_value(dtype, expected))
        assert flat[0].item() == 7.0 and flat[2].item() == -7.0  # neighbours untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_flipping_the_sign_negates(dtype):
    flat = torch.tensor([1.5, -96.0, 0.0], dtype=dtype)
    for i in range(3):
        bits.flip(flat, i, bits.class_bits(dtype, "sign")[0])
    assert [same(a, b) for a, b in zip(flat.tolist(), [-1.5, 96.0, -0.0], strict=True)] == [
        True
    ] * 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_flipping_mantissa_bit_b_of_one_adds_two_to_the_b_minus_m(dtype):
    m = mantissa_bits(dtype)
    for bit in bits.class_bits(dtype, "mantissa"):
        flat = torch.ones(1, dtype=dtype)
        bits.flip(flat, 0, bit)
        assert flat.item() == 1 + 2.0 ** (bit - m)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flipping_a_lower_exponent_bit_of_one_divides_by_two_to_the_two_to_the_k(dtype):
    """1.0's biased exponent is 0b0111...1: clearing its bit k leaves 2^-(2^k)."""
    m = mantissa_bits(dtype)
    for bit in bits.class_bits(dtype, "exponent")[:-1]:
        flat = torch.ones(1, dtype=dtype)
        bits.flip(flat, 0, bit)
        assert flat.item() == math.ldexp(1.0, -(2 ** (bit - m)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_flipping_the_exponent_msb_of_one_gives_infinity(dtype):
    """Setting the only clear exponent bit of 1.0 makes the exponent all ones, mantissa zero."""
    flat = torch.ones(1, dtype=dtype)
    bits.flip(flat, 0, bits.class_bits(dtype, "exponent_msb")[0])
    assert flat.item() == math.inf


def test_flip_twice_restores_the_value():
    flat = torch.tensor([0.1, -3.7], dtype=torch.float32)
    before = flat.clone()
    for bit in range(32):
        bits.flip(flat, 1, bit)
        bits.flip(flat, 1, bit)
    assert torch.equal(flat.view(torch.int32), before.view(torch.int32))


@settings(max_examples=300, deadline=None)
@given(pattern=st.integers(0, 2**32 - 1), bit=st.integers(0, 31))
def test_float32_flip_matches_struct_on_any_pattern(pattern, bit):
    """Any pattern, NaNs with payloads and subnormals included: no float conversion quiets it."""
    flat = torch.from_numpy(np.array([pattern], dtype=np.uint32).view(np.float32).copy())
    bits.flip(flat, 0, bit)
    raw = bytearray(struct.pack("<I", pattern))
    raw[bit // 8] ^= 1 << (bit % 8)
    assert stored_pattern(flat) == struct.unpack("<I", raw)[0]


@settings(max_examples=300, deadline=None)
@given(pattern=st.integers(0, 2**16 - 1), bit=st.integers(0, 15))
def test_16_bit_flip_matches_numpy_on_any_pattern(pattern, bit):
    signed = pattern - (1 << 16) if pattern >= 1 << 15 else pattern
    for dtype in (torch.float16, torch.bfloat16):
        flat = torch.tensor([signed], dtype=torch.int16).view(dtype)
        bits.flip(flat, 0, bit)
        assert int(flat.view(torch.int16).numpy().view(np.uint16)[0]) == pattern ^ (1 << bit)


# bitflip's choice of bits


def test_choose_bit_takes_a_configured_index():
    assert choose_bit(fault(bit=5), torch.float32, random.Random(0)) == 5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CLASSES)
def test_choose_bit_draws_within_the_class(dtype, name):
    rng = random.Random(1)
    drawn = {choose_bit(fault(bit=name), dtype, rng) for _ in range(400)}
    assert drawn == set(bits.class_bits(dtype, name))


def test_choose_bit_without_a_bit_draws_any_bit_of_the_word():
    rng = random.Random(2)
    assert {choose_bit(fault(), torch.bfloat16, rng) for _ in range(400)} == set(range(16))


def test_choose_bit_is_reproducible_from_the_seed():
    draws = [[choose_bit(fault(), torch.float32, random.Random(9)) for _ in range(3)]
             for _ in range(2)]  # fmt: skip
    assert draws[0] == draws[1]


def test_bitflip_with_a_given_bit_flips_only_it():
    flat = torch.tensor([1.0, 1.0])
    assert BitFlip(fault(bit=3, nbits=4), random.Random(0)).corrupt(flat, 1, bit=30) == [30]
    assert flat.tolist() == [1.0, math.inf]


def test_bitflip_adjacent_bits_run_upward_from_the_chosen_bit():
    flat = torch.tensor([1.0])
    before = stored_pattern(flat)
    chosen = BitFlip(fault(bit=4, nbits=3, adjacent=True), random.Random(0)).corrupt(flat, 0)
    assert chosen == [4, 5, 6]
    assert stored_pattern(flat) == before ^ (0b111 << 4)


def test_bitflip_adjacent_bits_shift_down_to_fit_the_word():
    flat = torch.tensor([1.0], dtype=torch.bfloat16)
    before = stored_pattern(flat)
    chosen = BitFlip(fault(bit=14, nbits=4, adjacent=True), random.Random(0)).corrupt(flat, 0)
    assert chosen == [14, 12, 13, 15]  # the chosen bit first: the one the event records
    assert stored_pattern(flat) == before ^ (0b1111 << 12)


def test_bitflip_random_extra_bits_are_distinct_and_include_the_chosen_one():
    for seed in range(20):
        flat = torch.tensor([0.3])
        before = stored_pattern(flat)
        model = BitFlip(fault(bit=7, nbits=5, adjacent=False), random.Random(seed))
        chosen = model.corrupt(flat, 0)
        assert chosen[0] == 7 and len(set(chosen)) == 5 and chosen[1:] == sorted(chosen[1:])
        assert stored_pattern(flat) == before ^ sum(1 << b for b in chosen)


# stuck


@pytest.mark.parametrize(("stuck_at", "bit", "x", "expected"), [
    (1, 30, 1.0, math.inf),  # exponent msb of 1.0 is 0: set, it becomes inf
    (1, 29, 1.0, 1.0),  # already 1: nothing changes
    (0, 29, 1.0, 2.0**-64),  # cleared: 2^-(2^6)
    (0, 30, 1.0, 1.0),  # already 0
    (1, 31, 2.0, -2.0),
    (0, 31, -2.0, 2.0),
])  # fmt: skip
def test_stuck_sets_or_clears_the_bit(stuck_at, bit, x, expected):
    flat = torch.tensor([x])
    assert Stuck(fault(stuck_at=stuck_at), random.Random(0)).corrupt(flat, 0, bit) == [bit]
    assert flat.item() == expected


@pytest.mark.parametrize("stuck_at", [None, 2, "1"])
def test_stuck_needs_zero_or_one(stuck_at):
    with pytest.raises(ConfigError) as info:
        Stuck.validate("fault", fault(model="stuck", stuck_at=stuck_at))
    assert info.value.key == "fault.stuck_at"


# scale and value


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_multiplies_one_element_by_the_factor(dtype):
    flat = torch.tensor([3.0, -1.5, 0.25], dtype=dtype)
    Scale(fault(factor=-4.0), random.Random(0)).corrupt(flat, 1)
    assert flat.tolist() == [3.0, 6.0, 0.25]


def test_scale_rounds_in_the_tensors_dtype():
    flat = torch.tensor([1.0], dtype=torch.bfloat16)
    Scale(fault(factor=1.001), random.Random(0)).corrupt(flat, 0)
    assert flat.item() == 1.0  # 1.001 is within half a bfloat16 ulp (2^-8) of 1


def test_scale_can_overflow_to_infinity():
    flat = torch.tensor([60000.0], dtype=torch.float16)
    Scale(fault(factor=2.0), random.Random(0)).corrupt(flat, 0)
    assert flat.item() == math.inf


def test_scale_needs_a_factor():
    with pytest.raises(ConfigError) as info:
        Scale.validate("fault", fault(model="scale"))
    assert info.value.key == "fault.factor"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("value", "expected"), [
    ("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("zero", 0.0), ("2.5", 2.5),
])  # fmt: skip
def test_value_sets_the_element(dtype, value, expected):
    flat = torch.tensor([1.0, 1.0], dtype=dtype)
    Value(fault(value=value), random.Random(0)).corrupt(flat, 0)
    assert same(flat[0].item(), expected) and flat[1].item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES + (torch.float64,))
def test_value_max_is_the_largest_finite_of_the_dtype(dtype):
    flat = torch.zeros(1, dtype=dtype)
    Value(fault(value="max"), random.Random(0)).corrupt(flat, 0)
    assert flat.item() == torch.finfo(dtype).max
    # The next pattern up is infinity: nothing finite lies above it.
    bits.write_pattern(flat, 0, bits.pattern(flat, 0) + 1)
    assert flat.item() == math.inf


def test_value_max_pattern_is_the_largest_finite_pattern():
    """float32's largest finite number: exponent 0xFE, mantissa all ones."""
    flat = torch.zeros(1)
    Value(fault(value="max"), random.Random(0)).corrupt(flat, 0)
    assert stored_pattern(flat) == 0x7F7FFFFF


def test_value_random_lies_in_the_tensors_range_and_follows_the_seed():
    flat = torch.tensor([-2.0, 5.0, 0.5, 1.0])
    drawn = []
    for seed in (3, 3, 4):
        t = flat.clone()
        Value(fault(value="random"), random.Random(seed)).corrupt(t, 2)
        drawn.append(t[2].item())
        assert -2.0 <= drawn[-1] <= 5.0
    assert drawn[0] == drawn[1] != drawn[2]


@pytest.mark.parametrize("value", ["banana", "1e400", "infinity", "NaN", None])
def test_value_rejects_what_is_neither_a_finite_number_nor_a_name(value):
    with pytest.raises(ConfigError) as info:
        Value.validate("fault", fault(model="value", value=value))
    assert info.value.key == "fault.value"


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "max", "zero", "random", "-3", "1e-3"])
def test_value_accepts_names_and_finite_numbers(value):
    """Validation passes, and the value it passed is one the model can write."""
    Value.validate("fault", fault(model="value", value=value))
    flat = torch.tensor([1.0, -2.0, 0.5])
    Value(fault(model="value", value=value), random.Random(0)).corrupt(flat, 1)
    assert not same(flat[1].item(), -2.0) and flat[[0, 2]].tolist() == [1.0, 0.5]


# grouped models: swap and burst


def test_swap_exchanges_two_elements_bit_for_bit():
    flat = torch.tensor([1.0, -0.0, 3.0, float("nan")])
    Swap(fault(model="swap"), random.Random(0)).corrupt_many(flat, [(1, None), (3, None)])
    assert flat[0].item() == 1.0 and flat[2].item() == 3.0
    assert math.isnan(flat[1].item()) and same(flat[3].item(), -0.0)


def test_swap_partner_is_any_other_element_never_the_first():
    model = Swap(fault(model="swap"), random.Random(0))
    rng = random.Random(5)
    seconds = set()
    for _ in range(300):
        pair = model.group(5, 2, rng)
        assert len(pair) == 2 and pair == sorted(pair) and 2 in pair
        seconds |= set(pair) - {2}
    assert seconds == {0, 1, 3, 4}


def test_swap_needs_two_elements():
    assert Swap(fault(model="swap"), random.Random(0)).group(1, 0, random.Random(0)) == []


def burst(**fields) -> Burst:
    return Burst(fault(model="burst", burst_model="bitflip", **fields), random.Random(0))


@pytest.mark.parametrize(("size", "elements", "stride", "first", "expected"), [
    (10, 3, 1, 4, [4, 5, 6]),
    (10, 3, 1, 9, [7, 8, 9]),  # shifted back to fit
    (10, 3, 3, 5, [3, 6, 9]),  # span 7: starts at 10 - 7
    (10, 2, 4, 0, [0, 4]),
    (2, 4, 1, 1, [0, 1]),  # a tensor shorter than the burst: cut at its end
    (5, 3, 4, 0, [0, 4]),  # strided past the end: cut
])  # fmt: skip
def test_burst_positions(size, elements, stride, first, expected):
    assert burst(elements=elements, stride=stride).group(size, first, random.Random(0)) == expected


def test_bitflip_burst_flips_the_same_bit_in_every_element():
    flat = torch.tensor([1.0, 2.0, 0.5, -4.0, 8.0])
    before = [stored_pattern(flat, i) for i in range(5)]
    touched = burst(elements=3, bit="mantissa").corrupt_many(
        flat, [(1, None), (2, None), (3, None)]
    )
    (bit,) = touched[0]
    assert touched == [[bit]] * 3 and bit in range(23)
    after = [stored_pattern(flat, i) for i in range(5)]
    assert after == [before[0], *(p ^ (1 << bit) for p in before[1:4]), before[4]]


def test_scale_burst_scales_every_element():
    model = Burst(fault(model="burst", burst_model="scale", factor=2.0, elements=2),
                  random.Random(0))  # fmt: skip
    flat = torch.tensor([1.0, 2.0, 3.0])
    model.corrupt_many(flat, [(0, None), (2, None)])
    assert flat.tolist() == [2.0, 2.0, 6.0]


@pytest.mark.parametrize(("fields", "key"), [
    ({"burst_model": "swap", "elements": 3}, "fault.burst_model"),
    ({"burst_model": "bitflip", "elements": 1}, "fault.elements"),
    ({"burst_model": "scale", "elements": 2}, "fault.factor"),  # the sub-model's own check
])  # fmt: skip
def test_burst_validation(fields, key):
    with pytest.raises(ConfigError) as info:
        Burst.validate("fault", fault(model="burst", **fields))
    assert info.value.key == key


# contribution models: a rank's whole contribution to a reduction


def reduction(**fields) -> FaultConfig:
    return FaultConfig(site="allreduce", scope="reduction", **fields)


def test_drop_sends_zeros():
    parts = [torch.tensor([1.0, -2.0]), torch.tensor([3.0])]
    assert Drop(reduction(model="drop"), random.Random(0)).contribute(parts, None) is parts
    assert [p.tolist() for p in parts] == [[0.0, 0.0], [0.0]]


def test_duplicate_doubles_exactly():
    x = torch.tensor([0.1, -3.3, 1e-40, 3e38])
    parts = [x.clone()]
    Duplicate(reduction(model="duplicate"), random.Random(0)).contribute(parts, None)
    assert torch.equal(parts[0], x * 2)
    assert parts[0][3].item() == math.inf  # doubling the largest values overflows, as a sum would


def test_stale_sends_the_previous_contribution_or_nothing_without_one():
    model = Stale(reduction(model="stale"), random.Random(0))
    parts = [torch.tensor([1.0, 2.0])]
    assert model.contribute(parts, None) is None and parts[0].tolist() == [1.0, 2.0]
    assert model.contribute(parts, [torch.tensor([5.0, 6.0])]) is parts
    assert parts[0].tolist() == [5.0, 6.0]


@pytest.mark.parametrize(("fields", "key"), [
    ({"site": "grad", "scope": "reduction"}, "fault.model"),
    ({"site": "allreduce", "scope": "rank"}, "fault.model"),
    ({"site": "allreduce", "scope": "reduction", "tensor": "w"}, "fault.tensor"),
    ({"site": "allreduce", "scope": "reduction", "index": 0}, "fault.tensor"),
    ({"site": "allreduce", "scope": "reduction", "steps": (0,)}, "fault.steps"),
])  # fmt: skip
def test_stale_validation(fields, key):
    with pytest.raises(ConfigError) as info:
        Stale.validate("fault", FaultConfig(model="stale", **fields))
    assert info.value.key == key


def test_a_raise_crash_raises_its_own_error():
    with pytest.raises(InjectedCrash):
        Crash(fault(model="crash", value="raise"), random.Random(0)).corrupt(torch.ones(1), 0)
