"""`weight_consensus`: the third published check. After the update, every replica's parameters
(and optionally Adam's moments) are fingerprinted and gathered; a replica that differs from a
strict majority is suspect. It runs every `interval` steps and always before a checkpoint, and
refuses the checkpoint when the replicas disagree.

The fingerprint is two machine words per tensor, exact on bit patterns and order-aware (swaps,
bursts and cancelling flips change it; detectors/fingerprint.py: XXH3-128 of the bytes on the
CPU, about one read pass; a linear mixing on a GPU, so the ranks must share a kind of device),
and the gather is a few hundred bytes per rank: Megatron-LM's equivalent copies every tensor to
the CPU and hashes it with SHA-1, and says it is not meant to run often.

Under HSDP (`topology.parallel=hsdp`) the replicas are the replica groups: each rank
fingerprints the shards it holds, and shard i of every group is compared with shard i of the
others (the ranks at the same place in their shard groups), so a strict majority needs three
groups. Under FSDP there is no replica to compare, and the check does not apply.

Cost per step (sdc-plan): bytes = B*N*m/k, flops = 0: one fingerprint read of the weights every k
steps, and of Adam's two moments with `optimizer_state` (m: 3, else 1; the symbols:
harness/analysis/estimates.py).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from detectors.fingerprint import fingerprint_words
from harness.core import dtensors, inflight
from harness.core.checks import IntervalConfig
from harness.core.plugins import Detector, DetectorContext, EventLog
from harness.core.values import flag
from harness.errors import ConfigError


def _per_element(param: torch.Tensor, state: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """What an optimizer keeps per element of `param`, whichever it is (Adam's moments, SGD's
    momentum): not its counters (Adam's step, on the host on a GPU)."""
    return [(k, v) for k, v in sorted(state.items())
            if isinstance(v, torch.Tensor) and v.shape == param.shape]  # fmt: skip


class WeightConsensus(Detector):
    name = "weight_consensus"
    parallel = ("ddp", "hsdp")

    @dataclass(frozen=True)
    class Config(IntervalConfig):
        interval: int = 10  # steps between consensus runs (also before every checkpoint)
        optimizer_state: bool = False  # fingerprint Adam's moments with the weights

        def __post_init__(self) -> None:
            super().__post_init__()
            flag("optimizer_state", self.optimizer_state)

    @classmethod
    def check_topology(cls, config: Config, topology: Any) -> None:
        groups = topology.world_size // (topology.shard_size or 1)
        if topology.parallel == "hsdp" and groups < 3:
            # A shard group of one rank is no sharding: HSDP's groups hold two ranks or more.
            most = topology.world_size // 3
            allowed = (
                f"shard groups of at most {most} ranks" if most >= 2
                else f"a world of at least {3 * topology.shard_size} ranks at this shard size"
            )  # fmt: skip
            raise ConfigError(
                "topology.shard_size",
                "weight_consensus needs at least 3 replica groups for a majority, and this world "
                f"of {topology.world_size} has {groups}; allowed: {allowed}",
            )
        if topology.world_size < 3:
            raise ConfigError(
                "topology", "weight_consensus needs at least 3 replicas for a majority"
            )

    @classmethod
    def check_optimizer(
        cls,
        key: str,
        config: Config,
        stepped: Callable[[], torch.optim.Optimizer],
        named: str,
    ) -> None:
        if config.optimizer_state and not any(
            _per_element(p, state) for p, state in stepped().state.items()
        ):
            raise ConfigError(
                f"{key}.optimizer_state", f"true: {named} keeps no state per element of a "
                "parameter, so the weights alone would be fingerprinted, as with false; leave it "
                "false, or use an optimizer that keeps some (Adam's moments, SGD's momentum)"
            )  # fmt: skip

    @classmethod
    def first_suspect_step(
        cls, config: Config, alarm_step: int, checkpointed: Callable[[int], bool]
    ) -> int:
        """The step after the last consensus before the alarm: every `interval` steps and before
        every checkpoint, the replicas were seen to agree; without `optimizer_state`, on their
        weights alone, so that step's own optimizer state (Adam's moments, which reach the
        weights at the next update) stays suspect: that step itself."""
        checked = cls._looks(config, range(alarm_step), checkpointed)
        if not checked:
            return 0
        return max(checked) + 1 if config.optimizer_state else max(checked)

    @classmethod
    def ran_every(cls, config: Config, steps: range, checkpointed: Callable[[int], bool]) -> int:
        """Checkpoints that do not fall on its own looks leave shorter stretches unseen. The
        first stretch from its last own look before `steps` (a run resumed mid-interval); with
        no look in the run at all, its interval."""
        looked = cls._looks(config, steps, checkpointed)
        if not looked:
            return config.interval
        before = steps.start // config.interval * config.interval - 1
        return max(b - a for a, b in itertools.pairwise([before, *looked]))

    @classmethod
    def looks(cls, config: Config, steps: range, checkpointed: Callable[[int], bool]) -> int:
        """Counted: checkpoints off its own looks make them irregular, and its longest stretch
        unseen (`ran_every`) would price each look as if it came that seldom."""
        return len(cls._looks(config, steps, checkpointed))

    @classmethod
    def looks_in(cls, config: Config, steps: range, checkpointed: Callable[[int], bool]) -> bool:
        return bool(cls._looks(config, steps, checkpointed))

    @staticmethod
    def _looks(config: Config, steps: range, checkpointed: Callable[[int], bool]) -> list[int]:
        """The steps in `steps` after which it compares the replicas: every `interval`-th, and
        each one a checkpoint follows."""
        return [s for s in steps if (s + 1) % config.interval == 0 or checkpointed(s)]

    def __init__(self, config: Config, ctx: DetectorContext, log: EventLog):
        super().__init__(config, ctx, log)
        self.optimizer: torch.optim.Optimizer | None = None
        self.checked: dict[int, bool] = {}

    def on_optimizer_state(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def _tensors(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """What this rank holds: its replica, or under HSDP its own shards."""
        named = [(n, p) for n, p in model.named_parameters()]
        if self.config.optimizer_state and self.optimizer is not None:
            names = {p: n for n, p in named}
            for p, state in self.optimizer.state.items():
                named += [(f"{names[p]}.{k}", v) for k, v in _per_element(p, state)]
        return [(n, dtensors.local(t)) for n, t in named]

    def _consensus(self, step: int, model: nn.Module) -> torch.Tensor:
        """Whether the replicas agree, as a 0-d bool tensor, unread; a disagreement is
        explained (and alerts) when the verdicts are read."""
        if step in self.checked:
            return self.checked[step]
        named = self._tensors(model)
        mine = torch.cat([fingerprint_words(t) for _, t in named])
        table = [torch.empty_like(mine) for _ in range(self.info.world_size)]
        dist.all_gather(table, mine)
        inflight.hold(mine, *table)
        rows = torch.stack(table)
        places = dtensors.places(model, self.info.world_size)
        first = [places.index(place) for place in places]  # the first rank at each one's place
        agree = (rows == rows[first]).all()

        def explain(_: list[float]) -> None:
            read = [tuple(r) for r in self.read(rows)]
            for place in sorted(set(places)):
                ranks = [r for r, at in enumerate(places) if at == place]
                if len({read[r] for r in ranks}) > 1:
                    self._explain(step, ranks, [read[r] for r in ranks], named)

        self.defer(step, "consensus", ~agree, explain)
        self.checked = {step: agree}
        return agree

    def _explain(
        self, step: int, ranks: list[int], rows: list[tuple[int, ...]], named: list
    ) -> None:
        """An alert for the replicas `ranks` (the world, or under HSDP the holders of one
        shard), whose fingerprints `rows` disagree."""
        majority, count = Counter(rows).most_common(1)[0]
        if count * 2 <= len(rows):
            self.alert(
                step, "consensus", [], {"reason": "no strict majority", "groups": len(set(rows))}
            )
            return
        suspects = [i for i, row in enumerate(rows) if row != majority]
        differing = sorted(
            {named[i // 2][0] for r in suspects for i, w in enumerate(rows[r]) if w != majority[i]}
        )
        self.alert(
            step,
            "consensus",
            [ranks[i] for i in suspects],
            {"tensors": differing[:8], "agree": count},
        )

    def on_update(self, step: int, model: nn.Module) -> None:
        if (step + 1) % self.config.interval == 0:
            self._consensus(step, model)

    def approves_checkpoint(self, step: int, model: nn.Module) -> torch.Tensor:
        return self._consensus(step, model)


DETECTOR = WeightConsensus
