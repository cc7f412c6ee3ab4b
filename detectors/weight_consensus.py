"""`weight_consensus`: the third published check. After the update, every replica's parameters
(and optionally Adam's moments) are fingerprinted and gathered; a replica that differs from a
strict majority is suspect. It runs every `interval` steps and always before a checkpoint, and
refuses the checkpoint when the replicas disagree.

The fingerprint is two machine words per tensor, exact on bit patterns and order-aware (swaps,
bursts and cancelling flips change it; detectors/fingerprint.py: XXH3-128 of the bytes on the
CPU, about one read pass; a linear mixing on a GPU, so the ranks must share a kind of device),
and the gather is a few hundred bytes per rank: Megatron-LM's equivalent copies every tensor to
the CPU and hashes it with SHA-1, and says it is not meant to run often.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from detectors.fingerprint import fingerprint_words
from harness.core.checks import CheckConfig
from harness.core.plugins import Detector, DetectorContext, EventLog
from harness.core.values import flag, integer
from harness.errors import ConfigError


class WeightConsensus(Detector):
    name = "weight_consensus"

    @dataclass(frozen=True)
    class Config(CheckConfig):
        interval: int = 10  # steps between consensus runs (also before every checkpoint)
        optimizer_state: bool = False  # fingerprint Adam's moments with the weights

        def __post_init__(self) -> None:
            super().__post_init__()
            integer("interval", self.interval, 1)
            flag("optimizer_state", self.optimizer_state)

        @property
        def every(self) -> int:
            return self.interval

    @classmethod
    def check_topology(cls, config: Config, topology: Any) -> None:
        if topology.world_size < 3:
            raise ConfigError(
                "topology", "weight_consensus needs at least 3 replicas for a majority"
            )

    @classmethod
    def first_suspect_step(
        cls, config: Config, alarm_step: int, checkpointed: Callable[[int], bool]
    ) -> int:
        """The step after the last consensus before the alarm: every `interval` steps and before
        every checkpoint, the replicas were seen to agree."""
        interval = config.interval
        checked = [s for s in range(alarm_step) if (s + 1) % interval == 0 or checkpointed(s)]
        return max(checked) + 1 if checked else 0

    def __init__(self, config: Config, ctx: DetectorContext, log: EventLog):
        super().__init__(config, ctx, log)
        self.optimizer: torch.optim.Optimizer | None = None
        self.checked: dict[int, bool] = {}

    def on_optimizer_state(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def _tensors(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        named = [(n, p) for n, p in model.named_parameters()]
        if self.config.optimizer_state and self.optimizer is not None:
            names = {p: n for n, p in named}
            for p, state in self.optimizer.state.items():
                named += [(f"{names[p]}.{k}", state[k]) for k in ("exp_avg", "exp_avg_sq")]
        return named

    def _consensus(self, step: int, model: nn.Module) -> torch.Tensor:
        """Whether the replicas agree, as a 0-d bool tensor, unread; a disagreement is
        explained (and alerts) when the verdicts are read."""
        if step in self.checked:
            return self.checked[step]
        named = self._tensors(model)
        mine = torch.cat([fingerprint_words(t) for _, t in named])
        table = [torch.empty_like(mine) for _ in range(self.info.world_size)]
        dist.all_gather(table, mine)
        rows = torch.stack(table)
        agree = (rows == rows[0]).all()

        def explain(_: list[float]) -> None:
            self._explain(step, [tuple(r) for r in self.read(rows)], named)

        self.defer(step, "consensus", ~agree, explain)
        self.checked = {step: agree}
        return agree

    def _explain(self, step: int, rows: list[tuple[int, ...]], named: list) -> None:
        majority, count = Counter(rows).most_common(1)[0]
        if count * 2 <= len(rows):
            self.alert(
                step, "consensus", [], {"reason": "no strict majority", "groups": len(set(rows))}
            )
            return
        suspects = [r for r, row in enumerate(rows) if row != majority]
        differing = sorted(
            {named[i // 2][0] for r in suspects for i, w in enumerate(rows[r]) if w != majority[i]}
        )
        self.alert(step, "consensus", suspects, {"tensors": differing[:8], "agree": count})

    def on_update(self, step: int, model: nn.Module) -> None:
        if (step + 1) % self.config.interval == 0:
            self._consensus(step, model)

    def approves_checkpoint(self, step: int, model: nn.Module) -> torch.Tensor:
        return self._consensus(step, model)


DETECTOR = WeightConsensus
