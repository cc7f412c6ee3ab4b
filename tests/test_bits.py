"""Bit flips checked against an independent reference: struct and numpy bit manipulation."""

from __future__ import annotations

import math
import random
import struct

import numpy as np
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from harness.config.schema import FaultConfig
from injectors import bits
from injectors.bitflip import BitFlip
from injectors.scale import Scale
from injectors.stuck import Stuck
from injectors.value import Value


def _reference_f32(pattern: int, bit: int) -> int:
    """Flip the bit in the little-endian bytes: no float conversion, which would quiet a
    signalling NaN."""
    raw = bytearray(struct.pack("<I", pattern))
    raw[bit // 8] ^= 1 << (bit % 8)
    return struct.unpack("<I", raw)[0]


def _same_float(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


# Zeros, subnormals, the smallest normal, infinities, and NaNs with payloads and both signs.
SPECIAL_F32 = [
    0x00000000,
    0x80000000,
    0x00000001,
    0x007FFFFF,
    0x00800000,
    0x7F800000,
    0xFF800000,
    0x7FC00000,
    0x7F800001,
    0xFFC00123,
    0x7F7FFFFF,
]
SPECIAL_16 = [
    0x0000,
    0x8000,
    0x0001,
    0x03FF,
    0x007F,
    0x7C00,
    0x7F80,
    0xFC00,
    0x7E01,
    0xFFC1,
    0x7BFF,
    0x7F7F,
]


def _specials(values, bits_in_word):
    def decorate(test):
        for value in values:
            test = example(value, 0)(test)
            test = example(value, bits_in_word - 1)(test)
            test = example(value, bits_in_word - 2)(test)
        return test

    return decorate


@_specials(SPECIAL_F32, 32)
@given(st.integers(0, 2**32 - 1), st.integers(0, 31))
def test_float32_flip_matches_struct(pattern, bit):
    t = torch.tensor([pattern - 2**32 if pattern >= 2**31 else pattern], dtype=torch.int32)
    flat = t.view(torch.float32)
    bits.flip(flat, 0, bit)
    assert bits.pattern(flat, 0) == _reference_f32(pattern, bit)
    assert bits.to_hex(flat, 0) == f"0x{_reference_f32(pattern, bit):08x}"
    expected = struct.unpack("<f", struct.pack("<I", _reference_f32(pattern, bit)))[0]
    assert _same_float(float(flat[0]), expected)


@_specials(SPECIAL_16, 16)
@given(st.integers(0, 2**16 - 1), st.integers(0, 15))
def test_float16_flip_matches_numpy(pattern, bit):
    flat = torch.tensor([pattern], dtype=torch.int32).to(torch.int16).view(torch.float16)
    ref = np.array([pattern], dtype=np.uint16) ^ np.uint16(1 << bit)
    bits.flip(flat, 0, bit)
    assert bits.pattern(flat, 0) == int(ref[0])
    assert _same_float(float(flat[0]), float(ref.view(np.float16)[0]))


@_specials(SPECIAL_16, 16)
@given(st.integers(0, 2**16 - 1), st.integers(0, 15))
def test_bfloat16_flip_is_the_top_half_of_float32(pattern, bit):
    # bfloat16 is the upper 16 bits of a float32: flipping bit b of it flips bit b + 16 there.
    flat = torch.tensor([pattern], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bits.flip(flat, 0, bit)
    expected = _reference_f32(pattern << 16, bit + 16)
    assert bits.pattern(flat, 0) == expected >> 16
    as_f32 = struct.unpack("<f", struct.pack("<I", expected))[0]
    assert _same_float(float(flat[0]), as_f32)


def test_bitflip_model_flips_in_the_tensors_own_dtype():
    for dtype, bit, expected in ((torch.float32, 30, 0x7F800000), (torch.bfloat16, 14, 0x7F80)):
        flat = torch.tensor([0.0, 1.0], dtype=dtype)
        model = BitFlip(FaultConfig(site="grad", model="bitflip", bit=bit), random.Random(0))
        assert model.corrupt(flat, 1) == [bit]
        # 1.0 has exponent 0b0111...1; setting its exponent MSB makes every exponent bit one.
        assert bits.pattern(flat, 1) == expected and torch.isinf(flat[1])


def test_scale_reproduces_the_classic_example():
    flat = torch.tensor([0.40])
    Scale(FaultConfig(site="grad", model="scale", factor=10.0), random.Random(0)).corrupt(flat, 0)
    assert torch.isclose(flat[0], torch.tensor(4.0))


def test_value_sets_names_and_numbers():
    for name, check in (
        ("nan", torch.isnan),
        ("-inf", lambda x: torch.isneginf(x)),
        ("max", lambda x: x == torch.finfo(torch.bfloat16).max),
        ("zero", lambda x: x == 0),
        ("2.5", lambda x: x == 2.5),
    ):
        flat = torch.ones(3, dtype=torch.bfloat16)
        Value(FaultConfig(site="grad", model="value", value=name), random.Random(0)).corrupt(
            flat, 2
        )
        assert check(flat[2]) and flat[0] == 1


def test_multi_bit_flips_adjacent_and_random():
    adjacent = FaultConfig(site="grad", model="bitflip", bit=30, nbits=3, adjacent=True)
    flat = torch.zeros(1)
    # Shifted down so all three fit below bit 32; the chosen bit first, as the event's `bit`
    # and the row's (its class is the fault's: 30 is the exponent's top bit, 29 is not).
    assert BitFlip(adjacent, random.Random(0)).corrupt(flat, 0) == [30, 29, 31]
    assert bits.pattern(flat, 0) == 0b111 << 29
    scattered = FaultConfig(site="grad", model="bitflip", bit=5, nbits=4, adjacent=False)
    flat = torch.zeros(1)
    touched = BitFlip(scattered, random.Random(0)).corrupt(flat, 0)
    assert touched[0] == 5 and touched[1:] == sorted(touched[1:]) and len(set(touched)) == 4
    assert bits.pattern(flat, 0) == sum(1 << b for b in touched)


def test_bit_classes_draw_within_the_class():
    for klass, allowed in (("exponent", range(23, 31)), ("mantissa", range(23))):
        fault = FaultConfig(site="grad", model="bitflip", bit=klass)
        rng = random.Random(1)
        drawn = {BitFlip(fault, rng).corrupt(torch.ones(1), 0)[0] for _ in range(200)}
        assert drawn <= set(allowed) and len(drawn) > len(allowed) // 2


def test_stuck_bit_changes_only_when_the_bit_differs():
    flat = torch.tensor([1.0], dtype=torch.bfloat16)  # 0x3F80: bit 7 is one, bit 14 is zero
    Stuck(FaultConfig(site="grad", model="stuck", bit=7, stuck_at=1), random.Random(0)).corrupt(
        flat, 0
    )
    assert bits.pattern(flat, 0) == 0x3F80
    Stuck(FaultConfig(site="grad", model="stuck", bit=14, stuck_at=1), random.Random(0)).corrupt(
        flat, 0
    )
    assert bits.pattern(flat, 0) == 0x7F80
    Stuck(FaultConfig(site="grad", model="stuck", bit=15, stuck_at=0), random.Random(0)).corrupt(
        flat, 0
    )
    assert bits.pattern(flat, 0) == 0x7F80
