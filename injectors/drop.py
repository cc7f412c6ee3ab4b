"""`drop`: the contribution of `fault.ranks` is missing from the sum (a lost or skipped
message): that rank sends zeros for the whole chunk, its rider region included. Needs
`site=allreduce scope=reduction`; every receiver gets the same wrong sum."""

from __future__ import annotations

import torch

from injectors.contribution import ContributionModel


class Drop(ContributionModel):
    name = "drop"

    def contribute(
        self, parts: list[torch.Tensor], previous: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        for part in parts:
            part.zero_()
        return parts


MODEL = Drop
