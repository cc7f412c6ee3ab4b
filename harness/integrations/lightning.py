"""The guard as a Lightning callback: `Trainer(..., callbacks=[SDCGuard(detectors="all",
mode="act", checkpoints=DIR)])` (docs/guard.md, "Lightning").

Entry contract: a `lightning.pytorch.Trainer` with `strategy="ddp"` (Lightning's own launcher or
torchrun; the spawn and fork launchers are refused) or FSDP2 through `ModelParallelStrategy`
(`configure_model` shards one child of the LightningModule that holds every parameter with
`fully_shard`, on its blocks and its root; tensor parallelism and accumulation, which Lightning
reduce-scatters every micro-batch there, refused); automatic optimization with one optimizer;
a precision whose gradients are the loss's own (`32-true`, `64-true`, `bf16-mixed`,
`bf16-true`; float16's loss scaling is refused). Every rank builds the same callback. The
module's `training_step(batch, batch_idx)` is a function of the batch, its index and the
weights: replay calls it again on another rank, with `self.log` silenced (under FSDP2 with an
unsharded copy of the sharded child in its place).

What the callback does with the Guard's five calls (harness/guard/__init__.py), at Lightning's
hooks:
- `on_train_start` (DDP has wrapped the module, or configure_model sharded it; checkpoints are
  restored): the Guard attaches to `trainer.strategy.model` (DDP) or to the sharded child,
  counting steps from `trainer.global_step`. The module's
  `training_step` is wrapped on the instance (Lightning looks it up there for each batch): the
  wrapper keeps each micro-batch for replay just before its forward, and passes the step's loss
  through the checks, so a rehearsed loss fault is substituted as in a hand-written loop
  (`on_before_backward` could not: Lightning ignores what it returns). Replay recomputes with the
  class's own `training_step` under the precision plugin's autocast, divided by
  `accumulate_grad_batches` as Lightning divides it: no `replay_fn` to write.
- `on_before_optimizer_step` (after the last micro-batch's backward, before Lightning clips and
  steps): `before_step`; act mode stops here, every rank together.
- `on_train_batch_end` after an optimizer step: `after_step`, the checks on the updated weights.
- Checkpoints: the strategy's `save_checkpoint` is gated (every rank calls it for each
  `ModelCheckpoint` save): the checks that approve a checkpoint run first, and a checkpoint they
  do not approve, or any after an alarm, is not written. Its `remove_checkpoint` is gated too:
  `ModelCheckpoint` removes the checkpoint a save replaces (`save_top_k`, `save_last`) whether
  or not the save was written, so while the latest save was refused nothing is removed, and a
  job in observe mode keeps its last approved checkpoint.

An alarm in act mode raises `SDCAlarm` out of `trainer.fit` on every rank; the script ends with
`sys.exit(alarm.exit_code)` (86: suspect hardware, 87: not attributed), and the checkpoints
written from the first suspect step on are set aside (into `suspect/`), listed in quarantine.json
(in `checkpoints`, else beside them). The gate stays on the strategy: nothing the Trainer saves
afterwards is written, and the callback refuses a new fit (RuntimeError naming the alarm). A new
SDCGuard in its place takes the gate off and puts its own on.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from harness.core.values import integer
from harness.guard import Guard, selection
from harness.guard.selection import Chosen

# Precisions whose backward sees the loss itself: float16's GradScaler multiplies it by a scale
# that changes between steps and overflows on purpose (an inf gradient that is not corruption).
# Float16 without it (16-true) has not been tried under the callback.
PRECISIONS = ("32-true", "64-true", "bf16-mixed", "bf16-true")
# The gates SDCGuards put on strategies' save_checkpoint and remove_checkpoint.
_GATES: weakref.WeakSet[Callable] = weakref.WeakSet()
GATED = ("save_checkpoint", "remove_checkpoint")


class SDCGuard(pl.Callback):
    """The Guard's checks in a Lightning fit; `guard` holds the Guard once the fit has started
    (its alerts, warnings, costs)."""

    def __init__(
        self,
        detectors: Chosen = ("nan_inf",),
        mode: str = "observe",
        inject: dict[str, Any] | None = None,
        checkpoints: str | Path | None = None,
        ranks_per_node: int | None = None,
        comm_hook: tuple[Any, Callable] | None = None,
        seed: int = 0,
        warmup_steps: int = 3,
    ):
        selection.named(detectors, mode)  # fails here, where the callback is written
        seed = integer("seed", seed, 0)
        if ranks_per_node is not None:
            integer("ranks_per_node", ranks_per_node, 1)
        self.options = dict(
            detectors=detectors, mode=mode, inject=inject, checkpoints=checkpoints,
            comm_hook=comm_hook, seed=seed, warmup_steps=warmup_steps,
        )  # fmt: skip
        self.ranks_per_node = ranks_per_node
        self.guard: Guard | None = None
        self._module: pl.LightningModule | None = None
        self._strategy: pl.strategies.Strategy | None = None
        self._stepped = 0
        self._refused = False  # the latest save was not written

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is not None and self.guard.alarm is not None:
            # The Trainer's weights are the alarmed fit's; its gate stays on (on_exception).
            raise RuntimeError(f"SDCGuard: an alarm ended this fit: {self.guard.alarm}")
        _refuse_unservable(trainer, pl_module)
        per_node = self.ranks_per_node
        if per_node is None and not os.environ.get("SDC_RANKS_PER_NODE"):
            per_node = trainer.num_devices  # else the Guard reads and checks the variable
        # Where the fit ends, when max_steps says (an epoch's steps may change with a
        # GradientAccumulationScheduler): a rehearsal or a listed step past it never happens.
        end = trainer.max_steps
        steps = end if end > trainer.global_step else None
        precision = trainer.strategy.precision_plugin

        watched, child = _watched(trainer.strategy, pl_module)

        def replay(model: nn.Module, args: tuple) -> torch.Tensor:
            with precision.train_step_context(), _silenced(pl_module), _in(pl_module, child, model):
                return _loss_of(type(pl_module).training_step(pl_module, *args))

        self.guard = Guard(
            watched,
            **self.options,
            replay_fn=replay,
            # The accumulation of the moment, as Lightning divides by it: a
            # GradientAccumulationScheduler changes it during the fit.
            scale_loss=lambda loss, _: loss / trainer.accumulate_grad_batches,
            ranks_per_node=per_node,
            start_step=trainer.global_step,
            steps=steps,
        )
        self._stepped = trainer.global_step
        self._module, self._strategy = pl_module, trainer.strategy
        pl_module.training_step = self._guarded_step(pl_module.training_step)
        trainer.strategy.save_checkpoint = self._gated_save(_ungated(trainer.strategy, GATED[0]))
        trainer.strategy.remove_checkpoint = self._gated_remove(
            _ungated(trainer.strategy, GATED[1])
        )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        _refuse_accumulation(trainer)  # a GradientAccumulationScheduler may have turned it on
        self._attached().before_step()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if trainer.global_step > self._stepped:  # an optimizer step ended this batch
            self._stepped = trainer.global_step
            self._attached().after_step(trainer.optimizers[0])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._detach()

    def _attached(self) -> Guard:
        if self.guard is None:
            raise RuntimeError("SDCGuard: the fit has not started")
        return self.guard

    def _guarded_step(self, training_step: Callable) -> Callable:
        """The module's training_step, with the micro-batch kept for replay before its forward
        and the loss passed through the checks."""

        @functools.wraps(training_step)
        def guarded(*args: Any) -> Any:
            guard = self._attached()
            guard.audit_batch(args)
            out = training_step(*args)
            loss = guard.loss(_loss_of(out))
            return {**out, "loss": loss} if isinstance(out, Mapping) else loss

        return guarded

    def _gated_save(self, save: Callable) -> Callable:
        """The strategy's save_checkpoint (every rank calls it; rank 0 writes), run only once the
        checks approve the step just finished."""

        @functools.wraps(save)
        def gated(checkpoint: dict[str, Any], filepath: str | Path, *args: Any, **kw: Any) -> None:
            guard = self._attached()
            self._refused = True
            if guard.alarm is not None:
                rank_zero_warn(f"SDCGuard: not saving {filepath} after an alarm: {guard.alarm}")
                return
            if guard.closed:
                save(checkpoint, filepath, *args, **kw)
                self._refused = False
                return
            if not guard.before_checkpoint():
                rank_zero_warn(f"SDCGuard: not saving {filepath}: the checks did not approve it")
                return
            save(checkpoint, filepath, *args, **kw)
            self._refused = False
            guard.checkpoint_written(filepath)

        _GATES.add(gated)
        return gated

    def _gated_remove(self, remove: Callable) -> Callable:
        """The strategy's remove_checkpoint, run only where the latest save was written: the
        checkpoint ModelCheckpoint removes is the one that save was to replace."""

        @functools.wraps(remove)
        def gated(filepath: str | Path, *args: Any, **kw: Any) -> None:
            if self._refused:
                rank_zero_warn(f"SDCGuard: keeping {filepath}: the save to replace it was refused")
                return
            remove(filepath, *args, **kw)

        _GATES.add(gated)
        return gated

    def _detach(self) -> None:
        if self._module is not None:
            vars(self._module).pop("training_step", None)
        # After an alarm the gate stays, through the fits this guard then refuses: nothing the
        # trainer saves later (Lightning's OnExceptionCheckpoint runs after on_exception) may
        # be written.
        alarmed = self.guard is not None and self.guard.alarm is not None
        if self._strategy is not None and not alarmed:
            for name in GATED:
                vars(self._strategy).pop(name, None)
        if self.guard is not None:
            self.guard.close()


def _ungated(strategy: pl.strategies.Strategy, name: str) -> Callable:
    """The strategy's method `name` without the gate an alarmed SDCGuard left on it: a new
    guard in its place decides the saves alone (under both gates the alarmed one refused every
    checkpoint the new one approved)."""
    method = getattr(strategy, name)
    return method.__wrapped__ if method in _GATES else method


def _refuse_accumulation(trainer: pl.Trainer) -> None:
    if isinstance(trainer.strategy, ModelParallelStrategy) and trainer.accumulate_grad_batches != 1:
        raise ValueError(
            "accumulate_grad_batches: 1 is allowed under ModelParallelStrategy, which "
            "reduce-scatters every micro-batch where the checks judge a step's whole gradient "
            f"(got {trainer.accumulate_grad_batches}; strategy='ddp' accumulates)"
        )


def _refuse_unservable(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """One ValueError line for a fit the callback cannot guard as it is."""
    strategy = trainer.strategy
    if isinstance(strategy, ModelParallelStrategy):
        _refuse_accumulation(trainer)
        if strategy.device_mesh["tensor_parallel"].size() != 1:
            raise ValueError(
                "tensor_parallel_size: 1 is allowed (the checks know data parallelism: DDP, "
                "FSDP2, HSDP)"
            )
    elif not isinstance(strategy, DDPStrategy):
        raise ValueError(
            "strategy: 'ddp' or ModelParallelStrategy (FSDP2) is allowed; got "
            f"{type(strategy).__name__}"
        )
    elif strategy._start_method != "popen":
        raise ValueError(
            f"strategy: 'ddp' (Lightning's own launcher, or torchrun) is allowed; got "
            f"ddp_{strategy._start_method}, whose ranks cannot each end with the alarm's exit code"
        )
    if trainer.precision not in PRECISIONS:
        raise ValueError(
            f"precision: {', '.join(PRECISIONS)} are allowed; got '{trainer.precision}' "
            "(16-mixed's loss scaling overflows to inf on purpose; 16-true, float16 without "
            "it, is not guarded yet)"
        )
    if not pl_module.automatic_optimization:
        raise ValueError(
            "automatic_optimization: SDCGuard guards Lightning's automatic optimization; in "
            "manual optimization use harness.guard.Guard's calls in training_step"
        )
    if len(trainer.optimizers) != 1:
        raise ValueError(f"optimizers: one is allowed; got {len(trainer.optimizers)}")


def _watched(
    strategy: pl.strategies.Strategy, pl_module: pl.LightningModule
) -> tuple[nn.Module, str | None]:
    """What the Guard attaches to, and where it sits in the LightningModule: DDP's wrapper, or
    the child that configure_model sharded with fully_shard (its root), holding every
    parameter."""
    if isinstance(strategy, DDPStrategy):
        return strategy.model, None
    from torch.distributed.fsdp import FSDPModule

    roots = [(n, c) for n, c in pl_module.named_children() if isinstance(c, FSDPModule)]
    inside = {id(p) for _, c in roots for p in c.parameters()}
    if len(roots) != 1 or any(id(p) not in inside for p in pl_module.parameters()):
        raise ValueError(
            "configure_model: one child module holding every parameter, sharded with "
            f"fully_shard on its root, is allowed; got {len(roots)} sharded children"
        )
    name, root = roots[0]
    return root, name


@contextmanager
def _in(pl_module: nn.Module, child: str | None, model: nn.Module) -> Iterator[None]:
    """`model`, replay's replica, in place of the module the Guard watches, for one step: under
    DDP that is the module itself; under FSDP2 an unsharded copy of the sharded child."""
    if child is None:
        yield
        return
    own = getattr(pl_module, child)
    setattr(pl_module, child, model)
    try:
        yield
    finally:
        setattr(pl_module, child, own)


def _loss_of(out: Any) -> torch.Tensor:
    """The loss in what training_step returned (a tensor, or a mapping with "loss")."""
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "training_step: SDCGuard needs a loss tensor, or a mapping with one under 'loss'; "
            f"got {type(out).__name__}"
        )
    return loss


@contextmanager
def _silenced(model: nn.Module) -> Iterator[None]:
    """`self.log` and `self.log_dict` as no-ops while replay recomputes a step: a replayed
    step's metrics are not the fit's, and `sync_dist` would start a collective on one rank."""

    def ignored(*args: Any, **kwargs: Any) -> None:
        return None

    model.log = model.log_dict = ignored
    try:
        yield
    finally:
        del model.log, model.log_dict
