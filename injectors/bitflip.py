"""`bitflip`: invert bits of the element, in the tensor's own dtype (LSB = 0).

`fault.bit` is an index, a class (`sign`, `exponent_msb`, `exponent`, `mantissa`: a bit of that
class drawn from the trial's seed), or null for any bit drawn from the seed. `fault.nbits` > 1
flips that many bits: adjacent ones upward from the chosen bit (`fault.adjacent=true`, shifted
down to fit the word), or the chosen bit plus others drawn at random. A permanent or
intermittent fault flips the bits it drew at its first strike on an element at every strike
(injectors/injector.py, `_redraw`).
"""

from __future__ import annotations

import torch

from injectors import bits
from injectors.model import FaultModel


def choose_bit(fault, dtype: torch.dtype, rng) -> int:
    """The configured bit, a seeded draw within the configured class, or any seeded bit."""
    if isinstance(fault.bit, int):
        return fault.bit
    if isinstance(fault.bit, str):
        return rng.choice(bits.class_bits(dtype, fault.bit))
    return rng.randrange(bits.width(dtype))


class BitFlip(FaultModel):
    name = "bitflip"

    def corrupt(self, flat: torch.Tensor, index: int, bit: int | None = None) -> list[int]:
        width = bits.width(flat.dtype)
        first = choose_bit(self.fault, flat.dtype, self.rng) if bit is None else bit
        n = self.fault.nbits if bit is None else 1
        if n == 1:
            extra = []
        elif self.fault.adjacent:
            low = min(first, width - n)
            extra = [b for b in range(low, low + n) if b != first]
        else:
            extra = sorted(self.rng.sample([b for b in range(width) if b != first], n - 1))
        # The chosen bit first: the event's `bit`, and the row's, whose class is the fault's.
        chosen = [first, *extra]
        for b in chosen:
            bits.flip(flat, index, b)
        return chosen


MODEL = BitFlip
