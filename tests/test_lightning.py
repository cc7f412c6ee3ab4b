"""The guard as a Lightning callback (harness/integrations/lightning.py), through
examples/train_lightning.py on four ranks: a transformers Qwen2 with attention dropout in a
LightningModule, `Trainer(accelerator="cpu", devices=4, strategy="ddp", precision="bf16-mixed",
accumulate_grad_batches=2, gradient_clip_val=1.0, max_steps=6)`, every check at its defaults,
a ModelCheckpoint every step; each rank its own simulated machine. The ranks get torchrun's
environment (Lightning takes them as torchrun's) but are forked from one parent that imported
the example once (tests/loops/forked_ranks.py, as tests/test_hf_trainer.py says why)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    GradientAccumulationScheduler,
    ModelCheckpoint,
    OnExceptionCheckpoint,
)
from lightning.pytorch.strategies import ModelParallelStrategy

from harness.errors import ConfigError
from harness.guard import EXIT_SUSPECT_HARDWARE
from harness.integrations.lightning import SDCGuard
from tests.conftest import example_ranks, example_refusal, forked_ranks, one_forked_rank

EXAMPLE = Path(__file__).parents[1] / "examples" / "train_lightning.py"
RANKS = 4


def fit(out: Path, *args: str) -> tuple[list[dict], list[int]]:
    """Every rank's record and exit code."""
    codes, proc = example_ranks(EXAMPLE, RANKS, "--out", str(out), *args)
    files = [out / f"rank{r}.json" for r in range(RANKS)]
    assert all(f.exists() for f in files), proc.stderr[-3000:]
    return [json.loads(f.read_text()) for f in files], codes


# x3 on the largest gradient element of rank 2 at step 5, an audit of replay (every 5 steps).
SCALED = {"site": "grad", "model": "scale", "factor": 3.0, "ranks": [2], "steps": [5],
          "select": "largest"}  # fmt: skip


@pytest.fixture(
    scope="module",
    params=[
        "ddp",
        # FSDP2 through ModelParallelStrategy (each block and the model sharded, no accumulation):
        # 25 s more; the default run's Lightning fits are DDP's.
        pytest.param("fsdp", marks=pytest.mark.slow),
    ],
)
def fits(request, tmp_path_factory) -> tuple[str, Path, list[dict], list[int]]:
    """One launch, three fits in the same processes: without the callback (`--twin`), with it
    and every check at its defaults, then with it and the x3 rehearsed (`--rehearse`)."""
    out = tmp_path_factory.mktemp(request.param)
    ranks, codes = fit(out, "--twin", "--rehearse", json.dumps(SCALED), "--strategy", request.param)
    return request.param, out, ranks, codes


def test_a_clean_fit_with_every_check_is_bit_identical_to_the_fit_without_it(fits):
    strategy, out, ranks, _ = fits
    assert [r["alarm"] for r in ranks] == [None] * RANKS
    # Each rank's weights (its shard, under FSDP2) as the same rank's without the callback.
    assert [r["digest"] for r in ranks] == [r["unguarded"] for r in ranks]
    if strategy == "ddp":
        assert len({r["digest"] for r in ranks}) == 1, "every replica the same"
    assert [r["alerts"] for r in ranks] == [[]] * RANKS
    assert [r["steps"] for r in ranks] == [6] * RANKS
    # What benchmarks/integrations.py divides: each fit's median step.
    assert all(r["step_ms"] > 0 and r["unguarded_step_ms"] > 0 for r in ranks)
    # Every check that applies ran, replay and the product checks among them.
    consensus = "weight_consensus" if strategy == "ddp" else "gather_consensus"
    assert {"replay", "matmul_checksum", consensus, "allreduce_sketch"} <= set(ranks[0]["checks"])
    saved = sorted(p.name for p in (out / "checkpoints").glob("*.ckpt"))  # files or folders
    assert saved == [f"step={s}.ckpt" for s in range(1, 7)]
    costs = json.loads((out / "costs.json").read_text())
    assert costs["steps"] > 0 and set(costs["checks"]) == set(ranks[0]["checks"])


def test_a_rehearsed_gradient_fault_stops_the_fit_at_its_step_on_every_rank(fits):
    """Every rank stops before step 5's update, naming rank 2 and its machine, exits 86, and no
    checkpoint of the suspect interval (since the last clean audit) stays."""
    _, out, ranks, codes = fits
    alarm = {"detector": "replay", "step": 5, "suspect_ranks": [2],
             "suspect_machines": ["host2"], "exit_code": EXIT_SUSPECT_HARDWARE}  # fmt: skip
    rehearsals = [r["rehearsal"] for r in ranks]
    assert [r["alarm"] for r in rehearsals] == [alarm] * RANKS
    assert [r["steps"] for r in rehearsals] == [5] * RANKS, "step 5 never ended"
    assert codes == [EXIT_SUSPECT_HARDWARE] * RANKS, "every process exits 86"
    folder = out / "rehearsal" / "checkpoints"
    quarantine = json.loads((folder / "quarantine.json").read_text())
    # Replay's last clean audit, at step 0, did not see step 0's update.
    assert quarantine["first_suspect_step"] == 0 and quarantine["suspect_ranks"] == [2]
    # Lightning names a checkpoint by the steps done: step=1.ckpt is step 0's, the first
    # suspect one; step 5's was never written.
    assert sorted(quarantine["set_aside"]) == [f"step={s}.ckpt" for s in range(1, 6)]
    assert sorted(p.name for p in folder.glob("*.ckpt")) == []
    aside = sorted(p.name for p in (folder / "suspect").iterdir())
    assert aside == sorted(quarantine["set_aside"]), aside
    assert not (folder / "step=6.ckpt").exists()


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.line = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return self.line(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _scheduled_fit(port: int, results) -> None:
    """A one-rank DDP fit whose accumulation goes from 1 micro-batch a step to 2 at its second
    epoch (Lightning's GradientAccumulationScheduler), titan_replay at every step: its steps
    and the steps the checks alerted at."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    guard = SDCGuard({"titan_replay": {"num_steps": -1}}, mode="observe")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy="ddp", max_epochs=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[guard, GradientAccumulationScheduler({0: 1, 1: 2})],
    )  # fmt: skip
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2))
    results.put((trainer.global_step, sorted({a.step for a in guard.guard.alerts})))


def test_accumulation_that_changes_during_the_fit_scales_the_replayed_loss_as_lightning_does(
    tmp_path,
):
    """Lightning divides each micro-batch's loss by the accumulation of the moment; the replay
    recomputed with the fit's first (every audit of the second epoch alerted on a clean fit)."""
    steps, alerted = one_forked_rank(tmp_path, _scheduled_fit)
    assert (steps, alerted) == (4 + 2, []), (steps, alerted)


def _fits_after_an_alarm(port: int, folder: str, results) -> None:
    """One DDP rank, act mode, a checkpoint every step and one on any exception: a fit that a
    NaN in step 2's batch alarms, then a fit on the same Trainer with the same SDCGuard, then
    one with a new SDCGuard in its place. The alarm, the second fit's outcome and the folder's
    files after it, the third's outcome, what it wrote by the new guard's record, and the
    folder's files."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    poisoned = torch.randn(8, 4)
    poisoned[4] = float("nan")
    guard = SDCGuard(["nan_inf"], mode="act")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy="ddp", max_steps=4, logger=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[guard, ModelCheckpoint(folder, "{step}", every_n_train_steps=1, save_top_k=-1),
                   OnExceptionCheckpoint(folder)],
    )  # fmt: skip
    module = Tiny()

    def fit(data: torch.Tensor) -> tuple[str, str] | None:
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)
        try:
            trainer.fit(module, loader)
        except RuntimeError as error:  # SDCAlarm is one
            return type(error).__name__, str(error)
        return None

    alarm = fit(poisoned)
    second = fit(torch.randn(8, 4)), sorted(os.listdir(folder))
    fresh = SDCGuard(["nan_inf"], mode="act")
    trainer.callbacks[trainer.callbacks.index(guard)] = fresh
    third = fit(torch.randn(8, 4))
    written = [(step, path.name) for step, path in fresh.guard.written] if fresh.guard else []
    files = sorted(os.listdir(folder))
    # Two steps more, with a rehearsal past them: it ended the fit clean, never having struck.
    trainer.fit_loop.epoch_loop.max_steps = 6
    late = {"site": "grad", "model": "scale", "factor": 3.0, "ranks": [0], "steps": [50]}
    trainer.callbacks[trainer.callbacks.index(fresh)] = SDCGuard(["nan_inf"], inject=late)
    try:
        beyond = fit(torch.randn(8, 4))
    except ValueError as error:
        beyond = str(error)
    results.put((alarm, second, third, written, files, beyond))


def test_after_an_alarm_the_guard_refuses_a_new_fit_and_a_new_guard_takes_the_saves_over(
    tmp_path,
):
    """As the HF callback: the alarmed SDCGuard refuses a new fit on its Trainer, naming the
    alarm, and nothing is saved then either (OnExceptionCheckpoint included); the second fit
    trained on, each checkpoint gated twice (its gate over the alarmed one). A new SDCGuard in
    its place takes the alarmed gate off: its fit's checkpoints are written, each approved and
    recorded once (the alarmed gate had refused every one). A rehearsal past max_steps is
    refused when the fit starts."""
    folder = tmp_path / "checkpoints"
    alarm, second, third, written, files, beyond = one_forked_rank(
        tmp_path, _fits_after_an_alarm, str(folder)
    )
    assert alarm[0] == "SDCAlarm" and alarm[1].startswith("nan_inf at step 2: "), alarm
    # Lightning names a checkpoint by the steps done: the alarmed fit wrote steps 0 and 1's,
    # and nan_inf's alarm at step 2 set both aside (step 1's update shows only at step 2, and
    # moments step 0 left reach the weights at step 1's).
    before = ["quarantine.json", "suspect"]
    refused = ("RuntimeError", f"SDCGuard: an alarm ended this fit: {alarm[1]}")
    assert second == (refused, before), second
    assert third is None, third
    assert written == [(2, "step=3.ckpt"), (3, "step=4.ckpt")]
    assert files == sorted([*before, "step=3.ckpt", "step=4.ckpt"]), files
    assert beyond == "inject.steps[0]: 50 is out of range; allowed: 0..5", beyond


def _resumed_fit(port: int, folder: str, results) -> None:
    """One DDP rank, accumulating 2 micro-batches, a checkpoint every 2 steps: a fit of 2 steps,
    then one resumed from its checkpoint to 4. ModelCheckpoint saves again on the resumed fit's
    first micro-batch (its last saved step is not restored), before any step ends there."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    data = torch.utils.data.TensorDataset(torch.randn(16, 4))
    steps = []
    for max_steps, resume in ((2, None), (4, os.path.join(folder, "step=2.ckpt"))):
        torch.manual_seed(0)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy="ddp", max_steps=max_steps, logger=False,
            enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
            callbacks=[SDCGuard(["nan_inf"], mode="act"),
                       ModelCheckpoint(folder, "{step}", every_n_train_steps=2, save_top_k=-1)],
        )  # fmt: skip
        try:
            trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=resume)
        except RuntimeError as error:  # said, not a rank's traceback
            results.put(str(error))
            return
        steps.append(trainer.global_step)
    results.put((steps, sorted(os.listdir(folder))))


def test_a_fit_resumed_mid_accumulation_saves_the_restored_step_again(tmp_path):
    """The save at the resumed fit's start holds the restored weights, step 1's (it was refused
    as a checkpoint before any step had ended)."""
    got = one_forked_rank(tmp_path, _resumed_fit, str(tmp_path / "checkpoints"))
    assert got == ([2, 4], ["step=2.ckpt", "step=4.ckpt"]), got


def _observed_fit(rank: int, port: int, folder: str, results) -> None:
    """One of three DDP ranks, observe mode, weight consensus before each checkpoint and
    ModelCheckpoint's default rotation (save_top_k=1: each save removes the one before), x3 on
    rank 1's largest weight after step 2: the checkpoints' folder after the fit, and the steps
    consensus alerted at."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="3", LOCAL_WORLD_SIZE="3",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="forked",
    )  # fmt: skip
    torch.manual_seed(0)
    inject = {"site": "weight", "model": "scale", "factor": 3.0, "ranks": [1], "steps": [2],
              "select": "largest"}  # fmt: skip
    guard = SDCGuard({"weight_consensus": {"interval": 100}}, mode="observe", inject=inject)
    trainer = pl.Trainer(
        accelerator="cpu", devices=3, strategy="ddp", max_steps=5, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[guard, ModelCheckpoint(folder, "{step}", every_n_train_steps=1)],
    )  # fmt: skip
    data = torch.utils.data.TensorDataset(torch.randn(32, 4))
    try:
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2))
    except Exception as error:  # said at once, not after the test's wait
        results.put((rank, repr(error), []))
        raise
    results.put((rank, sorted(os.listdir(folder)), sorted({a.step for a in guard.guard.alerts})))


def test_in_observe_mode_a_refused_save_leaves_the_checkpoint_it_was_to_replace(tmp_path):
    """ModelCheckpoint removes the checkpoint a save replaces whether or not the save was
    written: the refused saves of steps 2 to 4 removed step 1's, the last approved one, and
    left the folder empty."""
    ctx = forked_ranks(tmp_path)
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = str(tmp_path / "checkpoints")
    procs = [ctx.Process(target=_observed_fit, args=(r, port, folder, results)) for r in range(3)]
    for proc in procs:
        proc.start()
    found = sorted(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    # Lightning names a checkpoint by the steps done: step=2.ckpt is step 1's.
    assert found == [(r, ["step=2.ckpt"], [2, 3, 4]) for r in range(3)], found


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "stop"}, "mode: 'stop' is not allowed"),
        ({"detectors": ["nan_inf", "parity"]}, "detectors: 'parity' is not allowed"),
        # A check's own settings need no world: they failed only once the fit had started.
        ({"detectors": {"nan_inf": {"bogus": 1}}}, "detectors.nan_inf.bogus: unknown key"),
        ({"detectors": {"nan_inf": 3}}, "detectors.nan_inf: 3 is not a check's settings"),
        # 0 fell back to the trainer's devices, where the Guard refuses it.
        ({"ranks_per_node": 0}, "ranks_per_node: 0 is out of range"),
    ],
)
def test_bad_arguments_are_refused_when_the_callback_is_built(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SDCGuard(**kwargs)


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"strategy": "ddp_spawn"}, "strategy: 'ddp' .* is allowed; got ddp_spawn"),
        ({"strategy": "auto"}, "strategy: .ddp. or ModelParallelStrategy .* got SingleDevice"),
        ({"strategy": "ddp", "precision": "16-true"}, "precision: .* got '16-true'"),
        (
            {"strategy": ModelParallelStrategy(), "accumulate_grad_batches": 2},
            "accumulate_grad_batches: 1 is allowed under ModelParallelStrategy",
        ),
    ],
)
def test_a_fit_the_callback_cannot_guard_is_refused_in_one_line(trainer, message):
    built = pl.Trainer(accelerator="cpu", devices=1, logger=False, **trainer)
    with pytest.raises(ValueError, match=message):
        SDCGuard().on_train_start(built, pl.LightningModule())


def test_accumulation_a_scheduler_turns_on_under_model_parallel_is_refused_at_its_step():
    built = pl.Trainer(accelerator="cpu", devices=1, logger=False, strategy=ModelParallelStrategy())
    built.accumulate_grad_batches = 2  # as GradientAccumulationScheduler sets it at an epoch
    with pytest.raises(ValueError, match="^accumulate_grad_batches: 1 is allowed under Model"):
        SDCGuard().on_before_optimizer_step(built, pl.LightningModule(), None)


@pytest.mark.parametrize("flag", ["--steps", "--save-every"])
def test_the_example_refuses_a_count_below_one_before_any_process_group(flag, monkeypatch, capsys):
    """--steps 0 raised an AssertionError on every rank, --save-every 0 wrote no checkpoint and
    exited 0."""
    assert example_refusal(EXAMPLE, monkeypatch, flag, "0") == 2
    assert capsys.readouterr().err.endswith(f"error: {flag}: 0 must be at least 1\n")


def test_the_example_refuses_a_world_it_is_not_laid_out_for(monkeypatch, capsys):
    """Its data and strategy are laid out for 4 processes: on 2, Lightning's own mismatch of
    `devices` and the world size came out as one of the callback's refusals."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert example_refusal(EXAMPLE, monkeypatch) == 2
    assert capsys.readouterr().err.endswith(
        f"error: the example runs on {RANKS} processes (torchrun --nproc-per-node={RANKS}), not 2\n"
    )
