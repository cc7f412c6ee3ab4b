"""`grad_stats`: every step, cheap statistics compared across ranks: each bucket's gradient norm
and the loss ride on the bucket's allreduce (one slot per rank, so the sum is a gather for
free). A rank whose log-norm is a robust outlier (distance from the median over `threshold`
median absolute deviations, and at least `min_ratio` times off) is suspect (of two ranks, neither
stands out from the other: an alarm naming none); a loss above
`spike` times the running maximum of earlier losses is a spike. Its false positive rate on clean
runs is measured in the campaigns, not assumed.

Cost per step (sdc-plan): bytes = B*N, flops = 2*N: one norm over the gradients (a multiply-add per
element) (the symbols: harness/analysis/estimates.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from harness.core.checks import CheckConfig
from harness.core.plugins import Bucket, Detector, DetectorContext, EventLog
from harness.core.values import above
from harness.errors import ConfigError


class GradStats(Detector):
    name = "grad_stats"

    @dataclass(frozen=True)
    class Config(CheckConfig):
        threshold: float = 8.0  # median absolute deviations of the log norm
        min_ratio: float = 4.0  # the band never narrower than this ratio to the median
        spike: float = 10.0  # times the largest norm seen

        def __post_init__(self) -> None:
            super().__post_init__()
            for name in ("threshold", "min_ratio", "spike"):
                above(name, getattr(self, name), 1)

    @classmethod
    def configure(cls, key: str, params: dict[str, Any], topology: Any) -> Config:
        """The median absolute deviation of two log norms is 0 (torch's median of two is the
        lower), so the band is min_ratio's alone; one rank is its own median: a world too small
        to read `threshold` or `min_ratio` refuses one set otherwise."""
        config = super().configure(key, params, topology)
        if topology is None:  # no world planned (the benchmarks)
            return config
        world = topology.world_size
        for name, ranks in (("threshold", 3), ("min_ratio", 2)):
            default = getattr(cls.Config, name)
            if world < ranks and getattr(config, name) != default:
                raise ConfigError(
                    f"{key}.{name}", f"a world of {world} rank(s) never reads it (it needs "
                    f"{ranks} or more ranks); leave it {default}"
                )  # fmt: skip
        return config

    def __init__(self, config: Config, ctx: DetectorContext, log: EventLog):
        super().__init__(config, ctx, log)
        self.device = torch.device(ctx.info.device)
        self.losses: list[torch.Tensor] = []
        self.running_max = torch.tensor(-math.inf, dtype=torch.float64, device=self.device)

    def state_dict(self) -> dict[str, Any]:
        return {"running_max": self.read(self.running_max)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.running_max = torch.tensor(
            state["running_max"], dtype=torch.float64, device=self.device
        )

    def on_loss(self, step: int, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach())
        return None

    def rider(self, step: int, bucket: Bucket) -> torch.Tensor:
        world, rank = self.info.world_size, self.info.rank
        slot = torch.zeros(world, 2, device=bucket.buffer.device)
        flat = bucket.buffer.float()
        slot[rank, 0] = torch.dot(flat, flat).sqrt()
        if self.losses:
            total = self.losses[0].double()  # summed in order, in float64, as Python's sum
            for loss in self.losses[1:]:
                total = total + loss.double()
            slot[rank, 1] = total / len(self.losses)
        return slot.reshape(-1)

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        table = bucket.riders[id(self)].reshape(self.info.world_size, 2)
        norms, losses = table[:, 0].double(), table[:, 1].double()
        if bucket.is_last:
            self.losses = []
        broken, suspects = self._outliers(norms)
        index = bucket.index

        def explain(values: list[float]) -> None:
            world = self.info.world_size
            ranks = [r for r, s in enumerate(values[world:]) if s]
            self.alert(step, "post_allreduce", ranks, {"bucket": index, "norms": values[:world]})

        self.defer(step, "post_allreduce", broken, explain,
                   torch.cat([norms, suspects.double()]))  # fmt: skip
        if bucket.index == 0:
            self._spikes(step, losses)

    def _outliers(self, norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whether some rank's norm is off, and which ranks are suspect: those with a non-finite
        norm if any, else the outliers. Of two finite norms too far apart neither stands out
        from the other: an alarm that names no rank (torch's median of two is the lower, and
        the higher was named alone, healthy where the fault shrank the other's gradient)."""
        finite = torch.isfinite(norms)
        logs = norms.clamp_min(1e-30).log()
        median = logs.median()
        mad = (logs - median).abs().median()
        spread = (mad * self.config.threshold).clamp_min(math.log(self.config.min_ratio))
        named = torch.where(finite.all(), (logs - median).abs() > spread, ~finite)
        if len(norms) == 2:
            return named.any(), named & ~finite.all()
        return named.any(), named

    def _spikes(self, step: int, losses: torch.Tensor) -> None:
        limit = self.config.spike * self.running_max
        spiking = (self.running_max > 0) & ~(losses <= limit)

        def explain(values: list[float]) -> None:
            world = self.info.world_size
            ranks = [r for r, s in enumerate(values[world + 1 :]) if s]
            self.alert(step, "post_allreduce", ranks,
                       {"losses": values[:world], "limit": values[world]})  # fmt: skip

        self.defer(step, "post_allreduce", spiking.any(), explain,
                   torch.cat([losses, limit.reshape(1), spiking.double()]))  # fmt: skip
        finite = torch.where(torch.isfinite(losses), losses, -math.inf)
        self.running_max = torch.maximum(self.running_max, finite.max())


DETECTOR = GradStats
