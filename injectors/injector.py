"""The fault injector plug-in: when, where and on which element a fault model strikes.

Sites and what they reach (DESIGN section 3):
    grad       a rank's local gradients before the collective (parameter names; `fault.bucket`
               narrows it to one chunk of the harness's fixed reduction layout, harness/comm.py)
    allreduce  the averaged gradients after it; scope `rank` on the listed ranks, scope
               `reduction` on every receiver alike (the reduction itself was wrong)
    weight     parameters right after the optimizer step (parameter names)
    optimizer  Adam's moments right after the step (`NAME.exp_avg`, `NAME.exp_avg_sq`)
    activation the output of a module in the forward pass (module names)
    loss       the scalar loss before backward (`loss`)
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from harness.plugins import Bucket, EventLog, Plugin, RankInfo, matches
from injectors import bits, model_class

if TYPE_CHECKING:
    from harness.config import FaultConfig

MOMENTS = ("exp_avg", "exp_avg_sq")


def _number(x: float) -> float | str:
    """JSON has no NaN or infinity: non-finite values are written as strings."""
    return x if math.isfinite(x) else str(x)


def targets(site: str, model: nn.Module) -> list[tuple[str, int | None]]:
    """The named tensors a site can reach on `model`, with their sizes where known up front."""
    params = list(model.named_parameters())
    if site == "optimizer":
        return [(f"{n}.{k}", p.numel()) for n, p in params for k in MOMENTS]
    if site == "activation":
        return [(n, None) for n, _ in model.named_modules() if n]
    if site == "loss":
        return [("loss", 1)]
    return [(n, p.numel()) for n, p in params]


def matching(fault: FaultConfig, model: nn.Module) -> list[tuple[str, int | None]]:
    return [(n, size) for n, size in targets(fault.site, model) if matches(n, fault.tensor)]


class _ReplaceValue(torch.autograd.Function):
    """Forward gives the corrupted value; backward passes the gradient through unchanged, as
    when faulty hardware computed one wrong value and everything downstream used it."""

    @staticmethod
    def forward(ctx, clean: torch.Tensor, corrupted: torch.Tensor) -> torch.Tensor:
        return corrupted.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class FaultInjector(Plugin):
    """Injects one fault, pinned to the hardware of the ranks it names and seeded by the trial.

    Elements are chosen from the trial seed alone, so a `reduction` fault corrupts the same
    position on every receiver, and a permanent fault keeps hitting the same unit step after
    step, as a defective core would.
    """

    def __init__(
        self,
        fault: FaultConfig,
        seed: int,
        info: RankInfo,
        log: EventLog,
        model: nn.Module,
        hardware: tuple[int, ...] | None = None,
        data: tuple[tuple[int, ...], ...] | None = None,
    ):
        self.fault = fault
        self.seed = seed
        self.info = info
        self.log = log
        self.model = model_class(fault.model)(fault, random.Random(f"fault-model:{seed}"))
        self.rng = random.Random(f"fault-elements:{seed}")
        self.ber_rng = np.random.default_rng([seed, 0xBE7])
        # The fault lives on the machine that held the rank when the trial started (a spare that
        # took over after a recovery is healthy), or, with `follows: data`, on the micro-batches.
        hardware = hardware or tuple(range(info.world_size))
        if fault.follows == "data":
            mine = set((data or tuple((r,) for r in range(info.world_size)))[info.rank])
        else:
            mine = {hardware[info.rank]}
        self.schedule = [e for e in fault.schedule if e["rank"] in mine]
        if fault.schedule:
            self.active = bool(self.schedule)
        elif fault.scope == "reduction":
            self.active = fault.ranks[0] in hardware
        else:
            self.active = bool(mine & set(fault.ranks))
        self.names = {p: n for n, p in model.named_parameters()}
        # With a bucket named, positions are drawn over that bucket's tensors when it first shows.
        matched = [] if fault.bucket is not None else matching(fault, model)
        self.positions = self._initial_positions(matched)

    def _initial_positions(self, matched: list[tuple[str, int | None]]) -> dict[str, list[int]]:
        """Seeded positions over the matched tensors, concatenated in model order. A module's
        output size is only known in the forward pass: its indices are drawn there."""
        if self.fault.schedule or self.fault.ber or self.fault.select == "largest":
            return {}
        if matched and matched[0][1] is None:
            return {self.rng.choice(sorted(n for n, _ in matched)): []}
        total = sum(size for _, size in matched)
        if self.fault.index is not None:
            flat = range(self.fault.index, self.fault.index + self.fault.elements)
        else:
            flat = sorted(self.rng.sample(range(total), min(self.fault.elements, total)))
        positions: dict[str, list[int]] = {}
        for k in flat:
            for name, size in matched:
                if k < size:
                    positions.setdefault(name, []).append(k)
                    break
                k -= size
        return positions

    def _due(self, step: int) -> bool:
        if not self.active:
            return False
        if self.fault.schedule:
            return any(e["step"] == step for e in self.schedule)
        first = self.fault.steps[0]
        if self.fault.persistence == "transient":
            return step in self.fault.steps
        if self.fault.persistence == "permanent":
            return step >= first
        draw = random.Random(f"fault-intermittent:{self.seed}:{step}").random()
        return step >= first and draw < self.fault.probability

    def _elements(self, step: int, name: str, flat: torch.Tensor) -> list[tuple[int, int | None]]:
        """(index, bit or None) pairs to corrupt in one tensor at this step."""
        fault = self.fault
        if fault.schedule:
            return [
                (e["index"], e.get("bit"))
                for e in self.schedule
                if e["step"] == step and e["tensor"] == name
            ]
        if not matches(name, fault.tensor):
            return []
        if fault.ber:
            width = bits.width(flat.dtype)
            total = flat.numel() * width
            count = int(self.ber_rng.binomial(total, fault.ber))
            return [(k // width, k % width) for k in sorted(self.rng.sample(range(total), count))]
        if name in self.positions and not self.positions[name]:
            count = min(fault.elements, flat.numel())
            self.positions[name] = sorted(self.rng.sample(range(flat.numel()), count))
        return [(i, None) for i in self.positions.get(name, [])]

    def _choose(
        self, step: int, named: list[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor, int, int | None]]:
        """(name, flat tensor, index, bit) to corrupt among the tensors at hand."""
        flats = [(name, tensor.view(-1)) for name, tensor in named]
        if self.fault.select != "largest" or self.fault.schedule:
            return [(n, f, i, b) for n, f in flats for i, b in self._elements(step, n, f)]
        candidates = []
        for name, flat in flats:
            if matches(name, self.fault.tensor):
                top = torch.topk(
                    flat.detach().abs().float(), min(self.fault.elements, flat.numel())
                )
                candidates += [(float(v), name, flat, int(i)) for v, i in zip(*top, strict=True)]
        candidates.sort(key=lambda c: -c[0])
        return [(name, flat, i, None) for _, name, flat, i in candidates[: self.fault.elements]]

    def _inject(self, step: int, named: list[tuple[str, torch.Tensor]]) -> None:
        if not self._due(step):
            return
        with torch.no_grad():
            for name, flat, index, bit in self._choose(step, named):
                self._corrupt(step, name, flat, index, bit)

    def _corrupt(
        self, step: int, name: str, flat: torch.Tensor, index: int, bit: int | None
    ) -> None:
        old, old_bits = float(flat[index]), bits.to_hex(flat, index)
        touched = self.model.corrupt(flat, index, bit)
        new_bits = bits.to_hex(flat, index)
        self.log.emit(
            "inject",
            step=step,
            site=self.fault.site,
            model=self.fault.model,
            tensor=name,
            index=index,
            bit=touched[0] if touched else None,
            bits=touched,
            old=_number(old),
            new=_number(float(flat[index])),
            old_bits=old_bits,
            new_bits=new_bits,
            fired=old_bits != new_bits,
        )

    def _replaced(self, step: int, name: str, value: torch.Tensor) -> torch.Tensor | None:
        """A corrupted copy of a forward value, wired in with a straight-through gradient."""
        if not self._due(step):
            return None
        corrupted = value.detach().clone()
        chosen = self._choose(step, [(name, corrupted)])
        if not chosen:
            return None
        for _, flat, index, bit in chosen:
            self._corrupt(step, name, flat, index, bit)
        return _ReplaceValue.apply(value, corrupted)

    def watches_module(self, name: str) -> bool:
        return self.fault.site == "activation" and self.active and matches(name, self.fault.tensor)

    def on_forward(self, step: int, module: str, output: torch.Tensor) -> torch.Tensor | None:
        return self._replaced(step, module, output)

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor | None:
        if self.fault.site == "loss":
            return self._replaced(step, "loss", loss)
        return None

    def _inject_bucket(self, step: int, bucket: Bucket) -> None:
        if self.fault.bucket is not None:
            if bucket.index != self.fault.bucket:
                return
            if not self.positions:
                sizes = [(n, t.numel()) for n, t in bucket.tensors if matches(n, self.fault.tensor)]
                self.positions = self._initial_positions(sizes)
        self._inject(step, bucket.tensors)

    def on_local_grad(self, step: int, bucket: Bucket) -> None:
        if self.fault.site == "grad":
            self._inject_bucket(step, bucket)

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        if self.fault.site == "allreduce":
            self._inject_bucket(step, bucket)

    def on_optimizer_state(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        if self.fault.site != "optimizer":
            return
        named = [
            (f"{self.names[p]}.{k}", state[k])
            for p, state in optimizer.state.items()
            for k in MOMENTS
            if k in state
        ]
        self._inject(step, named)

    def on_update(self, step: int, model: nn.Module) -> None:
        if self.fault.site == "weight":
            self._inject(step, [(n, p.data) for n, p in model.named_parameters()])


def build(
    fault: FaultConfig,
    seed: int,
    info: RankInfo,
    log: EventLog,
    model: nn.Module,
    hardware: tuple[int, ...],
    data: tuple[tuple[int, ...], ...],
) -> list[Plugin]:
    if fault.clean:
        return []
    return [FaultInjector(fault, seed, info, log, model, hardware, data)]
