"""Bit flips checked against an independent reference: struct and numpy bit manipulation."""

from __future__ import annotations

import random
import struct

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.config import FaultConfig
from injectors import bits
from injectors.bitflip import BitFlip
from injectors.scale import Scale
from injectors.value import Value


def _reference_f32(pattern: int, bit: int) -> int:
    value = struct.unpack("<f", struct.pack("<I", pattern))[0]
    flipped = struct.unpack("<I", struct.pack("<f", value))[0] ^ (1 << bit)
    return flipped


@given(st.integers(0, 2**32 - 1), st.integers(0, 31))
def test_float32_flip_matches_struct(pattern, bit):
    t = torch.tensor([pattern - 2**32 if pattern >= 2**31 else pattern], dtype=torch.int32)
    flat = t.view(torch.float32)
    bits.flip(flat, 0, bit)
    assert bits.pattern(flat, 0) == _reference_f32(pattern, bit)
    assert bits.to_hex(flat, 0) == f"0x{_reference_f32(pattern, bit):08x}"


@given(st.integers(0, 2**16 - 1), st.integers(0, 15))
def test_float16_flip_matches_numpy(pattern, bit):
    flat = torch.tensor([pattern], dtype=torch.int32).to(torch.int16).view(torch.float16)
    ref = np.array([pattern], dtype=np.uint16) ^ np.uint16(1 << bit)
    bits.flip(flat, 0, bit)
    assert bits.pattern(flat, 0) == int(ref[0])


@given(st.integers(0, 2**16 - 1), st.integers(0, 15))
def test_bfloat16_flip_is_the_top_half_of_float32(pattern, bit):
    # bfloat16 is the upper 16 bits of a float32: flipping bit b of it flips bit b + 16 there.
    flat = torch.tensor([pattern], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bits.flip(flat, 0, bit)
    as_f32 = struct.unpack("<f", struct.pack("<I", pattern << 16))[0]
    expected = struct.unpack("<I", struct.pack("<f", as_f32))[0] ^ (1 << (bit + 16))
    assert bits.pattern(flat, 0) == expected >> 16


def test_bitflip_model_flips_in_the_tensors_own_dtype():
    for dtype, bit, expected in ((torch.float32, 30, 0x7F800000), (torch.bfloat16, 14, 0x7F80)):
        flat = torch.tensor([0.0, 1.0], dtype=dtype)
        touched = BitFlip(FaultConfig(site="grad", model="bitflip", bit=bit), random.Random(0))
        assert touched.corrupt(flat, 1) == bit
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
