"""The floating-point formats a fault can target, and the classes of their bits (the `bit`
column's), shared by the injectors, the config and the report."""

from __future__ import annotations

# (bits, mantissa bits) of each floating-point format a fault can target.
FLOAT_FORMATS = {"float64": (64, 52), "float32": (32, 23), "bfloat16": (16, 7), "float16": (16, 10)}
BIT_CLASSES = ("sign", "exponent_msb", "exponent", "mantissa")


def class_bits(fmt: str, name: str) -> list[int]:
    """The bit indices (LSB = 0) of one bit class in the format `fmt` (a FLOAT_FORMATS key)."""
    width, mantissa = FLOAT_FORMATS[fmt]
    top = width - 1
    return {
        "sign": [top],
        "exponent_msb": [top - 1],
        "exponent": list(range(mantissa, top)),
        "mantissa": list(range(mantissa)),
    }[name]


def classify_bit(fmt: str, bit: int) -> str:
    """The narrowest class a bit of `fmt` belongs to."""
    for name in BIT_CLASSES:
        if bit in class_bits(fmt, name):
            return name
    raise ValueError(f"bit {bit} is outside {fmt}")


def unchanging_scale(fmt: str) -> float:
    """Within this distance of 1, x * factor rounds back to x for every x of `fmt`: half of
    the half-ulp of the smallest significand, 2^-(m+2) for an m-bit mantissa."""
    return 2.0 ** -(FLOAT_FORMATS[fmt][1] + 2)
