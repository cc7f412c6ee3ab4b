"""`stuck`: a bit stuck at 0 or 1 (`fault.stuck_at`). When the bit already holds that value
nothing changes, and the injection does not count as fired. A bit drawn from a class (or any
bit) is drawn once per element when the fault persists: the same bit stays stuck."""

from __future__ import annotations

import torch

from harness.errors import ConfigError
from injectors import bits
from injectors.bitflip import choose_bit
from injectors.model import FaultModel


class Stuck(FaultModel):
    name = "stuck"

    @classmethod
    def validate(cls, key: str, fault) -> None:
        if fault.stuck_at not in (0, 1):
            raise ConfigError(
                f"{key}.stuck_at", f"'{fault.stuck_at}' is not allowed; allowed: 0, 1"
            )

    def corrupt(self, flat: torch.Tensor, index: int, bit: int | None = None) -> list[int]:
        bit = choose_bit(self.fault, flat.dtype, self.rng) if bit is None else bit
        pattern = bits.pattern(flat, index)
        if self.fault.stuck_at:
            bits.write_pattern(flat, index, pattern | (1 << bit))
        else:
            bits.write_pattern(flat, index, pattern & ~(1 << bit))
        return [bit]


MODEL = Stuck
