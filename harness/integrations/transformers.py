"""The guard as a Hugging Face Trainer callback: `Trainer(..., callbacks=[SDCGuardCallback(
detectors="all", mode="act", checkpoints=DIR)])` (docs/guard.md, "Hugging Face Trainer").

Entry contract: a plain `transformers.Trainer` (its own `compute_loss` and `training_step`) under
torchrun, one process per device, which accelerate wraps in DistributedDataParallel; a model that
returns its loss under "loss" (a ModelOutput's `outputs.loss`, or a plain mapping's) from the
batch it is called with; bfloat16 or float32 (no
float16 loss scaling); no `compute_loss_func`, no label smoothing. Every rank builds the same
callback. Anything else is refused when training begins, in one ValueError line naming the
setting and what is allowed (`_refuse_unservable`).

What the callback does with the Guard's calls (harness/guard/__init__.py), at the Trainer's
events (transformers/trainer.py, `_inner_training_loop` and `_run_epoch`):
- `on_train_begin` (accelerate has wrapped the model in DDP; a resumed fit has its step): the
  Guard attaches to the Trainer's `model_wrapped`, counting steps from `state.global_step`.
  Callbacks are handed the unwrapped model, never the Trainer, so the Trainer is found as the
  caller whose train() is calling this one (`_trainer_of`).
- Every forward of a training step (between `on_step_begin` and `on_step_end`, the module in
  train mode): a forward pre-hook keeps the keyword arguments the model is called with for
  replay (`num_items_in_batch` included, which compute_loss merges in), with the random state
  of the moment; a forward hook passes the loss through the checks (a rehearsed loss fault
  strikes there). Replay recomputes `model(**batch)["loss"]` with the hooks bypassed, under the
  autocast accelerate patched into the model's forward, and scales it as the Trainer scaled the
  loss it backpropagated (`_backpropagated`).
- `on_pre_optimizer_step` (after the Trainer clipped: the checks on the gradients ran in the
  reduction, inside the guard's DDP comm hook): `before_step`; act mode stops here.
- `on_optimizer_step`: `after_step`, the checks on the updated weights.
- `on_step_end` and `on_epoch_end` (the last events before the Trainer saves): when a
  checkpoint is due, `before_checkpoint` on every rank; one the checks do not approve is not
  written (`control.should_save` cleared). `on_save`: the checkpoint folder is recorded, so that
  an alarm sets it aside when it falls in the suspect interval.
- `on_train_end`: the guard closes and the hooks come off. A fit that raises anything but the
  alarm leaves them on (the Trainer has no event for an error) until the next `on_train_begin`
  takes them off; one the alarm ended is refused a new train() on this callback.

An alarm in act mode raises `SDCAlarm` out of `trainer.train()` on every rank, before anything
of that step is saved; the script ends with `sys.exit(alarm.exit_code)` (86: suspect hardware,
87: not attributed). `checkpoints` (default: the Trainer's `output_dir`) receives
quarantine.json, and the Trainer's `checkpoint-N` folders of the suspect interval are moved
into `suspect/` beside them, out of the sight of its rotation (`save_total_limit`), so
`trainer.train(resume_from_checkpoint=True)` resumes from one the checks vouch for. Put the
callback after any callback of yours that sets `control.should_save`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from harness.core.values import integer
from harness.guard import Guard, SDCAlarm, selection
from harness.guard.selection import Chosen


class SDCGuardCallback(transformers.TrainerCallback):
    """The Guard's checks in a Trainer's fit; `guard` holds the Guard once training has begun
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
        self.options = dict(
            detectors=detectors, mode=mode, inject=inject, ranks_per_node=ranks_per_node,
            comm_hook=comm_hook, seed=seed, warmup_steps=warmup_steps,
        )  # fmt: skip
        self.checkpoints = checkpoints
        self.guard: Guard | None = None
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._in_step = False  # between on_step_begin and on_step_end
        self._replaying = False  # the guard's own recomputation is running
        # How the Trainer scales a micro-batch's loss before backward (_backpropagated).
        self._counted = False  # num_items_in_batch reached the forward
        self._average = False
        self._world = 1

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.guard is not None and self.guard.alarm is not None:
            raise RuntimeError(f"SDCGuardCallback: an alarm ended this fit: {self.guard.alarm}")
        # A fit that raised anything else left this callback's guard open and its hooks on the
        # model (the Trainer has no event for an error): the new fit takes over from it.
        self._detach()
        trainer = _trainer_of(self)
        _refuse_unservable(trainer)
        ddp: DDP = trainer.model_wrapped
        self._average = args.average_tokens_across_devices
        self._world = trainer.accelerator.num_processes // trainer.get_tp_size()
        self.guard = Guard(
            ddp,
            **self.options,
            replay_fn=self._replay,
            scale_loss=self._backpropagated,
            checkpoints=self.checkpoints if self.checkpoints is not None else args.output_dir,
            start_step=state.global_step,
            # Where the fit ends: a rehearsal or a check's listed step past it never happens.
            steps=state.max_steps if state.max_steps > state.global_step else None,
        )
        model = ddp.module
        self._hooks = [
            model.register_forward_pre_hook(self._keep_batch, with_kwargs=True),
            model.register_forward_hook(self._checked_loss, with_kwargs=True),
        ]

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._in_step = True

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        with self._detached_on_alarm() as guard:
            guard.before_step()

    def on_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        # The Trainer's optimizer is accelerate's wrapper; the checks read the torch one's state.
        with self._detached_on_alarm() as guard:
            guard.after_step(getattr(optimizer, "optimizer", optimizer))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._in_step = False
        self._gate_checkpoint(control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._gate_checkpoint(control)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        self._attached().checkpoint_written(folder)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._detach()

    def _attached(self) -> Guard:
        if self.guard is None:
            raise RuntimeError("SDCGuardCallback: training has not begun")
        return self.guard

    @contextmanager
    def _detached_on_alarm(self) -> Iterator[Guard]:
        """The guard, for a call that may raise the alarm; the hooks come off before it leaves
        the Trainer (the guard has closed itself)."""
        try:
            yield self._attached()
        except SDCAlarm:
            self._detach()
            raise

    def _gate_checkpoint(self, control: TrainerControl) -> None:
        """The Trainer saves right after this event when `should_save` is set: the checks that
        approve a checkpoint run first, on every rank (a collective; act mode raises instead of
        disapproving), and a checkpoint they do not approve is not written."""
        if control.should_save:
            with self._detached_on_alarm() as guard:
                control.should_save = guard.before_checkpoint()

    def _training_forward(self, module: nn.Module) -> bool:
        return module.training and self._in_step and not self._replaying

    def _keep_batch(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._training_forward(module):
            self._attached().audit_batch(dict(kwargs))
            # Whether the Trainer counted the step's tokens depends on its settings and the
            # batch's keys alone, the same on every rank: true of the batches replay recomputes.
            self._counted = "num_items_in_batch" in kwargs

    def _checked_loss(
        self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any
    ) -> Any:
        if not self._training_forward(module):
            return output
        loss = output.get("loss") if isinstance(output, Mapping) else None
        if not isinstance(loss, torch.Tensor):
            raise ValueError(
                "model: SDCGuardCallback needs the model's loss as outputs.loss (return_dict, "
                f"labels in the batch); got {type(output).__name__} without one"
            )
        # A copy for the Trainer, which scales it in place (`loss *= world`): the checks keep
        # the forward's own value. The copy's backward passes the gradient through unchanged.
        output["loss"] = self._attached().loss(loss).clone()
        return output

    def _replay(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """A micro-batch's loss recomputed as the Trainer's forward computed it (accelerate's
        autocast is in the model's forward), without the hooks that keep and check the fit's."""
        self._replaying = True
        try:
            return model(**batch)["loss"]  # a ModelOutput or a plain mapping, as in the fit
        finally:
            self._replaying = False

    def _backpropagated(self, loss: torch.Tensor, micro_batches: int) -> torch.Tensor:
        """What the Trainer backpropagates of a micro-batch's loss, op for op: compute_loss
        multiplies a loss normalised by the tokens of the whole step (num_items_in_batch) by
        the processes, when it averages tokens across them; training_step divides any other by
        the step's micro-batches."""
        if not self._counted:
            return loss / micro_batches
        return loss * self._world if self._average else loss

    def _detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._in_step = False
        if self.guard is not None:
            self.guard.close()


def _trainer_of(callback: SDCGuardCallback) -> transformers.Trainer:
    """The Trainer whose train() is calling `callback` now (callbacks get no Trainer): the
    nearest caller that is one and holds it. Not any Trainer in train() that holds it: one
    whose train() raised stays `is_in_train`, and a new Trainer given the same callback to
    retry was refused as a second holder."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, transformers.Trainer) and callback in owner.callback_handler.callbacks:
            return owner
        frame = frame.f_back
    raise ValueError("callbacks: SDCGuardCallback runs in a Trainer's callbacks, from its train()")


def _refuse_unservable(trainer: transformers.Trainer) -> None:
    """One ValueError line for a fit whose backpropagated loss, reduction or checkpoints the
    callback cannot reproduce or gate as it is: the Trainer's settings first, then its
    parallelism."""
    args = trainer.args
    cls = type(trainer)
    if (
        cls.compute_loss is not transformers.Trainer.compute_loss
        or cls.training_step is not transformers.Trainer.training_step
        or trainer.loss_is_scaled_for_ga is not None
    ):
        raise ValueError(
            f"Trainer: the Trainer's own compute_loss and training_step are allowed; {cls.__name__}"
            " computes or scales its loss itself, which replay cannot recompute"
        )
    if trainer.compute_loss_func is not None:
        raise ValueError(
            "compute_loss_func: None is allowed (replay recomputes the model's own outputs.loss)"
        )
    if trainer.label_smoother is not None:
        raise ValueError(
            f"label_smoothing_factor: 0 is allowed; got {args.label_smoothing_factor} (the "
            "Trainer smooths outside the model's forward, where replay does not recompute)"
        )
    if args.fp16:
        raise ValueError(
            "fp16: bf16 or float32 are allowed (float16's GradScaler multiplies the loss by a "
            "scale that changes between steps and overflows to inf on purpose)"
        )
    if trainer.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        raise ValueError(
            "accelerator_config.gradient_accumulation_kwargs.sync_each_batch: False is allowed "
            "(the checks watch one reduction per optimizer step)"
        )
    if args.save_strategy == SaveStrategy.BEST:
        raise ValueError(
            "save_strategy: 'no', 'steps' or 'epoch' are allowed; 'best' decides to save after "
            "the last event a callback gets before the save, so the checks could not gate it"
        )
    wrapped = trainer.model_wrapped
    if not isinstance(wrapped, DDP):
        raise ValueError(
            "model: SDCGuardCallback serves DistributedDataParallel (torchrun, one process per "
            f"device); the Trainer wrapped the model as {type(wrapped).__name__} (a single "
            "process, DataParallel, FSDP, DeepSpeed and torch_compile are not served)"
        )
