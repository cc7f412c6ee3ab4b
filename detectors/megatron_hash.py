"""`megatron_hash`: Megatron-LM's cross-replica weight check, as published.

megatron/core/utils.py `check_param_hashes_across_dp_replicas` (called from the training loop
every `--check-weight-hash-across-dp-replicas-interval` iterations): every parameter is copied
to the CPU (`param.data.to("cpu").float().numpy()`) and hashed with SHA-1; the per-parameter
digests are all-gathered over the data-parallel group, and each rank compares its own digests
with those of data-parallel rank 0 (`torch.equal(local, all[0])`). There is no majority: a rank
that differs from rank 0 reports a mismatch, and rank 0 always agrees with itself. So when rank
0 holds the corrupt weights, every healthy rank reports and rank 0 does not: it suspects the
healthy ranks. Its docstring says it is not meant to run often (the copy and SHA-1 cost seconds
on a large model; benchmarks/kernels.py measures it against our fingerprint).

Here each rank that differs from rank 0 alerts naming itself (what it reports, and what a row's
attribution measures of the method), at the same point as `weight_consensus`: after the update,
every `interval` steps. Those names attribute nothing (`attributes` False): recovery quarantines
no node and the guard's alarm names no machine on its word (exit 87).

Under HSDP (`topology.parallel=hsdp`) the data-parallel replicas are the replica groups: each
rank hashes the shards it holds and compares them with those of the rank at its place in
replica group 0, which plays rank 0's part (two groups suffice: there is no majority to form).
Under FSDP there is no replica, and the check does not apply.

Cost per step (sdc-plan): bytes = B*N/k, flops = 0, host = B*N/k: every parameter copied to the host
and SHA-1 hashed there every k steps (the symbols: harness/analysis/estimates.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from harness.core import dtensors, inflight
from harness.core.checks import IntervalConfig
from harness.core.plugins import Detector
from harness.errors import ConfigError


def sha1_table(model: nn.Module) -> torch.Tensor:
    """One SHA-1 digest (20 bytes) per parameter this rank holds (under sharding, its shard),
    after a copy to the CPU in float32."""
    digests = [
        hashlib.sha1(dtensors.local(p.data).to("cpu").float().numpy(force=True)).digest()
        for _, p in model.named_parameters()
    ]
    return torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8).view(-1, 20)


class MegatronHash(Detector):
    name = "megatron_hash"
    parallel = ("ddp", "hsdp")
    attributes = False

    @dataclass(frozen=True)
    class Config(IntervalConfig):
        interval: int = 10  # steps between comparisons

    @classmethod
    def looks_in(cls, config: Config, steps: range, checkpointed: Callable[[int], bool]) -> bool:
        return any((s + 1) % config.interval == 0 for s in steps)

    @classmethod
    def first_suspect_step(
        cls, config: Config, alarm_step: int, checkpointed: Callable[[int], bool]
    ) -> int:
        """Its last comparison's step before the alarm: the replicas' weights were seen to agree
        after that step's update, not its optimizer state, which a fault may have struck then
        (Adam's moments reach the weights at the next update)."""
        looked = [s for s in range(alarm_step) if (s + 1) % config.interval == 0]
        return max(looked) if looked else 0

    @classmethod
    def check_topology(cls, config: Config, topology: Any) -> None:
        groups = topology.world_size // (topology.shard_size or 1)
        if groups < 2:  # a user's HSDP mesh of one replica group: nothing to compare with
            raise ConfigError(
                "topology.shard_size", f"megatron_hash compares replicas, and this world of "
                f"{topology.world_size} has {groups}; allowed: two or more"
            )  # fmt: skip

    def on_update(self, step: int, model: nn.Module) -> None:
        if (step + 1) % self.config.interval:
            return
        # Gathered where the backend gathers (a GPU under NCCL), compared on the host.
        local = sha1_table(model).to(self.info.device)
        table = [torch.empty_like(local) for _ in range(self.info.world_size)]
        dist.all_gather(table, local)
        inflight.hold(local, *table)
        # Rank 0's part: the rank at this rank's place in the first replica group.
        versus = dtensors.places(model, self.info.world_size)[self.info.rank]
        local, first = local.cpu(), table[versus].cpu()
        if torch.equal(local, first):
            return
        names = [n for n, _ in model.named_parameters()]
        differing = [names[i] for i in range(len(names)) if not torch.equal(local[i], first[i])]
        evidence = {"tensors": differing[:8], "versus": versus}
        self.alert(step, "consensus", [self.info.rank], evidence)


DETECTOR = MegatronHash
