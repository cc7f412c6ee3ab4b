"""The plug-in interface: the trainer knows these hook points, never a concrete plug-in.

Injectors and detectors both subclass `Plugin` and implement only the hooks they need. At each
hook point every injector runs before every detector, so a check always sees the corruption
injected at its own site. Detectors get an `alert` callback and nothing else from the harness:
they never see the fault plan.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from harness.core.checks import CheckConfig
from harness.core.dtensors import is_dtensor, whole
from harness.core.events import Alert, CheckWarning, RankEvent
from harness.core.matmuls import MatmulCall
from harness.core.phases import PHASE_ORDER
from harness.core.stopwatch import Stopwatch
from harness.core.verdicts import Pending, Verdicts


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    ranks_per_node: int
    device: str = (
        "cpu"  # where this rank's model, data and checks live (harness/runtime/devices.py)
    )

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node


@dataclass
class Bucket:
    """One DDP gradient bucket: the flat buffer and the named views into it. After the
    collective, `riders` holds the reduced payload each plug-in appended to it."""

    index: int
    buffer: torch.Tensor
    tensors: list[tuple[str, torch.Tensor]]
    is_last: bool
    riders: dict[int, torch.Tensor] = field(default_factory=dict)
    # What the collective sums of this rank's buffer: `contribution` times it, rounded to `wire`
    # (None: summed in the buffer's own dtype). 1 and None unless a wrapped comm hook divides
    # and compresses the bucket after the riders were taken (harness/runtime/comm.py).
    contribution: float = 1.0
    wire: torch.dtype | None = None
    # What the local gradient was divided by before a check sees it: FSDP2 divides a float16
    # reduce-scatter input by about sqrt(world) (harness/runtime/sharding.py, `predivide`); 1
    # elsewhere. A check that recomputes the gradient divides it the same way to compare.
    divided_by: float = 1.0
    # The whole summed rider region (every plug-in's slots and the unused ones), when it exists.
    rider_region: torch.Tensor | None = None
    # Sharded (harness/runtime/shard_sites.py): a reduce-scatter input is `shards` rows, one per
    # receiver in the shard group, and this rank receives row `shard`; a DDP bucket is one row.
    shards: int = 1
    shard: int = 0


@dataclass
class EventLog:
    """The events one rank records during one trial."""

    rank: int
    node: int
    events: list[RankEvent] = field(default_factory=list)
    verdicts: Verdicts = field(default_factory=Verdicts)
    # Where the plug-ins' time goes, when it is measured (the guard's costs in a user's job).
    stopwatch: Stopwatch | None = None

    def emit(self, event: RankEvent) -> None:
        """Record `event` stamped with this rank, its node and the time."""
        now = self.verdicts.clock if self.verdicts.clock is not None else time.time()
        self.events.append(replace(event, rank=self.rank, node=self.node, time=now))


class Plugin:
    """Every hook is a no-op; a plug-in overrides the ones at its site."""

    def watches_module(self, name: str) -> bool:
        return False

    def on_forward_pre(self, step: int, module: str) -> None:
        """A watched module's forward is about to run."""

    def on_forward(self, step: int, module: str, output: torch.Tensor) -> torch.Tensor | None:
        """Return a tensor to replace the module's output, or None to leave it."""

    def watches_matmuls(self) -> bool:
        """Whether it takes part in the forward's matrix multiplies (harness/core/matmuls.py)."""
        return False

    def expands_attention(self, step: int, stack: tuple[str, ...]) -> bool:
        """Whether an attention call that would run fused, made while the modules `stack` run,
        must be computed as its two products (harness/core/attention.py)."""
        return False

    def on_matmul_operands(self, step: int, call: MatmulCall) -> None:
        """A matrix multiply is about to run: `call.args` may be wrapped in place."""

    def on_matmul_output(
        self, step: int, call: MatmulCall, output: torch.Tensor
    ) -> torch.Tensor | None:
        """Return a tensor to replace the product, or None to leave it."""

    def on_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor | None:
        """Return a tensor to replace the loss, or None to leave it."""

    def on_local_grad(self, step: int, bucket: Bucket) -> None: ...

    def on_contribution(self, step: int, index: int, parts: list[torch.Tensor]) -> None:
        """What this rank is about to send into chunk `index`'s reduction (the chunk and its
        rider region), changeable in place: a reduction fault's site."""

    def rider(self, step: int, bucket: Bucket) -> torch.Tensor | None:
        """A few float32 numbers to sum across ranks with this bucket's allreduce, for free:
        the sum comes back in `bucket.riders[id(self)]`. A check that runs every step may add
        no collective of its own (docs/design.md, section 6). Sharded, a `(bucket.shards, k)`
        tensor, one row per receiver, summed over the world in one small all-reduce; the
        receiver gets its own row back."""

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None: ...

    def on_gathered(self, step: int, bucket: Bucket) -> None:
        """Sharded training: the parameters of one FSDP group as all-gathered for this rank's
        forward, whole, before they become its unsharded weights (harness/runtime/sharding.py)."""

    def on_group_contribution(
        self, step: int, index: int, parts: list[torch.Tensor], members: tuple[int, ...]
    ) -> None:
        """`on_contribution` for a diagnostic reduction over the world ranks `members` alone
        (harness/runtime/locate.py); checks do not see these."""

    def on_group_reduced(self, step: int, bucket: Bucket, members: tuple[int, ...]) -> None:
        """`on_reduced_grad` for a diagnostic reduction over `members` alone."""

    def on_audit(self, step: int) -> None: ...

    def on_optimizer_state(self, step: int, optimizer: torch.optim.Optimizer) -> None: ...

    def on_update(self, step: int, model: nn.Module) -> None: ...

    def approves_checkpoint(self, step: int, model: nn.Module) -> bool | torch.Tensor:
        """True, or a 0-d bool tensor that the trainer reads with the step's verdicts: this
        rank's approval; a checkpoint is written where every rank's checks approve it."""
        return True


@dataclass
class DetectorContext:
    """What a check may know: where it runs and what it trains. Never the fault plan."""

    info: RankInfo
    model: nn.Module
    workload: Any  # harness.runtime.workloads.Workload: regenerates any rank's micro-batch
    steps: int
    data: tuple[tuple[int, ...], ...]  # whose micro-batches each rank trains on
    # Where replay gets another rank's micro-batches: None regenerates them from `workload`; a
    # user's loop ships them instead (harness/runtime/batch_exchange.py).
    replay_data: Any = None
    # Installs the rank's forward hooks (faults at sites activation and matmul, the products'
    # checks) on another module: a replica recomputes on this rank's hardware, as the model does.
    forward_hooks: Callable[[nn.Module], list[RemovableHandle]] | None = field(
        default=None, repr=False
    )
    # Builds a plain, unsharded module of the model's structure (harness/runtime/replica.py):
    # set where the model is sharded.
    unsharded_copy: Callable[[], nn.Module] | None = field(default=None, repr=False)
    _unsharded: nn.Module | None = field(default=None, init=False, repr=False)
    _gathered_at: int | None = field(default=None, init=False, repr=False)

    def replica(self, step: int) -> nn.Module:
        """A model this rank can recompute any rank's step on by itself (replay): the model, when
        it is replicated. Sharded, a plain copy of it that this rank holds whole, built from the
        model itself on first use (`unsharded_copy`), its weights gathered from the stored
        shards once per step (a collective: every rank calls it together). The checks that
        replay in one step share that gather: the weights do not change between backward and
        the optimizer step, and a trial runs each step once. The gathered copy is what the
        optimizer stepped, so a shard that went wrong on its way into one rank's forward (site
        gather) is not in it; the copy carries the model's forward hooks (`forward_hooks`)."""
        params = list(self.model.parameters())
        if not is_dtensor(params[0]):
            return self.model
        if self._unsharded is None:
            assert self.unsharded_copy is not None, "a sharded model without its copy's builder"
            self._unsharded = self.unsharded_copy()
            if self.forward_hooks is not None:
                self.forward_hooks(self._unsharded)
        if self._gathered_at != step:
            with torch.no_grad():
                for p, q in zip(params, self._unsharded.parameters(), strict=True):
                    q.copy_(whole(p.detach()))
            self._gathered_at = step
        return self._unsharded

    def batches(self, rank: int) -> list[tuple[int, int]]:
        """(source rank, micro-batch) pairs that `rank` computes each step."""
        micro = self.workload.cfg.micro_batches
        return [(source, m) for source in self.data[rank] for m in range(micro)]

    @property
    def divisor(self) -> float:
        """What each micro-batch loss is divided by, so that DDP's average over the ranks is
        the mean over every micro-batch of the global batch, whatever the world's size."""
        sources = sum(len(d) for d in self.data)
        return self.workload.cfg.micro_batches * sources / self.info.world_size


class Detector(Plugin):
    """A check. Subclasses call `self.alert(step, phase, suspect_ranks, evidence)`.

    `mode: observe` records alerts and lets training go on (how campaigns measure coverage and
    effect in one run); `mode: act` also asks the trainer to stop the trial before the next
    optimizer step or checkpoint. Every rank must reach the same stop decision, so a check in
    act mode only alerts on evidence every rank holds.
    """

    name = "detector"
    # Its settings' type: a frozen dataclass validated when made (harness/core/checks.py).
    Config: ClassVar[type[CheckConfig]] = CheckConfig
    # A trial fast-forwards from its golden run's snapshot just before the fault's first step,
    # handing each check the state it held there (`state_dict`). A check whose verdicts depend
    # on earlier steps in a way it cannot hand over sets this False: trials then run from 0.
    fast_forward = True
    # Recomputes audited micro-batches, which must reach it: regenerable data, or in a user's
    # loop a replay_fn and the shipped batch (harness/guard/). Its overhead.csv row also gets
    # a floor: one more forward and backward of those micro-batches (harness/campaign/overhead.py).
    recomputes_batches = False
    # Verifies the reduction's sum itself, which only a linear comm hook leaves checkable.
    verifies_reduction = False
    # Its alerts' suspects are the ranks it finds wrong. megatron_hash's are the ranks that
    # report a mismatch with rank 0 (healthy ones where rank 0 is wrong): recovery and the
    # guard take no culprit from such alerts.
    attributes = True
    # The `topology.parallel` worlds whose step the check is derived for: replicas only, unless
    # it says what it sees of a sharded step (docs/design.md, section 3).
    parallel: tuple[str, ...] = ("ddp",)

    def __init__(self, config: CheckConfig, ctx: DetectorContext, log: EventLog):
        self.config = config
        self.ctx = ctx
        self.info = ctx.info
        self._log = log
        # Set by an alert in act mode; `reduction_only` while every such alert was on the
        # received sum alone, which a retry of the reduction may clear.
        self.stop_requested = False
        self.reduction_only = True

    @classmethod
    def rides(cls) -> bool:
        """Whether it adds numbers to the reduction (`rider`): the rider region a reduction
        fault may strike holds only zeros without such a check."""
        return cls.rider is not Plugin.rider

    @classmethod
    def configure(cls, key: str, params: dict[str, Any], topology: Any) -> CheckConfig:
        """The check's settings from `params` (defaults for the rest); a ConfigError names any
        bad key. `topology` is None where no world is planned (the benchmarks)."""
        config = cls.Config.parse(key, params)
        if topology is not None:
            cls.check_topology(config, topology)
        return config

    @classmethod
    def check_steps(cls, key: str, config: CheckConfig, steps: int) -> None:
        """What the check needs of a run of `steps` steps (raise ConfigError under `key`)."""

    @classmethod
    def check_topology(cls, config: CheckConfig, topology: Any) -> None:
        """What the check needs of the world (raise ConfigError)."""

    @classmethod
    def check_optimizer(
        cls,
        key: str,
        config: CheckConfig,
        stepped: Callable[[], torch.optim.Optimizer],
        named: str,
    ) -> None:
        """What the check needs of a custom workload's optimizer (raise ConfigError under `key`):
        `stepped()` is it after one step (an optimizer makes its state on its first), `named`
        the optimizer as an error says it. A built-in workload's AdamW keeps its two moments."""

    @classmethod
    def compares_bits(cls, config: CheckConfig) -> bool:
        """Whether it compares recomputations bit for bit: on cuda the ranks then fix what that
        needs (harness/runtime/determinism.py)."""
        return False

    @classmethod
    def first_suspect_step(
        cls, config: CheckConfig, alarm_step: int, checkpointed: Callable[[int], bool]
    ) -> int:
        """The earliest step a fault it alarms on at `alarm_step` could have entered (the
        checkpoints from that step's on are suspect). A check of the values a step computes
        (its loss, its gradients) that looks every step vouches for each earlier step's
        computation, not for the state the steps before left: weights the update of step t-1
        corrupted show in step t's values, and optimizer state (Adam's moments) corrupted
        after step t-2's update reaches the weights at t-1's and the values only at t, each
        after its own step's checkpoint was written. This bounds what enters as a NaN or a
        jump: a corruption that grows (a threshold crossed late, a finite weight fault that
        overflows to NaN steps on) entered earlier still, and only a check that vouches for the
        state (consensus, replay: their looks) bounds it. One that looks every k steps says
        otherwise. `checkpointed(s)`: whether a checkpoint followed step s."""
        return max(alarm_step - 2, 0)

    @classmethod
    def looks_in(
        cls, config: CheckConfig, steps: range, checkpointed: Callable[[int], bool]
    ) -> bool:
        """Whether it looks at all in a run over `steps` (one that never does would be recorded
        as having run and caught nothing). One that looks from the first step: always."""
        return True

    @classmethod
    def looks_from(cls, config: CheckConfig, start_step: int) -> bool:
        """Whether it looks at all in an open-ended loop from `start_step` (a resumed user's
        loop): one that looks at its first steps only may never."""
        return True

    @classmethod
    def ran_every(
        cls, config: CheckConfig, steps: range, checkpointed: Callable[[int], bool]
    ) -> int | None:
        """Its audit interval as a run over `steps` makes it look: the most steps between two of
        its looks; None for a check that looks every step. One that looks every k steps and at
        no other: k. `checkpointed(s)`: whether a checkpoint followed step s."""
        return config.every

    @classmethod
    def looks(
        cls, config: CheckConfig, steps: range, checkpointed: Callable[[int], bool]
    ) -> int | None:
        """How many of `steps` it looks at, where its looks are not one every `ran_every` steps
        (listed steps, extra looks before checkpoints): a cost measured over `steps` is that
        many looks' (the guard's costs, priced per look by sdc-plan). None: one look every
        `ran_every` steps (every step for None), priced by that interval."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What this check carries from one step to the next (plain numbers and lists)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take over the state a golden run's check held at a snapshot."""

    def charged(self) -> AbstractContextManager:
        """Work the check does outside its hooks (an autograd callback), timed as its own."""
        watch = self._log.stopwatch
        return nullcontext() if watch is None else watch.charged(self.name)

    def read(self, tensor: torch.Tensor) -> Any:
        """A tensor's values on the host, counted (harness.core.verdicts.Verdicts)."""
        return self._log.verdicts.read(tensor)

    def defer(
        self,
        step: int,
        phase: str,
        flag: torch.Tensor,
        explain: Callable[[list[float]], None],
        detail: torch.Tensor | None = None,
        alarm: bool = True,
    ) -> None:
        """A verdict kept on the device until the trainer reads the step's verdicts together:
        `explain(detail as floats)` runs if `flag` holds and raises the alerts (at `phase`).
        `alarm=False`: a record that never stops the step (a measurement to log)."""
        assert phase in PHASE_ORDER, phase
        acting = alarm and self.config.acts
        stops = ("post" if phase == "post_allreduce" else "pre") if acting else None
        self._log.verdicts.pending.append(Pending(flag, explain, detail, stops, time.time()))

    def alert(self, step: int, phase: str, suspect_ranks: Iterable[int], evidence: Any) -> None:
        assert phase in PHASE_ORDER, phase
        if self.config.acts:
            self.stop_requested = True
            self.reduction_only = self.reduction_only and phase == "post_allreduce"
        ranks = sorted(set(suspect_ranks))
        nodes = sorted({r // self.info.ranks_per_node for r in ranks})
        self._log.emit(
            Alert(
                step=step,
                detector=self.name,
                phase=phase,
                suspect_ranks=ranks,
                suspect_nodes=nodes,
                evidence=evidence,
            )
        )

    def warn(self, step: int, what: str, evidence: Any) -> None:
        """Something the check cannot judge (say, a forward that does not reproduce), or how it
        ran otherwise than set (its C kernels not built): recorded in the trial's `warnings`,
        never an alert, never a stop."""
        self._log.emit(CheckWarning(step=step, detector=self.name, what=what, evidence=evidence))


def matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern)
