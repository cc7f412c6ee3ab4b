"""`duplicate`: the contribution of `fault.ranks` is counted twice in the sum (a message
delivered twice), rider region included. Doubling is exact in floating point. Needs
`site=allreduce scope=reduction`."""

from __future__ import annotations

import torch

from injectors.contribution import ContributionModel


class Duplicate(ContributionModel):
    name = "duplicate"

    def contribute(
        self, parts: list[torch.Tensor], previous: list[torch.Tensor] | None
    ) -> list[torch.Tensor]:
        for part in parts:
            part.mul_(2)
        return parts


MODEL = Duplicate
