"""The guard in a plain Hugging Face Trainer (harness/integrations/transformers.py): the example,
examples/train_hf_trainer.py, on four ranks with real DDP over gloo (a Qwen2 with attention
dropout, two accumulated micro-batches, bf16 autocast, clipping), each its own simulated
machine, and the settings the callback refuses, in this process. The ranks get torchrun's
environment but are forked from one parent that imported the example once
(tests/loops/forked_ranks.py): torchrun's four imports of transformers cost this 2-core machine
more than the fits, and torchrun stops the other ranks once one exits, where the parent sees
every rank's exit code. The documented torchrun command runs the same main()
(benchmarks/integrations.py launches it)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
import transformers

import detectors
from harness.guard import EXIT_SUSPECT_HARDWARE
from harness.integrations.transformers import SDCGuardCallback
from tests.conftest import example_ranks, example_refusal, one_forked_rank

EXAMPLE = Path(__file__).parents[1] / "examples" / "train_hf_trainer.py"
RANKS = 4
STEPS = 6


def example(out: Path, *args: str) -> tuple[list[dict], list[int]]:
    """Every rank's record and exit code."""
    codes, proc = example_ranks(EXAMPLE, RANKS, "--out", str(out), "--steps", str(STEPS), *args)
    found = [out / f"rank{r}.json" for r in range(RANKS)]
    assert all(f.exists() for f in found), proc.stderr[-3000:]
    return [json.loads(f.read_text()) for f in found], codes


def saved(folder: Path) -> list[str]:
    """The checkpoints in `folder` as the Trainer's rotation (`save_total_limit`) finds them:
    the folders matching `checkpoint-*`."""
    return sorted(p.name for p in folder.glob("checkpoint-*") if p.is_dir())


# x3 on rank 2's largest local gradient element at step 5, where replay audits (every 5 steps):
# within grad_stats' spread, and the sketch verifies only the sum of what was sent.
SCALED = {"site": "grad", "model": "scale", "factor": 3.0, "ranks": [2], "steps": [5],
          "select": "largest"}  # fmt: skip


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> tuple[Path, list[dict], list[int]]:
    """One launch, three Trainers in the same processes, a checkpoint every step: without the
    callback (`--twin`), with it and every check at its defaults, then with it and the x3
    rehearsed (`--rehearse`)."""
    out = tmp_path_factory.mktemp("hf")
    records, codes = example(out, "--twin", "--save-every", "1", "--rehearse", json.dumps(SCALED))
    return out, records, codes


def test_a_clean_fit_with_every_check_is_bit_identical_to_the_trainer_without_it(fits):
    """Every check that applies, at its defaults (replay of steps 0 and 5, titan_replay of step
    0, the product checksums, consensus before each checkpoint): no alert, no warning, and each
    rank's weights are those of the same Trainer without the callback, trained first in the same
    processes. The checkpoints the checks approved are written."""
    out, records, _ = fits
    for record in records:
        assert record["alerts"] == [] and record["warnings"] == [] and record["alarm"] is None
        assert record["steps"] == STEPS
        assert set(record["checks"]) | set(record["left_out"]) == set(detectors.available())
        assert record["digest"] == record["unguarded"]
        # What benchmarks/integrations.py divides: each fit's median step.
        assert record["step_ms"] > 0 and record["unguarded_step_ms"] > 0
    assert len({r["digest"] for r in records}) == 1, "the replicas agree"
    assert saved(out / "checkpoints") == [f"checkpoint-{n}" for n in range(1, STEPS + 1)]
    # What sdc-plan --costs reads, as the other examples write it (this one wrote none).
    costs = json.loads((out / "costs.json").read_text())
    assert costs["steps"] > 0 and set(costs["checks"]) == set(records[0]["checks"])


def test_a_scaled_gradient_stops_the_fit_at_its_step_and_sets_aside_what_it_may_have_touched(
    fits,
):
    """Act mode, a checkpoint every step: replay names rank 2 and its machine at step 5, every
    rank leaves train() with the alarm and exits 86, quarantine.json is written, nothing of step
    5 is saved (checkpoint-6), and the Trainer's checkpoints from the last clean audit's update
    on (step 0's, which the audit did not see: checkpoint-1) are set aside: the restart is from
    the initial weights."""
    out, records, codes = fits
    rehearsals = [r["rehearsal"] for r in records]
    alarm = {"detector": "replay", "step": 5, "suspect_ranks": [2], "suspect_machines": ["host2"]}
    assert [r["alarm"] for r in rehearsals] == [alarm] * RANKS
    assert [r["exit_code"] for r in rehearsals] == [EXIT_SUSPECT_HARDWARE] * RANKS
    assert [r["steps"] for r in rehearsals] == [5] * RANKS, "step 5's update never happened"
    assert codes == [EXIT_SUSPECT_HARDWARE] * RANKS, "every process exits 86"
    folder = out / "rehearsal" / "checkpoints"
    record = json.loads((folder / "quarantine.json").read_text())
    assert record["suspect_machines"] == ["host2"] and record["step"] == 5
    assert record["first_suspect_step"] == 0
    suspect = [f"checkpoint-{n}" for n in range(1, 6)]
    assert sorted(record["set_aside"]) == suspect
    # Out of the rotation's sight: a resumed run's `save_total_limit` deleted them, when they
    # were renamed in place (checkpoint-2.suspect).
    assert saved(folder) == []
    assert saved(folder / "suspect") == suspect


def tiny_trainer(out: Path, cls: type = transformers.Trainer, **settings) -> transformers.Trainer:
    """A one-step Trainer with the callback: a single process here, DDP in a rank with
    torchrun's environment."""
    config = transformers.Qwen2Config(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8,
    )  # fmt: skip
    own = ("compute_loss_func", "data_collator")
    trainer_settings = {k: settings.pop(k) for k in own if k in settings}
    tokens = torch.zeros(8, dtype=torch.long)
    return cls(
        model=transformers.Qwen2ForCausalLM(config),
        args=transformers.TrainingArguments(
            output_dir=str(out), use_cpu=True, max_steps=1, report_to=[], disable_tqdm=True,
            **settings,
        ),
        train_dataset=[{"input_ids": tokens, "labels": tokens}] * 4,
        callbacks=[SDCGuardCallback(detectors="all", mode="act")],
        **trainer_settings,
    )  # fmt: skip


class OwnLoss(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.parametrize(
    "cls, settings, refused",
    [
        (OwnLoss, {}, "Trainer: the Trainer's own compute_loss and training_step are allowed; "
                      "OwnLoss"),
        (transformers.Trainer, {"compute_loss_func": lambda outputs, labels, **kw: outputs.loss},
         "compute_loss_func: None is allowed"),
        (transformers.Trainer, {"label_smoothing_factor": 0.1},
         "label_smoothing_factor: 0 is allowed; got 0.1"),
        (transformers.Trainer, {"fp16": True}, "fp16: bf16 or float32 are allowed"),
        (transformers.Trainer,
         {"accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": True}}},
         "accelerator_config.gradient_accumulation_kwargs.sync_each_batch: False is allowed"),
        (transformers.Trainer, {"save_strategy": "best", "metric_for_best_model": "loss"},
         "save_strategy: 'no', 'steps' or 'epoch' are allowed"),
        (transformers.Trainer, {}, "model: SDCGuardCallback serves DistributedDataParallel "
                                   "(torchrun, one process per device); the Trainer wrapped the "
                                   "model as Qwen2ForCausalLM"),
    ],
)  # fmt: skip
def test_what_the_callback_cannot_guard_is_refused_in_one_line(tmp_path, cls, settings, refused):
    """When training begins, before any collective: a loss the Trainer computes or scales where
    replay cannot recompute it, a reduction per micro-batch, a save decided after the last event,
    and anything but DDP (here: a single process)."""
    trainer = tiny_trainer(tmp_path, cls, **settings)
    with pytest.raises(ValueError) as error:
        trainer.train()
    assert str(error.value).startswith(refused) and "\n" not in str(error.value)


def forward_hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


class BrokenOnce:
    """A data collator that raises on its first batch: a user's error once training has begun
    (after on_train_begin), which the Trainer tells no callback about."""

    def __init__(self):
        self.broken = True

    def __call__(self, features: list[dict]) -> dict:
        if self.broken:
            self.broken = False
            raise RuntimeError("the collator broke")
        return transformers.default_data_collator(features)


class HooksInStep(transformers.TrainerCallback):
    """The forward hooks on the model at each step's end: what watches the fit."""

    def __init__(self):
        self.seen: list[int] = []

    def on_step_end(self, args, state, control, model=None, **kwargs) -> None:
        self.seen.append(forward_hooks(model))


def _broken_rank(port: int, out: str) -> transformers.Trainer:
    """This process as torchrun starts one rank (accelerate wraps the model in DDP), and a
    Trainer whose collator raises on its first batch."""
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    return tiny_trainer(Path(out), ddp_backend="gloo", save_strategy="no",
                        data_collator=BrokenOnce())  # fmt: skip


def _train_after_an_error(port: int, out: str, results) -> None:
    """One rank as torchrun starts it (accelerate wraps the model in DDP): a fit that raised a
    RuntimeError of the collator's, then train() again on the same Trainer. The forward hooks
    the first left, the second's outcome, the hooks in its step and after it."""
    trainer = _broken_rank(port, out)
    watch = HooksInStep()
    trainer.add_callback(watch)
    first, second = "no error", "not run"
    try:
        trainer.train()
    except RuntimeError as error:
        first = str(error)
    left = forward_hooks(trainer.model)
    callback = next(
        c for c in trainer.callback_handler.callbacks if isinstance(c, SDCGuardCallback)
    )
    stale = callback.guard
    try:
        trainer.train()
        second = (stale.closed, trainer.state.global_step, callback.guard.alerts)
    except Exception as error:  # the test reports it, not a rank's traceback
        second = f"{type(error).__name__}: {error}"
    results.put((first, left, second, watch.seen, forward_hooks(trainer.model)))


def test_a_fit_that_raised_leaves_the_next_train_a_fresh_one(tmp_path):
    """The guard and hooks of a fit that ended in the user's error (not an alarm) stay on the
    model until the next train() on that Trainer begins: it closes them and trains guarded,
    each product watched once (as many hooks as the failed fit had, not its and the new
    guard's), and a fit that ends clean leaves no hook behind. The second train() was refused:
    the open guard still held DDP's comm hook."""
    first, left, second, seen, after = one_forked_rank(
        tmp_path, _train_after_an_error, str(tmp_path)
    )
    assert first == "the collator broke"
    assert second == (True, 1, []), second
    assert seen == [left] and after == 0, (left, seen, after)


def _retry_with_a_new_trainer(port: int, out: str, results) -> None:
    """One rank: a fit whose collator raised, then a new Trainer given the same callback (the
    raised one still `is_in_train`, as the Trainer leaves it): the retry's outcome."""
    raised = _broken_rank(port, out)
    with contextlib.suppress(RuntimeError):
        raised.train()
    (callback,) = [c for c in raised.callback_handler.callbacks if isinstance(c, SDCGuardCallback)]
    retry = tiny_trainer(Path(out), ddp_backend="gloo", save_strategy="no")
    handler = retry.callback_handler
    handler.callbacks = [
        callback if isinstance(c, SDCGuardCallback) else c for c in handler.callbacks
    ]
    try:
        retry.train()
        got = (raised.is_in_train, retry.state.global_step, callback.guard.alerts)
        # A rehearsal past the fit's max_steps: it ended the fit clean, never having struck.
        late = tiny_trainer(Path(out), ddp_backend="gloo", save_strategy="no")
        rehearsal = {"site": "grad", "model": "scale", "factor": 3.0, "ranks": [0], "steps": [5]}
        late.callback_handler.callbacks = [
            SDCGuardCallback(["nan_inf"], inject=rehearsal) if isinstance(c, SDCGuardCallback)
            else c for c in late.callback_handler.callbacks
        ]  # fmt: skip
        try:
            late.train()
            results.put((*got, None))
        except ValueError as error:
            results.put((*got, str(error)))
    except Exception as error:  # the test reports it, not a rank's traceback
        results.put(f"{type(error).__name__}: {error}")


def test_a_new_trainer_given_the_callback_of_one_that_raised_trains_guarded(tmp_path):
    """The callback finds the Trainer calling it; it was refused as held by two Trainers in
    train(), the one that raised counted. A rehearsal past max_steps is refused when the fit
    begins."""
    got = one_forked_rank(tmp_path, _retry_with_a_new_trainer, str(tmp_path))
    assert got == (True, 1, [], "inject.steps[0]: 5 is out of range; allowed: 0..0"), got


def test_a_wrong_mode_or_check_name_is_refused_where_the_callback_is_written():
    with pytest.raises(ValueError, match="mode: 'fix' is not allowed; allowed: observe, act"):
        SDCGuardCallback(mode="fix")
    with pytest.raises(ValueError, match="detectors: 'replays' is not allowed; allowed: "):
        SDCGuardCallback(detectors=["nan_inf", "replays"])
    with pytest.raises(ValueError, match="detectors.replay.interval: 0 is out of range"):
        SDCGuardCallback(detectors={"replay": {"interval": 0}})


class PlainOutput(torch.nn.Module):
    """A model the Trainer trains that returns a plain dict, not a ModelOutput."""

    def __init__(self):
        super().__init__()
        self.line = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.line(x).squeeze(-1) - labels).square().mean()}


def test_replay_recomputes_the_loss_of_a_model_that_returns_a_plain_dict():
    """As the fit's forward hook reads it: a mapping with "loss" (replay read `.loss`, and every
    rank raised AttributeError at the first audit)."""
    model = PlainOutput()
    batch = {"x": torch.randn(3, 4), "labels": torch.randn(3)}
    replayed = SDCGuardCallback()._replay(model, batch)
    assert torch.equal(replayed, model(**batch)["loss"])


@pytest.mark.parametrize("flag", ["--steps", "--save-every", "--ranks-per-node"])
def test_the_example_refuses_a_count_below_one_before_any_process_group(flag, monkeypatch, capsys):
    """--steps 0 trained one step and --save-every -1 saved none, both exiting 0."""
    assert example_refusal(EXAMPLE, monkeypatch, flag, "0") == 2
    assert capsys.readouterr().err.endswith(f"error: {flag}: 0 must be at least 1\n")
