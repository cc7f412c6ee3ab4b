"""Bit-level access to one element of a float tensor, in the tensor's own dtype."""

from __future__ import annotations

import torch

from harness.core.formats import class_bits as format_bits

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


def width(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def format_name(dtype: torch.dtype) -> str:
    """`dtype` as harness.core.formats names it (the `bit_dtype` column's)."""
    return str(dtype).removeprefix("torch.")


def class_bits(dtype: torch.dtype, name: str) -> list[int]:
    """The bit indices (LSB = 0) of one bit class in `dtype`."""
    return format_bits(format_name(dtype), name)


def _int_view(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(_INT_VIEW[flat.dtype])


def pattern(flat: torch.Tensor, index: int) -> int:
    """The element's bit pattern as an unsigned integer."""
    bits = width(flat.dtype)
    return int(_int_view(flat)[index]) & ((1 << bits) - 1)


def to_hex(flat: torch.Tensor, index: int) -> str:
    return f"0x{pattern(flat, index):0{width(flat.dtype) // 4}x}"


def _signed(value: int, bits: int) -> int:
    """An unsigned `bits`-bit pattern as the signed integer view holds it."""
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def write_pattern(flat: torch.Tensor, index: int, value: int) -> None:
    """Store an unsigned bit pattern into the element, reinterpreted as the signed view."""
    _int_view(flat)[index] = _signed(value, width(flat.dtype))


def flip(flat: torch.Tensor, index: int, bit: int) -> None:
    write_pattern(flat, index, pattern(flat, index) ^ (1 << bit))


def flip_all(view: torch.Tensor, bit: int) -> None:
    """Flip `bit` of every element of `view` (any strides) in place."""
    _int_view(view).bitwise_xor_(_signed(1 << bit, width(view.dtype)))
