"""`burst`: `fault.elements` elements of one tensor corrupted alike by the sub-model
`fault.burst_model` (bitflip, scale or value): adjacent ones (a burst in memory), or every
`fault.stride`-th one (a lane or address-line pattern). A bitflip burst flips the same bit in
every element, as a faulty lane would. A burst that would run past the tensor's end is shifted
back to fit, or cut at the end of a tensor shorter than the burst."""

from __future__ import annotations

import random

import torch

from harness.errors import ConfigError
from injectors import model_class
from injectors.bitflip import choose_bit
from injectors.model import FaultModel

SUB_MODELS = ("bitflip", "scale", "value")


class Burst(FaultModel):
    name = "burst"
    grouped = True

    @classmethod
    def validate(cls, key: str, fault) -> None:
        if fault.burst_model not in SUB_MODELS:
            raise ConfigError(
                f"{key}.burst_model",
                f"'{fault.burst_model}' is not allowed; allowed: {', '.join(SUB_MODELS)}",
            )
        if fault.elements < 2:
            raise ConfigError(f"{key}.elements", f"{fault.elements}: a burst needs 2 or more")
        model_class(fault.burst_model).validate(key, fault)

    def __init__(self, fault, rng: random.Random):
        super().__init__(fault, rng)
        self.inner = model_class(fault.burst_model)(fault, rng)

    def group(self, size: int, first: int, rng: random.Random) -> list[int]:
        span = (self.fault.elements - 1) * self.fault.stride + 1
        start = max(0, min(first, size - span))
        return [i for i in range(start, start + span, self.fault.stride) if i < size]

    def corrupt_many(
        self, flat: torch.Tensor, picks: list[tuple[int, int | None]]
    ) -> list[list[int] | None]:
        bit = None
        if self.fault.burst_model == "bitflip":
            bit = (
                picks[0][1]
                if picks[0][1] is not None
                else choose_bit(self.fault, flat.dtype, self.rng)
            )
        return [self.inner.corrupt(flat, index, bit) for index, _ in picks]


MODEL = Burst
