"""`stale`: `fault.ranks` contribute their previous step's chunk (a buffer sent before it was
refreshed), rider region included. Needs `site=allreduce scope=reduction` and a fault step >= 1;
a trial then starts one step before the fault, so that the previous chunk exists."""

from __future__ import annotations

import torch

from harness.errors import ConfigError
from injectors.contribution import ContributionModel


class Stale(ContributionModel):
    name = "stale"

    @classmethod
    def validate(cls, key: str, fault) -> None:
        super().validate(key, fault)
        if fault.steps and fault.steps[0] < 1:
            raise ConfigError(f"{key}.steps", "stale needs a previous step; steps must be >= 1")

    def contribute(
        self, parts: list[torch.Tensor], previous: list[torch.Tensor] | None
    ) -> list[torch.Tensor] | None:
        if previous is None:
            return None
        for part, old in zip(parts, previous, strict=True):
            part.copy_(old)
        return parts


MODEL = Stale
