"""`grad_stats`: every step, cheap statistics compared across ranks: each bucket's gradient norm
and the loss ride on the bucket's allreduce (one slot per rank, so the sum is a gather for
free). A rank whose log-norm is a robust outlier (distance from the median over `threshold`
median absolute deviations, and at least `min_ratio` times off) is suspect; a loss above
`spike` times the running maximum of earlier losses is a spike. Its false positive rate on clean
runs is measured in the campaigns, not assumed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from harness.errors import ConfigError
from harness.plugins import Bucket, Detector


class GradStats(Detector):
    name = "grad_stats"
    defaults = {"threshold": 8.0, "min_ratio": 4.0, "spike": 10.0}

    @classmethod
    def check(cls, key: str, params: dict[str, Any], topology: Any) -> None:
        for name in ("threshold", "min_ratio", "spike"):
            value = params[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 1:
                raise ConfigError(f"{key}.{name}", f"'{value}' must be a number > 1")

    def __init__(self, params, ctx, log):
        super().__init__(params, ctx, log)
        self.losses: list[float] = []
        self.running_max = -math.inf

    def state_dict(self) -> dict[str, Any]:
        return {"running_max": self.running_max}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.running_max = state["running_max"]

    def on_loss(self, step: int, loss: torch.Tensor) -> None:
        self.losses.append(loss.item())
        return None

    def rider(self, step: int, bucket: Bucket) -> torch.Tensor:
        world, rank = self.info.world_size, self.info.rank
        slot = torch.zeros(world, 2)
        flat = bucket.buffer.float()
        slot[rank, 0] = torch.dot(flat, flat).sqrt()
        slot[rank, 1] = sum(self.losses) / len(self.losses) if self.losses else 0.0
        return slot.reshape(-1)

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        table = bucket.riders[id(self)].reshape(self.info.world_size, 2)
        norms, losses = table[:, 0].double(), table[:, 1].double()
        if bucket.is_last:
            self.losses = []
        suspects = self._outliers(norms)
        if suspects:
            evidence = {"bucket": bucket.index, "norms": norms.tolist()}
            self.alert(step, "post_allreduce", suspects, evidence)
        if bucket.index == 0:
            self._spikes(step, losses)

    def _outliers(self, norms: torch.Tensor) -> list[int]:
        if not torch.isfinite(norms).all():
            return [r for r, x in enumerate(norms.tolist()) if not math.isfinite(x)]
        logs = norms.clamp_min(1e-30).log()
        median = logs.median()
        mad = (logs - median).abs().median()
        spread = max(float(mad) * self.params["threshold"], math.log(self.params["min_ratio"]))
        return [r for r, x in enumerate(logs.tolist()) if abs(x - float(median)) > spread]

    def _spikes(self, step: int, losses: torch.Tensor) -> None:
        limit = self.params["spike"] * self.running_max
        if self.running_max > 0:
            spiking = [r for r, x in enumerate(losses.tolist()) if not x <= limit]
            if spiking:
                self.alert(
                    step, "post_allreduce", spiking, {"losses": losses.tolist(), "limit": limit}
                )
        finite = losses[torch.isfinite(losses)]
        if len(finite):
            self.running_max = max(self.running_max, float(finite.max()))


DETECTOR = GradStats
