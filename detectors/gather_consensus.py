"""`gather_consensus`: what replaces weight consensus where there are no replicas. Under FSDP
(`topology.parallel=fsdp`) each rank holds only its own shard of each parameter, so no two ranks
hold a copy to compare after the update; but for each forward every rank all-gathers the same
unsharded parameters (harness/runtime/sharding.py, site `gather`), and those copies must agree
bit for bit. Each rank fingerprints the parameters it gathered, group by group, as they become
its forward weights, and the fingerprints are all-gathered over the world; a rank off the strict
majority is suspect.

What it sees:
- a shard corrupted on its way into one rank's weights (the all-gather's output on that rank):
  that rank alone differs, and is named, in the step the corrupt weights are used;
- under HSDP, a replica group whose shards went wrong (a weight fault): its ranks gather the
  wrong parameters together, and are named when they are a minority of the world (at least 3
  replica groups), at the next forward.
What it cannot see: a wrong shard under FSDP. Every rank gathers the same wrong values from its
one holder, so the copies agree; nothing in a sharded world holds a second copy of a shard.
Backward's re-gather of the blocks (`reshard_after_forward`) is not checked: it reaches the
gradients only, where the gradient checks look.

The fingerprint is detectors/fingerprint.py's, two words per parameter (exact on bit patterns,
order-aware), over the parameters' elements only: the padding of the last rank's chunk is FSDP's
and not compared. The gather costs a few hundred bytes per rank per group, in a collective of
its own; the fingerprints, about one read pass of the unsharded weights per forward.

Cost per step (sdc-plan): bytes = B*N/k, flops = 0: one fingerprint read of the gathered
parameters on every k-th step's forward (the symbols: harness/analysis/estimates.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from detectors.fingerprint import fingerprint_words
from harness.core import inflight
from harness.core.checks import IntervalConfig
from harness.core.plugins import Bucket, Detector
from harness.errors import ConfigError


class GatherConsensus(Detector):
    name = "gather_consensus"
    parallel = ("fsdp", "hsdp")

    @dataclass(frozen=True)
    class Config(IntervalConfig):
        interval: int = 1  # steps between checked forwards (steps 0, N, 2N, ...)

    @classmethod
    def check_topology(cls, config: Config, topology: Any) -> None:
        if topology.world_size < 3:
            raise ConfigError(
                "topology", "gather_consensus needs at least 3 ranks for a strict majority"
            )

    @classmethod
    def first_suspect_step(
        cls, config: Config, alarm_step: int, checkpointed: Callable[[int], bool]
    ) -> int:
        """The step before the last checked one before the alarm: its forward's weights agreed,
        so the update of that step is the earliest that could have put a wrong shard in place,
        from optimizer state (Adam's moments) the step before may have left wrong."""
        checked = [s for s in range(alarm_step) if s % config.interval == 0]
        return max(max(checked) - 1, 0) if checked else 0

    def on_gathered(self, step: int, bucket: Bucket) -> None:
        if step % self.config.interval:
            return
        mine = torch.cat([fingerprint_words(t) for _, t in bucket.tensors])
        table = [torch.empty_like(mine) for _ in range(self.info.world_size)]
        dist.all_gather(table, mine)
        inflight.hold(mine, *table)
        rows = torch.stack(table)
        names = [name for name, _ in bucket.tensors]
        index = bucket.index

        def explain(_: list[float]) -> None:
            read = [tuple(r) for r in self.read(rows)]
            majority, count = Counter(read).most_common(1)[0]
            if count * 2 <= len(read):
                evidence = {"group": index, "reason": "no strict majority"}
                self.alert(step, "forward", [], evidence | {"groups": len(set(read))})
                return
            suspects = [r for r, row in enumerate(read) if row != majority]
            differing = sorted(
                {names[i // 2] for r in suspects for i, w in enumerate(read[r]) if w != majority[i]}
            )
            evidence = {"group": index, "tensors": differing[:8], "agree": count}
            self.alert(step, "forward", suspects, evidence)

        self.defer(step, "forward", ~(rows == rows[0]).all(), explain)


DETECTOR = GatherConsensus
