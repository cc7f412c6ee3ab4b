"""The interface of a fault model: how one element's value, a group of elements, or a rank's
whole contribution to a reduction goes wrong."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

from harness.core.settings import Settings

if TYPE_CHECKING:
    from harness.config.schema import FaultConfig


class FaultModel:
    """Corrupts elements of a flat tensor in place. One subclass per module in injectors/."""

    name = "model"
    # A grouped model draws its positions as one group in one tensor (`group`), not one by one.
    grouped = False
    # A contribution model changes what one rank sends into a reduction (`contribute`).
    contribution = False
    # A per-product model strikes whole products of the forward, each with its own chance
    # (`corrupt_lane`), not elements drawn up front (injectors/defective_unit.py).
    per_product = False
    # A fatal model takes its rank down where it strikes (injectors/crash.py): the rank returns
    # no events, so its strike is recorded, and kept where the parent reads it, before it acts.
    fatal = False
    # The model's own keys, beside the keys every fault has: set as `fault.KEY` or a scenario's
    # `KEY`, parsed into `fault.settings` (a `Config` instance) when the fault is validated.
    Config: type[Settings] = Settings

    def __init__(self, fault: FaultConfig, rng: random.Random):
        self.fault = fault
        self.rng = rng

    @classmethod
    def validate(cls, key: str, fault: FaultConfig) -> None:
        """Raise harness.config.load.ConfigError for parameters this model cannot use."""

    def corrupt(self, flat: torch.Tensor, index: int, bit: int | None = None) -> list[int] | None:
        """Change flat[index] (at `bit`, for bit-level models, when given); return the bit
        indices touched, or None when the model is not bit-level."""
        raise NotImplementedError

    def corrupt_many(
        self, flat: torch.Tensor, picks: list[tuple[int, int | None]]
    ) -> list[list[int] | None]:
        """Change every (index, bit) of one tensor; the bits touched, per pick."""
        return [self.corrupt(flat, index, bit) for index, bit in picks]

    def group(self, size: int, first: int, rng: random.Random) -> list[int]:
        """A grouped model's positions in a tensor of `size` elements, around `first`."""
        raise NotImplementedError

    def corrupt_lane(self, output: torch.Tensor, dim: int = -1) -> tuple[int, int]:
        """A per-product model: corrupt one struck product's output in place (its columns along
        `dim`); the bit flipped and the elements changed."""
        raise NotImplementedError

    def contribute(
        self, parts: list[torch.Tensor], previous: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        """Change this rank's contribution to one chunk's reduction in place (`previous`: the
        genuine contribution of its last step, when known); None when it could not."""
        raise NotImplementedError
