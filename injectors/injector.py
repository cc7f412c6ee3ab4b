"""The fault injector plug-in: when, where and on which element a fault model strikes.

Sites and what they reach (docs/design.md, section 3):
    grad       a rank's local gradients before the collective (parameter names; `fault.bucket`
               narrows it to one chunk of the harness's fixed reduction layout,
               harness/runtime/comm.py)
    allreduce  the averaged gradients after it; scope `rank` on the listed ranks, scope
               `reduction` on every receiver alike (the reduction itself was wrong)
    weight     parameters right after the optimizer step (parameter names)
    optimizer  Adam's moments right after the step (`NAME.exp_avg`, `NAME.exp_avg_sq`)
    activation the output of a module in the forward pass (module names)
    loss       the scalar loss before backward (`loss`)
    matmul     the first matrix multiply in a module's forward (modules in whose forward one
               runs, harness/core/matmuls.py): its output, or with `fault.phase=backward` the
               gradient its backward computes for its second operand (a Linear's weight), as a
               broken tensor core would

A campaign draws activation and matmul targets only among the modules its workload's forward
runs (`forward`, traced once when the config is validated); a user's loop, whose forward the
harness has not run, among every module that could.

At site allreduce the rider region (the float32 numbers summed with each chunk,
harness/runtime/comm.py) is a target named `riders`; only that exact name reaches it, so a
glob's draws over parameters stay what they were. `fault.bucket` narrows it to one chunk's
region, and `fault.index` places the elements in it (its size is known when it is at hand).
The contribution models (drop, duplicate, stale) change what the faulty ranks send into the
reduction, rider region included, so every receiver gets the same wrong sum.

Each site's hooks live in an object of its own (injectors/strikes.py), chosen once per fault;
the injector hands every hook to it and keeps what all sites share.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from harness.core.events import ElementInject
from harness.core.matmuls import ForwardModules, MatmulCall
from harness.core.plugins import Bucket, EventLog, Plugin, RankInfo, matches
from injectors import bits, model_class, sites, strikes

if TYPE_CHECKING:
    from harness.config.schema import FaultConfig


# A tensor's name and the (index, bit) picks struck in it: what a persisting fault keeps
# striking, as one broken unit.
Unit = tuple[str, tuple[tuple[int, int | None], ...]]


class FaultInjector(Plugin):
    """Injects one fault, pinned to the hardware of the ranks it names and seeded by the trial.

    Elements are chosen from the trial seed alone, so a `reduction` fault corrupts the same
    position on every receiver, and a permanent fault keeps hitting the same unit step after
    step, as a defective core would: the same elements, and the same bits of them.
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
        forward: ForwardModules | None = None,
        keep: Callable[[], None] | None = None,
    ):
        self.fault = fault
        # Makes the rank's events so far durable where the parent reads them when the rank
        # returns none (a fatal model's strike); None where no parent reads them.
        self.keep = keep
        self.seed = seed
        self.info = info
        self.log = log
        self.model = model_class(fault.model)(fault, random.Random(f"fault-model:{seed}"))
        self.rng = random.Random(f"fault-elements:{seed}")
        self.ber_rng = np.random.default_rng([seed, 0xBE7])
        # The fault lives on the machine that held the rank when the trial started (a spare that
        # took over after a recovery is healthy), or, with `follows: data`, on the micro-batches.
        hardware = hardware or tuple(range(info.world_size))
        self.hardware = hardware
        if fault.follows == "data":
            mine = set((data or tuple((r,) for r in range(info.world_size)))[info.rank])
        else:
            mine = {hardware[info.rank]}
        self.schedule = [e for e in fault.schedule if e["rank"] in mine]
        if fault.schedule:
            self.active = bool(self.schedule)
        elif fault.scope == "reduction" and not self.model.contribution:
            self.active = fault.ranks[0] in hardware
        else:
            self.active = bool(mine & set(fault.ranks))
        # With a bucket named, positions are drawn over that bucket's tensors when it first shows
        # (the rider region's, as without one, where it is at hand).
        in_bucket = fault.bucket is not None and fault.tensor != sites.RIDERS
        matched = [] if in_bucket else sites.matching(fault, model, forward)
        self.positions = self.initial_positions(matched)
        # The world ranks of a sub-group reduction under way (harness/runtime/locate.py), else None.
        self.group: tuple[int, ...] | None = None
        # The hooks of the fault's site, with that site's own state.
        self.site = strikes.for_site(self, model)
        # The model's random state at its first strike on each tensor's elements (`_redraw`).
        self.first_draws: dict[Unit, tuple] = {}
        # The bits a persisting fault's first strike left in carried-over state (`_hold`).
        self.holds: dict[Unit, list[list[tuple[int, int]]]] = {}
        # A persisting `largest` fault's elements, by the tensors at hand when it first struck.
        self.largest: dict[tuple[str, ...], list[tuple[str, int]]] = {}
        # A persisting bit error rate's (index, bit) picks, by tensor and size, from its first
        # strike: one broken unit's cells, not fresh bits at every step.
        self.ber_picks: dict[tuple[str, int], list[tuple[int, int | None]]] = {}

    def initial_positions(self, matched: list[tuple[str, int | None]]) -> dict[str, list[int]]:
        """Seeded positions over the matched tensors, concatenated in model order. A module's
        output size is only known in the forward pass: its indices are drawn there."""
        if self.fault.schedule or self.fault.ber:
            return {}
        names = sorted(n for n, _ in matched)
        if self.fault.select == "largest" and self.fault.site not in sites.MODULE_SITES:
            # Every tensor it names; the elements are chosen where the values are known.
            return {name: [] for name in names}
        if matched and matched[0][1] is None:
            # Sizes unknown up front (a module's output, a rank's shard): one tensor is drawn, its
            # elements where it is at hand. The module holding a forward's largest value is
            # unknown before the forward runs: `largest` takes the largest of the one drawn.
            return {self.rng.choice(names): []}
        total = sum(size for _, size in matched)
        if self.model.grouped and total:
            k = self.fault.index if self.fault.index is not None else self.rng.randrange(total)
            for name, size in matched:
                if k < size:
                    return {name: self.model.group(size, k, self.rng)}
                k -= size
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

    def due(self, step: int) -> bool:
        if not self.active:
            return False
        if self.fault.schedule:
            return any(e["step"] == step for e in self.schedule)
        if self.fault.persistence == "transient":
            return step in self.fault.steps
        first = self.fault.steps[0]
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
            picks = self.ber_picks.get((name, flat.numel()))
            if picks is None:
                width = bits.width(flat.dtype)
                total = flat.numel() * width
                count = int(self.ber_rng.binomial(total, fault.ber))
                drawn = sorted(self.rng.sample(range(total), count))
                picks = [(k // width, k % width) for k in drawn]
                if fault.persistence != "transient":
                    self.ber_picks[name, flat.numel()] = picks
            return picks
        if name in self.positions and not self.positions[name]:
            n = flat.numel()
            if self.model.grouped:
                first = (
                    min(fault.index, n - 1) if fault.index is not None else self.rng.randrange(n)
                )
                self.positions[name] = self.model.group(n, first, self.rng)
            elif fault.index is not None:  # the rider region, its size known when at hand
                first = min(fault.index, n - 1)
                self.positions[name] = list(range(first, min(first + fault.elements, n)))
            else:
                self.positions[name] = sorted(self.rng.sample(range(n), min(fault.elements, n)))
        return [(i, None) for i in self.positions.get(name, [])]

    def _choose(
        self, step: int, named: list[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor, int, int | None]]:
        """(name, flat tensor, index, bit) to corrupt among the tensors at hand."""
        flats = [(name, tensor.view(-1)) for name, tensor in named]
        if self.fault.select != "largest" or self.fault.schedule:
            return [(n, f, i, b) for n, f in flats for i, b in self._elements(step, n, f)]
        # A fault that persists is one broken unit: the elements its first strike took among
        # these tensors, not the largest of the moment (a new cell broken at every strike).
        at_hand = dict(flats)
        kept = self.largest.get(tuple(at_hand))
        if kept is not None and all(i < at_hand[name].numel() for name, i in kept):
            return [(name, at_hand[name], i, None) for name, i in kept]
        candidates = []
        for name, flat in flats:
            if name in self.positions:
                top = torch.topk(
                    flat.detach().abs().float(), min(self.fault.elements, flat.numel())
                )
                candidates += [(float(v), name, flat, int(i)) for v, i in zip(*top, strict=True)]
        candidates.sort(key=lambda c: -c[0])
        chosen = [(name, flat, i, None) for _, name, flat, i in candidates[: self.fault.elements]]
        if self.fault.persistence != "transient":
            self.largest[tuple(at_hand)] = [(name, i) for name, _, i, _ in chosen]
        return chosen

    def inject(self, step: int, named: list[tuple[str, torch.Tensor]]) -> None:
        """Corrupt the tensors at hand in place, when the fault is due at this step."""
        if self.due(step):
            self.corrupt(step, named)

    def corrupt(self, step: int, named: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self._corrupt_all(step, self._choose(step, named))

    def _corrupt_all(
        self, step: int, chosen: list[tuple[str, torch.Tensor, int, int | None]]
    ) -> None:
        """Corrupt the chosen elements tensor by tensor (a grouped model sees its whole group);
        one event per element, with its value and bits before and after."""
        by_tensor: dict[str, tuple[torch.Tensor, list[tuple[int, int | None]]]] = {}
        for name, flat, index, bit in chosen:
            by_tensor.setdefault(name, (flat, []))[1].append((index, bit))
        for name, (flat, picks) in by_tensor.items():
            before = [(float(flat[i]), bits.to_hex(flat, i)) for i, _ in picks]
            if self.model.fatal:
                self._fatal(step, name, flat, picks[0][0], *before[0])
            unit = (name, tuple(picks))  # the elements a persisting fault keeps striking
            self._redraw(unit)
            touched = self._held(unit, flat)
            if touched is None:
                touched = self.model.corrupt_many(flat, picks)
                self._hold(unit, flat, touched)
            # One event per element: a rate's bits may land several in one element.
            struck: dict[int, tuple[float, str, list[int] | None]] = {}
            for (index, _), (old, old_bits), hit in zip(picks, before, touched, strict=True):
                if index in struck:  # only a rate's bits repeat an element, each a list
                    struck[index][2].extend(hit or [])
                else:
                    struck[index] = (old, old_bits, None if hit is None else list(hit))
            for index, (old, old_bits, hit) in struck.items():
                self._record(step, name, flat, index, old, old_bits, hit)

    def _hold(self, unit: Unit, flat: torch.Tensor, touched: list[list[int] | None]) -> None:
        """After a persisting fault's first strike on state that carries over (weights,
        moments): the bits it left, which a broken cell holds. A second flip of them would
        undo the first."""
        if self.fault.persistence == "transient" or self.fault.site not in sites.STATE_SITES:
            return
        if any(hit is None for hit in touched):  # not a fault of bits (scale, value, swap)
            return
        self.holds[unit] = [
            [(b, bits.pattern(flat, index) >> b & 1) for b in hit]
            for (index, _), hit in zip(unit[1], touched, strict=True)
        ]

    def _held(self, unit: Unit, flat: torch.Tensor) -> list[list[int] | None] | None:
        """At a later strike, the held bits set back where the update changed them (none
        changes: the strike does not fire); None before the first strike."""
        held = self.holds.get(unit)
        if held is None:
            return None
        for (index, _), values in zip(unit[1], held, strict=True):
            for b, value in values:
                if bits.pattern(flat, index) >> b & 1 != value:
                    bits.flip(flat, index, b)
        return [[b for b, _ in values] for values in held]

    def _redraw(self, unit: Unit) -> None:
        """Before the model corrupts a unit's elements: a fault that persists is one broken
        unit, so at every strike on the same elements the model draws what it drew at its first
        (a bit of the class `fault.bit` names, the extra bits of `fault.nbits`, a random value),
        from the trial's seed; an intermittent fault strikes at other steps, not other bits. A
        transient fault draws anew at each of its steps."""
        if self.fault.persistence == "transient":
            return
        first = self.first_draws.setdefault(unit, self.model.rng.getstate())
        self.model.rng.setstate(first)

    def _fatal(
        self, step: int, name: str, flat: torch.Tensor, index: int, old: float, old_bits: str
    ) -> None:
        """A fatal model strikes at its first element: the rank goes down there, changing no
        value, and the row must still say the fault struck, where and when."""
        self._record(step, name, flat, index, old, old_bits, None, fatal=True)
        if self.keep is not None:
            self.keep()

    def _record(
        self,
        step: int,
        name: str,
        flat: torch.Tensor,
        index: int,
        old: float,
        old_bits: str,
        touched: list[int] | None,
        fatal: bool = False,
    ) -> None:
        new_bits = bits.to_hex(flat, index)
        self.log.emit(
            ElementInject(
                step=step,
                site=self.fault.site,
                model=self.fault.model,
                tensor=name,
                index=index,
                bit=touched[0] if touched else None,
                bits=touched,
                old=sites.number(old),
                new=sites.number(float(flat[index])),
                old_bits=old_bits,
                new_bits=new_bits,
                fired=fatal or old_bits != new_bits,
                phase=self.site.phase,
                product=self.fault.product if self.fault.site == "matmul" else None,
                group=None if self.group is None else list(self.group),
                dtype=bits.format_name(flat.dtype),
            )
        )

    def replaced(self, step: int, name: str, value: torch.Tensor) -> torch.Tensor | None:
        """A corrupted copy of a forward value, wired in with a straight-through gradient."""
        if not self.due(step):
            return None
        corrupted = value.detach().clone()
        chosen = self._choose(step, [(name, corrupted)])
        if not chosen:
            return None
        self._corrupt_all(step, chosen)
        return sites.ReplaceValue.apply(value, corrupted)

    # The plug-in hooks: each goes to the site's object, which implements those of its site.
    def watches_module(self, name: str) -> bool:
        return self.site.watches_module(name)

    def on_forward_pre(self, step: int, module: str) -> None:
        self.site.on_forward_pre(step, module)

    def on_forward(self, step: int, module: str, output: torch.Tensor) -> torch.Tensor | None:
        return self.site.on_forward(step, module, output)

    def watches_matmuls(self) -> bool:
        return self.site.watches_matmuls()

    def on_matmul_operands(self, step: int, call: MatmulCall) -> None:
        self.site.on_matmul_operands(step, call)

    def on_matmul_output(
        self, step: int, call: MatmulCall, output: torch.Tensor
    ) -> torch.Tensor | None:
        return self.site.on_matmul_output(step, call, output)

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor | None:
        return self.site.on_loss(step, loss)

    def on_local_grad(self, step: int, bucket: Bucket) -> None:
        self.site.on_local_grad(step, bucket)

    def on_contribution(self, step: int, index: int, parts: list[torch.Tensor]) -> None:
        self.site.on_contribution(step, index, parts)

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        self.site.on_reduced_grad(step, bucket)

    def on_gathered(self, step: int, bucket: Bucket) -> None:
        self.site.on_gathered(step, bucket)

    def on_group_contribution(
        self, step: int, index: int, parts: list[torch.Tensor], members: tuple[int, ...]
    ) -> None:
        """This rank's contribution to a reduction over the world ranks `members` alone
        (harness/runtime/locate.py): a contribution model changes it as it changes any other."""
        self.group = members
        try:
            self.on_contribution(step, index, parts)
        finally:
            self.group = None

    def on_group_reduced(self, step: int, bucket: Bucket, members: tuple[int, ...]) -> None:
        """The result of a reduction over `members` alone: a fault of the reduction strikes it
        only when the node it lives on (`fault.ranks`) takes part."""
        if self.fault.scope != "reduction" or self.fault.ranks[0] not in {
            self.hardware[r] for r in members
        }:
            return
        self.group = members
        try:
            self.on_reduced_grad(step, bucket)
        finally:
            self.group = None

    def on_optimizer_state(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        self.site.on_optimizer_state(step, optimizer)

    def on_update(self, step: int, model: nn.Module) -> None:
        self.site.on_update(step, model)


def build(
    fault: FaultConfig,
    seed: int,
    info: RankInfo,
    log: EventLog,
    model: nn.Module,
    hardware: tuple[int, ...] | None,
    data: tuple[tuple[int, ...], ...] | None,
    forward: ForwardModules | None = None,
    keep: Callable[[], None] | None = None,
) -> list[Plugin]:
    if fault.clean:
        return []
    return [FaultInjector(fault, seed, info, log, model, hardware, data, forward, keep)]
