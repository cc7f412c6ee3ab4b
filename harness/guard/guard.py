"""The Guard: one rank's checks, attached to the user's DDP or fully_shard module (the usage is in
harness/guard/__init__.py).

Entry contract: the default process group is up and every rank of it builds a Guard on its own
model, together (the constructor runs a collective); the model is wrapped already (DDP, or
`fully_shard` on the root and whichever blocks the user shards), and the optimizer may exist.
Every rank then calls the same guard methods in the same order, each step.
"""

from __future__ import annotations

import atexit
import math
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.hooks import RemovableHandle

import detectors as registry
from harness.campaign import recovery
from harness.config.fault_targets import check_moments, check_riders, check_target
from harness.core import inflight
from harness.core.bus import PluginBus
from harness.core.events import Alert, CheckWarning, Inject, of
from harness.core.matmuls import ForwardModules, MatmulCall, Watch
from harness.core.phases import PHASE_ORDER
from harness.core.plugins import DetectorContext, EventLog, RankInfo
from harness.core.stopwatch import HOOK, Stopwatch
from harness.core.values import integer
from harness.errors import ConfigError
from harness.guard import selection
from harness.guard.alarm import (
    SDCAlarm,
    earlier_incidents,
    first_check,
    quarantine,
    suspected,
)
from harness.results.costs import CheckCost, JobCosts, combined, priced
from harness.runtime import checkpoint, comm
from harness.runtime.assembly import assemble
from harness.runtime.batch_exchange import ShippedBatches
from injectors.injector import FaultInjector
from injectors.sites import MODULE_SITES

if TYPE_CHECKING:
    from harness.runtime.shard_sites import ShardedBuckets

STEP = "step"
# The checks that recompute a step's gradient and compare it with the one reduced.
RECOMPUTING = frozenset({"replay", "titan_replay"})
# The guard on each module, as a weak reference (the guard holds its module).
_GUARDS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Guard]] = weakref.WeakKeyDictionary()


class Guard:
    """The checks attached to one rank's DDP or fully_shard module (harness/guard/__init__.py)."""

    def __init__(
        self,
        model: nn.Module,
        detectors: selection.Chosen = ("nan_inf",),
        mode: str = "observe",
        inject: dict[str, Any] | None = None,
        comm_hook: tuple[Any, Callable] | None = None,
        seed: int = 0,
        replay_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        scale_loss: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        ranks_per_node: int | None = None,
        checkpoints: str | Path | None = None,
        start_step: int = 0,
        warmup_steps: int = 3,
        steps: int | None = None,
    ):
        _check_comm_hook(comm_hook)
        _check_callables(replay_fn, scale_loss, checkpoints)
        seed = integer("seed", seed, 0)
        slot = _released_slot(model)
        self.parallel, shard_size = _parallelism(model, comm_hook, slot is not None)
        self.warmup_steps = integer("warmup_steps", warmup_steps, 1)
        integer("start_step", start_step, 0)
        if steps is not None:
            if start_step > 0 and integer("steps", steps) <= start_step:
                # A job restarted from its last step's checkpoint (restore_point) has none left.
                raise ConfigError(
                    "steps", f"{steps}: a loop resumed at step {start_step} has no step left to "
                    f"train (the job is complete where restore_point returned its last step); "
                    f"allowed: {start_step + 1}..inf"
                )  # fmt: skip
            integer("steps", steps, start_step + 1)
        rank, world = dist.get_rank(), dist.get_world_size()
        per_node = _ranks_per_node(ranks_per_node, world)
        self.model = model.module if isinstance(model, DDP) else model
        first = next(self.model.parameters())
        self.info = RankInfo(rank, world, per_node, str(first.device))
        world_topology = selection.topology(world, per_node, self.parallel, shard_size)
        job = selection.Job(world_topology, mode, replay_fn, comm_hook, start_step, steps)
        chosen = selection.select(detectors, job)
        self.checks, self.left_out = chosen.checks, chosen.left_out
        fault = None
        if inject is not None:
            fault = selection.rehearsal(inject, self.model, world_topology, start_step, steps)
            check_riders("inject", fault, self.checks)

        name = os.environ.get("SDC_NODE_NAME", socket.gethostname())
        self.machines: list[str] = inflight.gather_objects(
            name.replace("{node}", str(self.info.node))
        )
        self.mode = mode
        self.folder = Path(checkpoints) if checkpoints is not None else None
        self.alarm: SDCAlarm | None = None
        self.checkpointed: set[int] = set()
        self.written: list[tuple[int, Path]] = []  # checkpoints a trainer saved: (step, path)
        # Where the checks' time goes, and the loop's steps: read in costs().
        self.stopwatch, self._clock = Stopwatch(first.device), Stopwatch(first.device)
        self.log = EventLog(rank, self.info.node, stopwatch=self.stopwatch)
        recomputing = any(registry.detector_class(n).recomputes_batches for n in self.checks)
        self.shipped = (
            ShippedBatches(replay_fn, rank, first.device, scale_loss) if recomputing else None
        )
        ctx = DetectorContext(self.info, self.model, None, 0, tuple((r,) for r in range(world)),
                              replay_data=self.shipped)  # fmt: skip
        # A module carries one guard: one left open by a fit that raised past its trainer's
        # callbacks (the HF Trainer has no event for it) would watch every product again.
        stale = _GUARDS.get(self.model, lambda: None)()
        if stale is not None:
            stale.close()
        _GUARDS[self.model] = weakref.ref(self)
        plugins = assemble(self.model, ctx, self.log, self.checks, fault, seed,
                           transparent=True, inner=comm_hook)  # fmt: skip
        self.bus, self._state, self._hooks = plugins.bus, plugins.state, plugins.hooks
        # A rehearsal at site optimizer, checked against the loop's optimizer at the first
        # after_step, where the guard first sees it.
        self._state_fault = fault is not None and fault.site == "optimizer"
        if fault is not None and fault.site in MODULE_SITES:
            checked = partial(check_target, "inject", fault, self.model,
                                        shard_group=world_topology.shard_group)  # fmt: skip
            self._hooks += _module_fault(
                self.model, self.bus, checked, lambda: self.step > start_step
            )
        self._shards: ShardedBuckets | None = None
        self._slot: comm.HookSlot | None = None
        try:
            if isinstance(model, DDP):
                if slot is None:
                    slot = comm.HookSlot()
                    model.register_comm_hook(slot, comm.slotted_hook)
                slot.state, self._slot = self._state, slot
            else:
                self._shards = _sharded_sites(model, self.bus, ctx)
        except BaseException:
            # Refused (a fully_shard setting the sites cannot take): the module as it was, so
            # that a loop going on unguarded is not watched by a guard that does not exist.
            for handle in self._hooks:
                handle.remove()
            raise
        self.start_step = start_step
        self._set_step(start_step)
        self._loss_step = -1
        self._audited = -1  # the last step before_step ran at
        self._seen = 0  # events already considered for an alarm
        self._ended = 0  # steps ended, warm-up included
        self._measured = 0  # steps measured since the warm-up
        self._last_end: Any = None
        self.closed = False
        # Once per process, before the interpreter finalises, whether or not the loop closed
        # the guard; and never DDP's reducer to destroy the group (harness/core/inflight.py).
        if isinstance(model, DDP):
            inflight.keep(model.process_group)
        atexit.unregister(inflight.at_exit)
        atexit.register(inflight.at_exit)

    @property
    def step(self) -> int:
        return self._state.step

    def _set_step(self, step: int) -> None:
        self._state.step = step
        if self._shards is not None:
            self._shards.step = step

    @property
    def alerts(self) -> list[Alert]:
        """Every alert this rank raised, observe or act (harness.core.events.Alert)."""
        self.bus.resolve()
        return of(Alert, self.log.events)

    @property
    def warnings(self) -> list[CheckWarning]:
        """What a check could not judge on this rank (replay: "not deterministic"), and each
        check that has not looked in the steps guarded so far (consensus every 50 steps of a
        40-step job): on, and yet it compared nothing."""
        self.bus.resolve()
        steps = range(self.start_step, self.step)
        unlooked = [
            CheckWarning(rank=self.info.rank, node=self.info.node, time=time.time(),
                         step=self.step - 1, detector=name, evidence=config.params(),
                         what=f"has not looked in steps {steps.start}..{steps.stop - 1}")
            for name, config in self.checks.items()
            if steps and not registry.detector_class(name).looks_in(
                config, steps, self.checkpointed.__contains__)
        ]  # fmt: skip
        return of(CheckWarning, self.log.events) + unlooked

    @property
    def injections(self) -> list[Inject]:
        return of(Inject, self.log.events)

    def audit_batch(self, batch: Any) -> None:
        """The micro-batch this rank is about to train on (tensors in plain containers), for
        replay to ship on audit steps; call it for every micro-batch, just before its forward
        (the random state it keeps is the forward's)."""
        if self.shipped is not None:
            self.shipped.keep(self.step, batch)

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Pass the loss through the checks (and a rehearsed loss fault); use what it returns."""
        self._loss_step = self.step
        return self.bus.loss(self.step, loss)

    def before_step(self) -> None:
        """After backward, before clipping and optimizer.step(): raises SDCAlarm in act mode."""
        if self.shipped is not None and self._loss_step != self.step:
            raise RuntimeError("replay: pass every step's loss through guard.loss(loss)")
        recomputing = sorted(RECOMPUTING & set(self.checks))
        if recomputing and self.bus.reduced_twice is not None:
            raise RuntimeError(
                f"accumulation: step {self.bus.reduced_twice} reduced a gradient bucket twice, "
                f"and {', '.join(recomputing)} recomputes a step's gradient reduced once: "
                "reduce the last micro-batch of an accumulation only (DDP: model.no_sync() "
                "around the others; FSDP2: model.set_requires_gradient_sync(False); HSDP also "
                "set_requires_all_reduce(False)), and backward once per step"
            )
        self._audited = self.step
        self.bus.audit(self.step)
        self._raise_if_alarmed()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After optimizer.step(): checks on the updated weights; then the next step begins."""
        if self._audited != self.step:
            # Replay audits there, and act mode stops before the update: without it replay
            # never looked and a check's alarm came after the update it should have stopped.
            raise RuntimeError(
                f"after_step: guard.before_step() was not called in step {self.step}; call it "
                "every step after backward, before clipping and optimizer.step()"
            )
        if self._state_fault:
            self._state_fault = False
            check_moments("inject", optimizer, f"the loop's {type(optimizer).__name__}")
        self.bus.optimizer_state(self.step, optimizer)
        self.bus.update(self.step, self.model)
        self._raise_if_alarmed()
        self._set_step(self.step + 1)
        self._step_ended()

    def before_checkpoint(self) -> bool:
        """Run the checks that gate a checkpoint of the step just finished (weight consensus):
        whether they approve; act mode raises SDCAlarm instead of disapproving."""
        # At a resumed job's start (start_step > 0) the weights are those of step
        # start_step - 1, restored: a trainer may checkpoint them again (Lightning's
        # ModelCheckpoint does, mid-accumulation, after a resume).
        if self.step == 0 or self._audited == self.step:
            raise RuntimeError(
                "checkpoint: after guard.after_step(), which ends the step it saves (a "
                f"checkpoint now would be labelled step {self.step - 1}, whose update "
                f"{'never ran' if self.step == 0 else 'is not the last'})"
            )
        step = self.step - 1
        self.checkpointed.add(step)
        # Each rank's checks approve on their own (`Plugin.approves_checkpoint`): every rank
        # saves or none, or a sharded save's ranks enter its collectives apart.
        approvals = self.bus.checkpoint_approved(step, self.model).float()
        with self.bus.charged(HOOK):
            dist.all_reduce(approvals)
            inflight.hold(approvals)
            approved = self.bus.verdicts.read(approvals) == self.info.world_size
        self._raise_if_alarmed()
        return approved

    def save(self, state: dict[str, Any]) -> Path | None:
        """Checkpoint the step just finished into `checkpoints` once the checks approve; the
        path, or None where this rank wrote nothing. Refuses after an alarm. A replicated model
        (DDP): rank 0 writes `state`, atomically with its checksum (harness/runtime/checkpoint.py).
        A sharded one: every rank writes its shards of `state` (its model's and optimizer's
        state dicts, as torch.distributed.checkpoint takes them), and rank 0 seals them."""
        if self.folder is None:
            raise ValueError("Guard.save needs Guard(..., checkpoints=FOLDER)")
        if self.alarm is not None:
            raise RuntimeError(f"refusing to save state after an alarm: {self.alarm}")
        if not self.before_checkpoint():
            return None
        step = self.step - 1
        path = checkpoint.step_path(self.folder, step)
        if self._shards is not None:
            return checkpoint.save_shards(path, {"step": step, **state}, self.info.rank)
        if self.info.rank != 0:
            return None
        checkpoint.save(path, {"step": step, **state})
        return path

    def checkpoint_written(self, path: str | Path) -> None:
        """A checkpoint of the step just finished that the loop's trainer wrote itself, once
        `before_checkpoint` approved it: an alarm sets it aside (into `suspect/`) with the guard's
        own when it falls in the suspect interval."""
        self.written.append((self.step - 1, Path(path)))

    def _looked(self, name: str) -> tuple[int | None, int | None]:
        """The check's audit interval as this job made it look (consensus also looks before each
        checkpoint, so a job checkpointing more often than its interval looks more often), and,
        where its looks are irregular, how many fell in the steps measured."""
        check, config = registry.detector_class(name), self.checks[name]
        measured = range(self.step - self._measured, self.step)
        return (
            check.ran_every(
                config, range(self.start_step, self.step), self.checkpointed.__contains__
            ),
            check.looks(config, measured, self.checkpointed.__contains__),
        )

    @staticmethod
    def restore_point(folder: str | Path) -> tuple[int, str]:
        """The newest checkpoint in `folder` that the checks approved and whose checksum
        verifies, before any suspect interval (an alarm set those aside): (step, path), or
        (-1, "") to start from the initial weights. Load it with harness.runtime.checkpoint.load
        (a sharded one, a `.dcp` folder, with torch.distributed.checkpoint.load)."""
        return recovery.restore_point(Path(folder), 2**62, [], suspected(Path(folder)))

    def costs(self) -> JobCosts:
        """What each check cost this rank, per step, over the steps since the warm-up; and the
        guard's own hook, and the loop's step (harness/results/costs.py)."""
        if self._measured == 0:
            raise RuntimeError(
                f"costs: no step measured yet; the first {self.warmup_steps} steps are a warm-up"
            )
        # After an alarm, whole steps: the step it cut short has charges and no step time.
        # Otherwise every charge, the checkpoint's after the last step included (its look is
        # among `_looked`'s).
        spent, n = self.stopwatch.read(whole_steps=self.alarm is not None), self._measured

        def part(name: str, interval: int | None = None, looks: int | None = None) -> CheckCost:
            return CheckCost(spent.get(name, 0.0) / n, math.nan, interval, looks)

        return priced(
            JobCosts(
                step_time_s=self._clock.read()[STEP] / n,
                steps=n,
                warmup=self.warmup_steps,
                device=self.info.device,
                parallel=self.parallel,
                world_size=self.info.world_size,
                checks={name: part(name, *self._looked(name)) for name in self.checks},
                hook=part(HOOK),
                injection=part("injection") if "injection" in spent else None,
            )
        )

    def write_costs(self, path: str | Path) -> JobCosts:
        """The world's costs (each part's mean over the ranks), written by rank 0 as JSON to
        `path` for `sdc-plan --costs`; every rank calls it together and gets them."""
        world = combined(inflight.gather_objects(self.costs()))
        if self.info.rank == 0:
            world.write(Path(path))
        return world

    def close(self) -> None:
        """Detach: the forward hooks removed, the comm hook (DDP) or FSDP's collectives left
        reducing as they would without the guard, the checks dropped, and every tensor the
        guard's collectives used released once the backend has let go of it (so that nothing it
        did is freed on a backend thread while the process ends). Training may go on unguarded;
        a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        self.bus.resolve()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        empty = PluginBus([], device=self.info.device)
        self._state.bus = empty
        if self._slot is not None:
            self._slot.open = False
        if self._shards is not None:
            self._shards.bind(empty)
        self.bus, self.shipped = empty, None
        inflight.quiesce()

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _step_ended(self) -> None:
        """The loop's step time, mark to mark; the warm-up's steps (and the charges in them)
        left out."""
        end = self._clock.mark()
        self._ended += 1
        if self._ended == self.warmup_steps:
            self.stopwatch.reset()
            self._clock.reset()
        elif self._ended > self.warmup_steps:
            self._clock.add(STEP, self._last_end, end)
            self._measured += 1
        self._last_end = end
        self.stopwatch.fold()
        self.stopwatch.close_step()
        self._clock.fold()

    def _raise_if_alarmed(self) -> None:
        """Every rank learns whether any rank alarmed (one small collective, act mode only).
        The checks' verdicts are read here in either mode: a DDP bucket they point into is
        reused by the next step."""
        with self.bus.charged(HOOK):
            alarm = self._agreed_alarm()
        if alarm is None:
            return
        self.alarm = alarm
        folder = self._alarm_folder()
        try:
            if folder is not None and self.info.rank == 0:
                quarantine(folder, alarm, self.written)
        except OSError as error:
            # The alarm, and its exit code, are what the job ends with: said, not replaced.
            print(f"SDCGuard: setting the suspect checkpoints aside failed: {error}",
                  file=sys.stderr)  # fmt: skip
        finally:
            # Every rank waits for rank 0's set-aside: a rank that exits at once lets torchrun's
            # agent stop rank 0 mid-move, a suspect checkpoint left where restore_point takes it.
            dist.barrier()
            # Training ends here: nothing the guard did may still be in flight when it does.
            self.close()
        raise alarm.again()

    def _alarm_folder(self) -> Path | None:
        """Where quarantine.json goes: without a folder of the guard's, beside the checkpoints
        the trainer wrote (Lightning's ModelCheckpoint under SDCGuard's default)."""
        return self.folder or (self.written[-1][1].parent if self.written else None)

    def _agreed_alarm(self) -> SDCAlarm | None:
        self.bus.resolve()
        if self.mode != "act":
            return None
        fresh, self._seen = self.log.events[self._seen :], len(self.log.events)
        mine = of(Alert, fresh) if self.bus.stopper() else []
        flag = torch.tensor([1.0 if mine else 0.0], device=self.info.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        inflight.hold(flag)
        if not self.bus.verdicts.read(flag)[0]:
            return None
        found = sorted(
            (a for alerts in inflight.gather_objects(mine) for a in alerts),
            key=lambda a: (a.step, PHASE_ORDER[a.phase], a.time),
        )
        since = recovery.earliest_suspect(found, self.checks, self.checkpointed.__contains__)
        sharded, earlier = self.parallel != "ddp", ()
        if sharded:  # rank 0's reading on every rank: each rank's alarm ends with one code
            mine = earlier_incidents(self._alarm_folder()) if self.info.rank == 0 else ()
            earlier = inflight.gather_objects(mine)[0]
        return SDCAlarm(first_check(found), self.machines, since, sharded, earlier)


def _module_fault(
    model: nn.Module,
    bus: PluginBus,
    checked: Callable[[ForwardModules], None],
    armed: Callable[[], bool],
) -> list[RemovableHandle]:
    """A fault at a module site strikes the loop's training forwards once `armed()` (from the
    loop's second step: every forward of a step alike, a replay's recomputation and each
    micro-batch's, as a broken unit would). The first forward is traced through the products'
    watch (one of its own where no plug-in watches them, removed after it) and handed to
    `checked` as it ends: what the fault names, the products each module makes and their
    dtypes, only a forward shows, as a campaign traces its model before it runs. A forward
    that builds no graph (an evaluation's: a Trainer's eval or validation runs within a step)
    is never struck: one that came first took the step's strike, and the training forward ran
    clean. Its handles."""
    watch = bus.watch
    own: list[RemovableHandle] = []
    if watch is None:
        watch = Watch(MatmulCall.compute)
        own = watch.install(model)
    watch.traces = pending = True
    injectors = [(p, p.active) for p in bus.plugins if isinstance(p, FaultInjector)]

    def began(_module: nn.Module, _inputs: Any) -> None:
        for injector, active in injectors:
            injector.active = active and not pending and armed() and torch.is_grad_enabled()

    def ended(_module: nn.Module, _inputs: Any, _output: Any) -> None:
        nonlocal pending
        if not pending:
            return
        pending = watch.traces = False
        for handle in own:
            handle.remove()
        try:
            checked(watch.traced())
        except ConfigError:
            injectors.clear()  # refused: never armed
            raise

    began(model, ())
    return [*own, model.register_forward_pre_hook(began), model.register_forward_hook(ended)]


def _released_slot(model: nn.Module) -> comm.HookSlot | None:
    """The slot of a closed guard's comm hook on `model`, a DDP module, or None."""
    hooks = getattr(model, "_comm_hooks", [])
    if len(hooks) == 1 and hooks[0][0] is comm.slotted_hook and not hooks[0][1].open:
        return hooks[0][1]
    return None


def _check_callables(replay_fn: Any, scale_loss: Any, checkpoints: Any) -> None:
    """What the guard calls or writes into only later (a replay, a checkpoint): a value that is
    not one failed there, on every rank, with no word of the key."""
    for key, value in (("replay_fn", replay_fn), ("scale_loss", scale_loss)):
        if value is not None and not callable(value):
            raise ValueError(f"{key}: a function; got {type(value).__name__} {value!r:.60}")
    if checkpoints is not None and not isinstance(checkpoints, str | os.PathLike):
        raise ValueError(
            f"checkpoints: a folder's path (str or Path); got {type(checkpoints).__name__} "
            f"{checkpoints!r:.60}"
        )


def _check_comm_hook(comm_hook: Any) -> None:
    """A hook handed over without its state would fail in the first backward."""
    if comm_hook is not None and not (
        isinstance(comm_hook, tuple) and len(comm_hook) == 2 and callable(comm_hook[1])
    ):
        raise ValueError(
            "comm_hook: a (state, hook) pair as DDP's register_comm_hook takes them, e.g. "
            f"(None, fp16_compress_hook); got {type(comm_hook).__name__} {comm_hook!r:.60}"
        )


def _ranks_per_node(given: int | None, world: int) -> int:
    """Ranks per machine: `given`, else the launcher's (SDC_RANKS_PER_NODE, torchrun's
    LOCAL_WORLD_SIZE), else the world. It must divide the world: the checks name the machine
    of rank r as r // ranks_per_node."""
    key, value = "ranks_per_node", given
    if value is None:
        source = next((k for k in ("SDC_RANKS_PER_NODE", "LOCAL_WORLD_SIZE") if os.environ.get(k)),
                      None)  # fmt: skip
        key, value = (source, os.environ[source]) if source else (key, world)
    if isinstance(value, str):  # a launcher's variable: its text, whole digits only
        value = int(value) if value.strip().isdigit() else value
    per_node = integer(key, value, 1)
    if world % per_node:
        ranks = "rank" if world == 1 else "ranks"
        raise ConfigError(key, f"{per_node} does not divide the world of {world} {ranks}")
    return per_node


def _parallelism(
    model: nn.Module, comm_hook: tuple[Any, Callable] | None, released: bool = False
) -> tuple[str, int | None]:
    """ddp, or fsdp or hsdp with the shard group's size; ValueError for a module the guard
    cannot attach to. `released`: the DDP module's comm hook is a closed guard's."""
    if isinstance(model, DDP):
        if model._comm_hooks and not released:
            raise ValueError(
                "model: this DDP module has a comm hook already: an open Guard's (close() it "
                "first) or your own (pass yours as Guard(..., comm_hook=(state, hook)) and the "
                "guard wraps it)"
            )
        return "ddp", None
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not loaded: no module was sharded
    if fsdp is None or not isinstance(model, fsdp.FSDPModule):
        raise ValueError(
            "model: a DistributedDataParallel module or a module sharded with FSDP2's "
            f"fully_shard (on its root) is allowed; got a {type(model).__name__}"
        )
    if comm_hook is not None:
        raise ValueError(
            "comm_hook: a DDP comm hook; a fully_shard module reduces through FSDP's own "
            "collectives, which the guard wraps itself"
        )
    from harness.runtime import sharding  # FSDP2 costs every DDP job 0.7 s of import

    return sharding.parallelism(model)


def _sharded_sites(model: nn.Module, bus: PluginBus, ctx: DetectorContext) -> ShardedBuckets:
    """The campaigns' sites on the collectives of every FSDP group of `model`, feeding `bus`;
    replay's replica copied from the module."""
    from harness.runtime import replica, sharding  # as in _parallelism
    from harness.runtime.shard_sites import ShardedBuckets

    shards = ShardedBuckets(sharding.parallelism(model)[0] == "hsdp", ctx.info.world_size)
    shards.bind(bus)
    shards.groups = sharding.install(model, shards.sites())
    ctx.unsharded_copy = partial(replica.unsharded_copy, model)
    return shards
