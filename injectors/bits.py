"""Bit-level access to one element of a float tensor, in the tensor's own dtype."""

from __future__ import annotations

import torch

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}


# Explicit mantissa widths: torch.finfo has no field for them.
MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
CLASSES = ("sign", "exponent_msb", "exponent", "mantissa")


def width(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


def class_bits(dtype: torch.dtype, name: str) -> list[int]:
    """The bit indices (LSB = 0) of one bit class in `dtype`."""
    top, mantissa = width(dtype) - 1, MANTISSA_BITS[dtype]
    return {
        "sign": [top],
        "exponent_msb": [top - 1],
        "exponent": list(range(mantissa, top)),
        "mantissa": list(range(mantissa)),
    }[name]


def classify(dtype: torch.dtype, bit: int) -> str:
    """The narrowest class a bit belongs to."""
    for name in ("sign", "exponent_msb", "exponent", "mantissa"):
        if bit in class_bits(dtype, name):
            return name
    raise ValueError(f"bit {bit} is outside {dtype}")


def _int_view(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(_INT_VIEW[flat.dtype])


def pattern(flat: torch.Tensor, index: int) -> int:
    """The element's bit pattern as an unsigned integer."""
    bits = width(flat.dtype)
    return int(_int_view(flat)[index]) & ((1 << bits) - 1)


def to_hex(flat: torch.Tensor, index: int) -> str:
    return f"0x{pattern(flat, index):0{width(flat.dtype) // 4}x}"


def write_pattern(flat: torch.Tensor, index: int, value: int) -> None:
    """Store an unsigned bit pattern into the element, reinterpreted as the signed view."""
    bits = width(flat.dtype)
    signed = value - (1 << bits) if value >= 1 << (bits - 1) else value
    _int_view(flat)[index] = signed


def flip(flat: torch.Tensor, index: int, bit: int) -> None:
    write_pattern(flat, index, pattern(flat, index) ^ (1 << bit))
