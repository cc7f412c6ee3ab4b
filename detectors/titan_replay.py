"""`titan_replay`: torchtitan's deterministic replay for silent data corruption, as published.

torchtitan's SDC replay (pytorch/torchtitan pull requests 4324 and 4333, `SDCReplayer`, with
`--debug.deterministic`): on a checked optimizer step each rank snapshots its state, runs the
step's first forward and backward as the reference, restores the snapshot and runs it again
(`num_replays` times), and compares signatures (loss, local parameter gradients, buffers, RNG
state) before the optimizer may see them; a mismatch raises on the rank. Its schedule is
`num_steps` (the first N optimizer steps of the run; -1: every step), not an interval. The
signature is exact on bits and order-insensitive (an XOR fold of each tensor's words), so
deterministic compute is required, and a deterministic fault that strikes the replay the same
way, or a change that leaves the XOR fold alone (two elements swapped within a tensor, the same
bit flipped in two elements), is not seen.

Here the reference is the step that trained: the local gradients as the comm hook sees them
before the collective, and the losses. The replay recomputes them with torch.autograd.grad
(param.grad is never touched), each micro-batch under its own random state in forked generators,
so training is undisturbed. The suspect is the rank itself. The micro-batches come from
`ctx.replay_data` as replay's do: regenerated in campaigns; in a user's loop, those the rank kept
with `guard.audit_batch` (nothing is shipped: each rank replays its own).

Cost per step (sdc-plan): bytes = B*N*r, flops = 0, train = 6*N*t*r: on a checked step, the
step's forward and backward again and an XOR fold of the gradients, `num_replays` (r) times.
Priced as checking every step (num_steps -1): with the default num_steps 1 a long job pays it
once, so for such a job the estimate is an upper bound (the symbols:
harness/analysis/estimates.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from detectors.replay import Regenerated, as_sent, gradients, trainable
from harness.core.checks import CheckConfig
from harness.core.plugins import Bucket, Detector, DetectorContext, EventLog
from harness.core.values import integer
from harness.errors import ConfigError


def xor_digest(tensor: torch.Tensor) -> int:
    """The XOR of a tensor's 32-bit words (16-bit dtypes zero-padded to whole words)."""
    raw = tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, dtype=np.uint8)])
    return int(np.bitwise_xor.reduce(raw.view(np.uint32)))


class TitanReplay(Detector):
    name = "titan_replay"
    recomputes_batches = True
    parallel = ("ddp", "fsdp", "hsdp")

    @dataclass(frozen=True)
    class Config(CheckConfig):
        num_steps: int = 1  # the first N steps are replayed; -1: every step
        num_replays: int = 1

        def __post_init__(self) -> None:
            super().__post_init__()
            steps = self.num_steps
            if isinstance(steps, bool) or not isinstance(steps, int) or (steps < 1 and steps != -1):
                raise ConfigError(
                    "num_steps", f"'{steps}' is not allowed; allowed: 1..inf, or -1 (every step)"
                )
            integer("num_replays", self.num_replays, 1)

    @classmethod
    def looks_from(cls, config: Config, start_step: int) -> bool:
        return config.num_steps == -1 or start_step < config.num_steps

    def __init__(self, config: Config, ctx: DetectorContext, log: EventLog):
        super().__init__(config, ctx, log)
        self.data = ctx.replay_data or Regenerated(ctx)
        self.losses: list[float] = []
        self.grads: dict[str, int] = {}
        self.divided_by: float = 1

    def _checked(self, step: int) -> bool:
        return self.config.num_steps == -1 or step < self.config.num_steps

    def on_loss(self, step: int, loss: torch.Tensor) -> None:
        if self._checked(step):
            self.losses.append(loss.item())
        return None

    def on_local_grad(self, step: int, bucket: Bucket) -> None:
        if self._checked(step):
            self.divided_by = bucket.divided_by
            self.grads |= {name: xor_digest(g) for name, g in bucket.tensors}

    def _replay(self, model: nn.Module, step: int) -> tuple[list[float], dict[str, int]]:
        named = trainable(model)
        losses, grads = [], None
        # Each micro-batch under the random state it trained under, its backward inside it.
        for loss in self.data.losses(model, step, self.info.rank):
            backward = self.data.backpropagated(loss, self.info.rank)
            part = gradients(backward, [p for _, p in named])
            grads = (
                list(part) if grads is None else [a + b for a, b in zip(grads, part, strict=True)]
            )
            losses.append(loss.item())
        sent = as_sent(grads, self.divided_by)
        return losses, {n: xor_digest(g) for (n, _), g in zip(named, sent, strict=True)}

    def on_audit(self, step: int) -> None:
        if not self._checked(step):
            return
        reference = (self.losses, self.grads)
        self.losses, self.grads = [], {}
        model = self.ctx.replica(step)
        for _ in range(self.config.num_replays):
            replay = self._replay(model, step)
            if replay != reference:
                differing = sorted(n for n in reference[1] if reference[1][n] != replay[1].get(n))
                evidence = {"losses_equal": replay[0] == reference[0], "tensors": differing[:8]}
                self.alert(step, "audit", [self.info.rank], evidence)
                return


DETECTOR = TitanReplay
