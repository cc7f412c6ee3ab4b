"""`scale`: multiply the element by a finite factor (0.40 becomes 4.00 with factor 10)."""

from __future__ import annotations

import torch

from harness.errors import ConfigError
from injectors.model import FaultModel


class Scale(FaultModel):
    name = "scale"

    @classmethod
    def validate(cls, key: str, fault) -> None:
        if fault.factor is None:
            raise ConfigError(f"{key}.factor", "the scale model needs a finite factor")
        if fault.factor == 1:
            raise ConfigError(f"{key}.factor", "1 changes nothing: the fault could never strike")

    def corrupt(self, flat: torch.Tensor, index: int, bit: int | None = None) -> None:
        flat[index] = flat[index] * self.fault.factor


MODEL = Scale
