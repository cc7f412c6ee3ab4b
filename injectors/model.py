"""The interface of a fault model: how one element's value goes wrong."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from harness.config import FaultConfig


class FaultModel:
    """Corrupts one element of a flat tensor in place. One subclass per module in injectors/."""

    name = "model"

    def __init__(self, fault: FaultConfig, rng: random.Random):
        self.fault = fault
        self.rng = rng

    @classmethod
    def validate(cls, key: str, fault: FaultConfig) -> None:
        """Raise harness.config.ConfigError for parameters this model cannot use."""

    def corrupt(self, flat: torch.Tensor, index: int, bit: int | None = None) -> list[int] | None:
        """Change flat[index] (at `bit`, for bit-level models, when given); return the bit
        indices touched, or None when the model is not bit-level."""
        raise NotImplementedError
