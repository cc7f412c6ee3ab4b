"""`bitflip`: invert one bit of the element, in the tensor's own dtype (LSB = 0)."""

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
        bits.flip(flat, index, bit)
        return bit


MODEL = BitFlip
