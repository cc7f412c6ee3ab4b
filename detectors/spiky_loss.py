"""`spiky_loss`: Megatron-LM's spiky-loss check, as published.

megatron/core/rerun_state_machine.py `is_unexpectedly_large`, passed to `validate_result` on
each rank's local loss with `threshold=10` ("Spiky loss", not fatal): the absolute value of the
first `num_samples=100` results sets a maximum (NaN and infinity are ignored: "they should be
checked separately"), and from then on a result is rejected when it is at least `threshold`
times that maximum. The maximum is never updated after the first samples. The original has no
interval: it runs on every loss. The rank whose loss is rejected is the suspect.

So it is blind for its first 100 losses (every micro-batch counts), and, in a short campaign,
for the whole run: that is its published behaviour, measured as such.

Cost per step (sdc-plan): bytes = 0, flops = 0: one scalar per micro-batch (the symbols:
harness/analysis/estimates.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.core.checks import CheckConfig
from harness.core.plugins import Detector, DetectorContext, EventLog
from harness.core.values import above, integer


class SpikyLoss(Detector):
    name = "spiky_loss"

    @dataclass(frozen=True)
    class Config(CheckConfig):
        threshold: float = 10.0  # times the largest loss sampled
        samples: int = 100  # the first steps' losses that set the largest

        def __post_init__(self) -> None:
            super().__post_init__()
            above("threshold", self.threshold, 1)
            integer("samples", self.samples, 1)

    def __init__(self, config: Config, ctx: DetectorContext, log: EventLog):
        super().__init__(config, ctx, log)
        # On the device, so that no loss is read back in the step: how many samples set the
        # maximum so far, and the maximum.
        self.device = torch.device(ctx.info.device)
        self.count = torch.zeros((), dtype=torch.int64, device=self.device)
        self.largest = torch.zeros((), dtype=torch.float64, device=self.device)

    def state_dict(self) -> dict[str, Any]:
        count, largest = self.read(torch.stack([self.count.double(), self.largest]))
        return {"count": int(count), "largest": largest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = torch.tensor(state["count"], dtype=torch.int64, device=self.device)
        self.largest = torch.tensor(state["largest"], dtype=torch.float64, device=self.device)

    def on_loss(self, step: int, loss: torch.Tensor) -> None:
        value = loss.detach().double().abs()
        finite = torch.isfinite(value)
        sampling = finite & (self.count < self.config.samples)
        limit = self.largest * self.config.threshold
        spike = finite & ~sampling & (value >= limit)
        self.count = self.count + sampling.long()
        self.largest = torch.where(sampling, torch.maximum(self.largest, value), self.largest)

        def explain(values: list[float]) -> None:
            self.alert(step, "loss", [self.info.rank], {"loss": values[0], "limit": values[1]})

        self.defer(step, "loss", spike, explain, torch.stack([value, limit]))
        return None


DETECTOR = SpikyLoss
