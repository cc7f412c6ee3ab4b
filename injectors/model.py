"""The interface of a fault model: how one element's value goes wrong."""

from __future__ import annotations

import random

import torch


class FaultModel:
    """Corrupts one element of a flat tensor in place. One subclass per module in injectors/."""

    name = "model"

    def __init__(self, fault, rng: random.Random):
        self.fault = fault
        self.rng = rng

    @classmethod
    def validate(cls, key: str, fault) -> None:
        """Raise harness.config.ConfigError for parameters this model cannot use."""

    def corrupt(self, flat: torch.Tensor, index: int) -> int | None:
        """Change flat[index]; return the bit index touched, or None when not bit-level."""
        raise NotImplementedError
