"""How a fault reaches its site: one small object per site (`for_site`), implementing only the
plug-in hooks through which that site's tensors pass. `FaultInjector` (injectors/injector.py)
hands every hook to it and keeps what all sites share: when the fault is due, which elements it
takes, the corruption and its events.

Families: module outputs (activation, and matmul inside a module's forward; a defective unit's
products, every one on the rank with its own chance), the loss, gradient
buckets (grad before the collective, allreduce after it, and a contribution model's change to
what a rank sends into it), sharded training's gathered parameters (gather), and state after the
step (optimizer moments, weights).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch
from torch import nn

from harness.core.dtensors import local
from harness.core.events import ContributionInject, LaneInject
from harness.core.matmuls import CONVOLUTIONS, MatmulCall, StepProducts
from harness.core.plugins import Bucket, Plugin, matches
from injectors import bits, sites

if TYPE_CHECKING:
    from injectors.injector import FaultInjector


class Site(Plugin):
    """A site's hooks; those it does not strike at stay Plugin's no-ops."""

    # The phase an element event records: only a matmul fault has two (forward, backward).
    phase: str | None = None

    def __init__(self, injector: FaultInjector, model: nn.Module):
        self.injector = injector
        self.fault = injector.fault


class ModuleOutput(Site):
    """activation: a module's output in the forward pass, replaced by a corrupted copy."""

    def __init__(self, injector: FaultInjector, model: nn.Module):
        super().__init__(injector, model)
        self.first = FirstStrike(self.fault.persistence)

    def watches_module(self, name: str) -> bool:
        return self.injector.active and matches(name, self.fault.tensor)

    def on_forward(self, step: int, module: str, output: torch.Tensor) -> torch.Tensor | None:
        # In a user's loop (no trace of the forward) a glob may name a module whose output is
        # a tuple or integers: nothing there to corrupt, and the row says it never struck.
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        if not self.injector.due(step) or not self.first(step, module):
            return None
        return self.injector.replaced(step, module, output)


class Matmul(Site):
    """matmul: the `fault.product`-th matrix multiply (1-based, in call order, attention's score
    product before its value product) made while the target module's forward (or a child's)
    runs, as the harness's watch of the forward's products hands it over
    (harness/core/matmuls.py): its output replaced, or with `fault.phase=backward` the gradient
    backward computes for its second operand corrupted. Armed by the module's pre-hook when the
    fault is due, disarmed by the strike or by the end of the module's forward. While armed, an
    attention call in the target is computed as its two products even where it would run fused
    (harness/core/attention.py): a fused kernel never forms them."""

    def __init__(self, injector: FaultInjector, model: nn.Module):
        super().__init__(injector, model)
        self.phase = self.fault.phase
        self.first = FirstStrike(self.fault.persistence)
        self.armed: str | None = None
        self.made = 0  # products made in the armed module so far
        # The call whose output a forward fault replaces (by id()), and its target module.
        self.struck: tuple[int, str] | None = None

    def watches_module(self, name: str) -> bool:
        # The module drawn, or one that a schedule's entry names (a schedule draws none).
        scheduled = any(e["tensor"] == name for e in self.injector.schedule)
        return self.injector.active and (name in self.injector.positions or scheduled)

    def watches_matmuls(self) -> bool:
        return self.injector.active

    def expands_attention(self, step: int, stack: tuple[str, ...]) -> bool:
        return self.armed is not None and self.armed in stack

    def on_forward_pre(self, step: int, module: str) -> None:
        if self.injector.due(step) and self.first(step, module):
            self.armed, self.made = module, 0

    def on_forward(self, step: int, module: str, output: torch.Tensor) -> torch.Tensor | None:
        self.armed = None
        return None

    def on_matmul_operands(self, step: int, call: MatmulCall) -> None:
        module = self.armed
        if module is None or module not in call.stack:
            return
        self.made += 1
        if self.made != self.fault.product:
            return
        self.armed = None
        if self.phase == "forward":
            self.struck = (id(call), module)
            return
        injector = self.injector

        def corrupt(grad: torch.Tensor) -> None:
            injector.corrupt(step, [(module, grad)])

        call.args[call.second] = sites.CorruptGrad.apply(call.args[call.second], corrupt)

    def on_matmul_output(
        self, step: int, call: MatmulCall, output: torch.Tensor
    ) -> torch.Tensor | None:
        if self.struck is None or self.struck[0] != id(call):
            return None
        module, self.struck = self.struck[1], None
        return self.injector.replaced(step, module, output)


class Unit(Site):
    """matmul with a per-product model (defective_unit): from the fault's first step, every
    product the rank's forward makes in the targeted modules is struck with probability
    `rate`, drawn from the trial's seed, the rank's machine, the step and the product's place in
    the step (so a run and its repeat strike the same products). A forward that a check runs
    again on this rank (replay, titan_replay) makes products too, on the same broken unit: they
    count on and are struck as any other. While due, attention runs as its two products, which
    the unit computes too (harness/core/attention.py). One event per struck product."""

    phase = "forward"

    def __init__(self, injector: FaultInjector, model: nn.Module):
        super().__init__(injector, model)
        self.rate = self.fault.settings.rate
        self.machine = injector.hardware[injector.info.rank]
        self.step, self.made = -1, 0  # products made in the step so far
        self.products = StepProducts()  # and where each stands, as matmul_checksum names it
        # The call being struck (by id()), the module that made it and its place among the
        # products made while that module ran (StepProducts): products run one at a time,
        # operands hook, product, output hook.
        self.hit: tuple[int, str, int] | None = None

    def watches_matmuls(self) -> bool:
        return self.injector.active

    def expands_attention(self, step: int, stack: tuple[str, ...]) -> bool:
        return self.injector.due(step)

    def on_matmul_operands(self, step: int, call: MatmulCall) -> None:
        self.hit = None
        if not self.injector.due(step):
            return
        tensor = self.fault.tensor
        if tensor != "*" and not any(matches(m, tensor) for m in call.stack):
            return
        if step != self.step:
            self.step, self.made = step, 0
        self.made += 1
        module, place = self.products.place(step, call.stack)
        seed = f"defective-unit:{self.injector.seed}:{self.machine}:{step}:{self.made}"
        if random.Random(seed).random() < self.rate:
            self.hit = (id(call), module, place)

    def on_matmul_output(
        self, step: int, call: MatmulCall, output: torch.Tensor
    ) -> torch.Tensor | None:
        if self.hit is None or self.hit[0] != id(call):
            return None
        (_, module, place), self.hit = self.hit, None
        corrupted = output.detach().clone()
        # A convolution's columns are its output channels; a product's, its last dimension.
        dim = 1 if call.func in CONVOLUTIONS else -1
        bit, elements = self.injector.model.corrupt_lane(corrupted, dim)
        settings = self.fault.settings
        self.injector.log.emit(LaneInject(
            step=step, site=self.fault.site, model=self.fault.model, tensor=module,
            product=place, bit=bit, lane=settings.lane, lanes=settings.lanes, elements=elements,
            old_norm=sites.number(float(output.detach().double().norm())),
            new_norm=sites.number(float(corrupted.double().norm())), fired=elements > 0,
            dtype=bits.format_name(output.dtype),
        ))  # fmt: skip
        return sites.ReplaceValue.apply(output, corrupted)


class Loss(Site):
    """loss: the scalar loss before backward."""

    def __init__(self, injector: FaultInjector, model: nn.Module):
        super().__init__(injector, model)
        self.first = FirstStrike(self.fault.persistence)

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor | None:
        if not self.injector.due(step) or not self.first(step, "loss"):
            return None
        return self.injector.replaced(step, "loss", loss)


class FirstStrike:
    """A transient fault strikes a step's work at one place once: a repeat of that work in the
    step runs clean (a reduction the harness re-runs, harness/runtime/comm.py retry_reduction; a
    later micro-batch's forward; a check's recomputation on this rank, replay's or
    titan_replay's, which would otherwise carry the upset into the evidence against it). A
    fault that persists is a broken unit: it strikes every time."""

    def __init__(self, persistence: str):
        self.transient = persistence == "transient"
        self.struck: set[tuple[int, int | str]] = set()

    def __call__(self, step: int, place: int | str) -> bool:
        if not self.transient:
            return True
        first = (step, place) not in self.struck
        self.struck.add((step, place))
        return first


class Buckets(Site):
    """Gradient chunks of the harness's fixed reduction layout (harness/runtime/comm.py)."""

    def inject_bucket(self, step: int, bucket: Bucket) -> None:
        """With `fault.bucket` named, only that chunk is struck, and positions are drawn over its
        tensors when it first shows (the injector drew none up front)."""
        injector = self.injector
        if self.fault.bucket is not None:
            if bucket.index != self.fault.bucket:
                return
            if not injector.positions:
                sizes = [(n, t.numel()) for n, t in bucket.tensors if matches(n, self.fault.tensor)]
                injector.positions = injector.initial_positions(sizes)
        injector.inject(step, bucket.tensors)


class Gradients(Buckets):
    """grad: a rank's local gradients, chunk by chunk, before the collective."""

    def on_local_grad(self, step: int, bucket: Bucket) -> None:
        self.inject_bucket(step, bucket)


class Reduced(Buckets):
    """allreduce: the averaged gradients after the collective, or its rider region (`riders`)."""

    def __init__(self, injector: FaultInjector, model: nn.Module):
        super().__init__(injector, model)
        self.first = FirstStrike(self.fault.persistence)

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        if not self.first(step, bucket.index) or not self._receives(bucket):
            return
        if self.fault.tensor == sites.RIDERS:
            named = self.fault.bucket in (None, bucket.index)  # every chunk's, or the one named
            if bucket.rider_region is not None and named:
                self.injector.inject(step, [(sites.RIDERS, bucket.rider_region)])
            return
        self.inject_bucket(step, bucket)

    def _receives(self, bucket: Bucket) -> bool:
        """Under sharding a reduction delivers each shard to its own receivers: a wrong one
        (scope `reduction`) reaches the rank in `fault.ranks` and, under HSDP, the rank at the
        same place in every other replica group (shard groups are consecutive ranks)."""
        if self.fault.scope != "reduction" or bucket.shards == 1:
            return True
        hardware = self.injector.hardware
        if self.fault.ranks[0] not in hardware:  # the broken node was quarantined
            return False
        return hardware.index(self.fault.ranks[0]) % bucket.shards == bucket.shard


class Gathered(Buckets):
    """gather: one FSDP group's parameters as all-gathered into this rank's forward weights;
    the shards they were gathered from, and every other rank's copy, stay intact. Each
    micro-batch's forward gathers them again: a transient fault strikes the first."""

    def __init__(self, injector: FaultInjector, model: nn.Module):
        super().__init__(injector, model)
        self.first = FirstStrike(self.fault.persistence)

    def on_gathered(self, step: int, bucket: Bucket) -> None:
        if self.first(step, bucket.index):
            self.inject_bucket(step, bucket)


class Contribution(Site):
    """allreduce with a contribution model (drop, duplicate, stale): what this rank sends into
    each chunk's reduction, rider region included, so every receiver gets the same wrong sum.
    One compact event per chunk: how many elements changed, the L2 norms before and after."""

    def __init__(self, injector: FaultInjector, model: nn.Module):
        super().__init__(injector, model)
        self.first = FirstStrike(self.fault.persistence)
        self.stale = self.fault.model == "stale"
        # Per chunk: (step, genuine contribution) of the latest step sent and of the one before.
        self.sent: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self.previous: dict[int, list[torch.Tensor]] = {}

    def on_contribution(self, step: int, index: int, parts: list[torch.Tensor]) -> None:
        injector = self.injector
        if not injector.active:
            return
        if self.fault.bucket is not None and index != self.fault.bucket:
            return
        if not self.first(step, index):
            return
        if self.stale:
            self._remember(step, index, parts)
        if not injector.due(step):
            return
        old = torch.cat([p.reshape(-1) for p in parts]).clone()
        if injector.model.contribute(parts, self.previous.get(index)) is None:
            return
        new = torch.cat([p.reshape(-1) for p in parts])
        changed = int((old != new).sum() - (old.isnan() & new.isnan()).sum())
        group = injector.group
        injector.log.emit(ContributionInject(
            step=step, site=self.fault.site, model=self.fault.model,
            tensor=f"bucket{index}", bucket=index, elements=old.numel(), changed=changed,
            old_norm=float(old.double().norm()), new_norm=float(new.double().norm()),
            from_step=step - 1 if self.stale else None, fired=changed > 0,
            group=None if group is None else list(group),
        ))  # fmt: skip

    def _remember(self, step: int, index: int, parts: list[torch.Tensor]) -> None:
        """Keep this step's genuine contribution; the one of the step before becomes
        `previous`. A re-run of the step's reduction (retry, sub-groups) sends the same."""
        latest = self.sent.get(index)
        if latest is not None and latest[0] < step:
            self.previous[index] = latest[1]
        if latest is None or latest[0] < step:
            self.sent[index] = (step, [p.clone() for p in parts])


class OptimizerState(Site):
    """optimizer: Adam's moments right after the step, named `PARAM.exp_avg`, `PARAM.exp_avg_sq`."""

    def __init__(self, injector: FaultInjector, model: nn.Module):
        super().__init__(injector, model)
        # The optimizer's state is keyed by parameter; the fault names parameters by name.
        self.names = {p: n for n, p in model.named_parameters()}

    def on_optimizer_state(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        # A sharded parameter's moments: this rank's own shard of them.
        named = [
            (f"{self.names[p]}.{k}", local(state[k]))
            for p, state in optimizer.state.items()
            for k in sites.MOMENTS
            if k in state
        ]
        self.injector.inject(step, named)


class Weights(Site):
    """weight: the parameters right after the optimizer step."""

    def on_update(self, step: int, model: nn.Module) -> None:
        # A sharded parameter: this rank's own shard.
        self.injector.inject(step, [(n, local(p.data)) for n, p in model.named_parameters()])


BY_SITE: dict[str, type[Site]] = {
    "grad": Gradients,
    "allreduce": Reduced,
    "gather": Gathered,
    "weight": Weights,
    "optimizer": OptimizerState,
    "activation": ModuleOutput,
    "loss": Loss,
    "matmul": Matmul,
}


def for_site(injector: FaultInjector, model: nn.Module) -> Site:
    # A contribution model is only valid at site allreduce (injectors/contribution.py): it acts
    # on what is sent, never on the reduced result.
    if injector.model.per_product:
        return Unit(injector, model)
    kind = Contribution if injector.model.contribution else BY_SITE[injector.fault.site]
    return kind(injector, model)
