"""`bitflip`: invert one bit of the element, in the tensor's own dtype (LSB = 0).

`fault.bit` is an index, a class (`sign`, `exponent_msb`, `exponent`, `mantissa`: a bit of that
class drawn from the trial's seed), or null for any bit drawn from the seed.
"""

from __future__ import annotations

import torch

from injectors import bits
from injectors.model import FaultModel


class BitFlip(FaultModel):
    name = "bitflip"

    def corrupt(self, flat: torch.Tensor, index: int) -> int:
        bit = self.fault.bit
        if bit is None:
            bit = self.rng.randrange(bits.width(flat.dtype))
        elif isinstance(bit, str):
            bit = self.rng.choice(bits.class_bits(flat.dtype, bit))
        bits.flip(flat, index, bit)
        return bit


MODEL = BitFlip
