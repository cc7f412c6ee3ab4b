"""`drop`: the contribution of `fault.ranks` is missing from the sum (a lost or skipped
message): that rank sends zeros for the whole chunk, its rider region included. Needs
`site=allreduce scope=reduction`; every receiver gets the same wrong sum."""

from __future__ import annotations

import torch

from injectors.contribution import validate_reduction
from injectors.model import FaultModel


class Drop(FaultModel):
    name = "drop"
    contribution = True

    @classmethod
    def validate(cls, key: str, fault) -> None:
        validate_reduction(key, fault, cls.name)

    def contribute(
        self, parts: list[torch.Tensor], previous: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        for part in parts:
            part.zero_()
        return parts


MODEL = Drop
