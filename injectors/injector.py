"""The fault injector plug-in: when, where and on which element a fault model strikes."""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

import torch
from torch import nn

from harness.plugins import Bucket, EventLog, Plugin, RankInfo, matches
from injectors import bits, model_class

if TYPE_CHECKING:
    from harness.config import FaultConfig


def _number(x: float) -> float | str:
    """JSON has no NaN or infinity: non-finite values are written as strings."""
    return x if math.isfinite(x) else str(x)


class FaultInjector(Plugin):
    """Injects one fault (DESIGN section 5: pinned to the rank's hardware, seeded by the trial).

    The same elements are chosen on every rank from the trial seed alone, so a `reduction` scope
    fault corrupts the same position on every receiver, and a permanent fault keeps hitting the
    same unit step after step.
    """

    def __init__(
        self,
        fault: FaultConfig,
        seed: int,
        info: RankInfo,
        log: EventLog,
        targets: list[tuple[str, int]],
    ):
        self.fault = fault
        self.seed = seed
        self.log = log
        reduction = fault.scope == "reduction"
        self.active = reduction or info.rank in fault.ranks
        rng = random.Random(f"fault-elements:{seed}")
        self.model = model_class(fault.model)(fault, random.Random(f"fault-model:{seed}"))
        self.positions = _choose_elements(fault, targets, rng)

    def _due(self, step: int) -> bool:
        first = self.fault.steps[0]
        if self.fault.persistence == "transient":
            return step in self.fault.steps
        if self.fault.persistence == "permanent":
            return step >= first
        draw = random.Random(f"fault-intermittent:{self.seed}:{step}").random()
        return step >= first and draw < self.fault.probability

    def _inject(self, step: int, named: list[tuple[str, torch.Tensor]]) -> None:
        if not (self.active and self._due(step)):
            return
        tensors = dict(named)
        with torch.no_grad():
            for name, index in self.positions:
                if name not in tensors:
                    continue
                flat = tensors[name].view(-1)
                old, old_bits = float(flat[index]), bits.to_hex(flat, index)
                bit = self.model.corrupt(flat, index)
                new_bits = bits.to_hex(flat, index)
                self.log.emit(
                    "inject",
                    step=step,
                    site=self.fault.site,
                    model=self.fault.model,
                    tensor=name,
                    index=index,
                    bit=bit,
                    old=_number(old),
                    new=_number(float(flat[index])),
                    old_bits=old_bits,
                    new_bits=new_bits,
                    fired=old_bits != new_bits,
                )

    def on_local_grad(self, step: int, bucket: Bucket) -> None:
        if self.fault.site == "grad":
            self._inject(step, bucket.tensors)

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        if self.fault.site == "allreduce":
            self._inject(step, bucket.tensors)

    def on_update(self, step: int, model: nn.Module) -> None:
        if self.fault.site == "weight":
            self._inject(step, [(n, p.data) for n, p in model.named_parameters()])


def _choose_elements(
    fault: FaultConfig, targets: list[tuple[str, int]], rng: random.Random
) -> list[tuple[str, int]]:
    """Flat positions over the matching tensors, concatenated in model order."""
    matched = [(name, numel) for name, numel in targets if matches(name, fault.tensor)]
    total = sum(numel for _, numel in matched)
    if fault.index is not None:
        flat = range(fault.index, fault.index + fault.elements)
    else:
        flat = sorted(rng.sample(range(total), min(fault.elements, total)))
    positions = []
    for k in flat:
        for name, numel in matched:
            if k < numel:
                positions.append((name, k))
                break
            k -= numel
    return positions


def build(
    fault: FaultConfig, seed: int, info: RankInfo, log: EventLog, model: nn.Module
) -> list[Plugin]:
    if fault.clean:
        return []
    targets = [(name, p.numel()) for name, p in model.named_parameters()]
    return [FaultInjector(fault, seed, info, log, targets)]


def target_size(fault: FaultConfig, model: nn.Module) -> int:
    """How many elements the fault's tensor glob covers on this model (0: it matches nothing)."""
    return sum(p.numel() for n, p in model.named_parameters() if matches(n, fault.tensor))
