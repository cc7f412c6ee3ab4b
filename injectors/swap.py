"""`swap`: two elements of one tensor exchange their values, as when a corrupted address sends
a value to another element's place (`fault.index`, when given, is the first; the second is drawn
from the trial's seed anywhere else in the same tensor)."""

from __future__ import annotations

import random

import torch

from harness.errors import ConfigError
from injectors.model import FaultModel


class Swap(FaultModel):
    name = "swap"
    grouped = True

    @classmethod
    def validate(cls, key: str, fault) -> None:
        if fault.elements != 1:
            raise ConfigError(f"{key}.elements", "swap exchanges exactly two elements; leave it 1")

    def group(self, size: int, first: int, rng: random.Random) -> list[int]:
        if size < 2:
            return []
        second = rng.randrange(size - 1)
        return sorted([first, second + (second >= first)])

    def corrupt_many(
        self, flat: torch.Tensor, picks: list[tuple[int, int | None]]
    ) -> list[list[int] | None]:
        (a, _), (b, _) = picks
        flat[a], flat[b] = flat[b].clone(), flat[a].clone()
        return [None, None]


MODEL = Swap
