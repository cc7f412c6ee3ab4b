"""A Lightning fit with the guard as a callback: a transformers causal LM (a small Qwen2 with
attention dropout, random init) in a LightningModule, over 4 CPU processes (gloo), bf16-mixed,
clipping, checkpoints every step; under DDP two accumulated batches a step, under FSDP2
(`--strategy fsdp`: ModelParallelStrategy, `fully_shard` on each block and the model) one.

    torchrun --standalone --nproc-per-node=4 examples/train_lightning.py --out DIR \
        [--strategy ddp|fsdp] [--detectors all|JSON] [--mode observe|act] [--inject JSON] \
        [--rehearse JSON] [--steps N] [--save-every N] [--guard-off] [--twin]

(or `python examples/train_lightning.py ...`: Lightning starts the other three processes itself).
`--twin` first fits the same module without the callback in the same processes, the clean
run's reference; `--rehearse JSON` (the keys of `fault.*`) then fits it once more with that fault
rehearsed, into DIR/rehearsal: a clean fit and a rehearsal, as a team tries the callback before
it deploys it, in one launch. Each rank writes DIR/rank<r>.json: the SHA-256 of its weights (and
the twin's), the steps fitted, the median step time (and the twin's), the checks that ran, those
left out and why, its alerts and the alarm (the rehearsal's under "rehearsal"); rank 0 writes
costs.json (what each check cost) beside each clean fit's checkpoints. The process exits with
the first alarm's code: 86 suspect hardware, 87 not attributed, 0 without one; 2 with one line
for a setting the callback refuses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset

from harness.guard import SDCAlarm
from harness.integrations.lightning import SDCGuard

RANKS, SEQUENCES, LENGTH, VOCAB = 4, 4, 32, 128


class Tokens(Dataset):
    """Random token sequences, the same on every rank; Lightning's sampler splits them."""

    def __init__(self, sequences: int):
        gen = torch.Generator().manual_seed(1234)
        self.tokens = torch.randint(VOCAB, (sequences, LENGTH), generator=gen)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.Qwen2Config(
            vocab_size=VOCAB, hidden_size=96, intermediate_size=384, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
            attention_dropout=0.1, use_cache=False,
        )  # fmt: skip
        self.model = transformers.Qwen2ForCausalLM(config)

    def configure_model(self) -> None:
        """FSDP2 (ModelParallelStrategy): each block its own group, then the model's root."""
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


class StepClock(pl.Callback):
    """Wall time of each optimizer step, batch end to batch end."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = time.perf_counter()
        self._step = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self._step:
            now = time.perf_counter()
            self.times.append(now - self._last)
            self._last, self._step = now, trainer.global_step

    def median_ms(self) -> float | None:
        measured = self.times[1:]  # the first step pays for start-up
        return 1000 * statistics.median(measured) if measured else None


def fit(args: argparse.Namespace, guard: SDCGuard | None, out: Path) -> tuple[CausalLM, StepClock]:
    pl.seed_everything(0, verbose=False)
    module, clock = CausalLM(), StepClock()
    callbacks: list[pl.Callback] = [clock]
    if guard is not None:
        callbacks.append(guard)
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=out / "checkpoints",
                every_n_train_steps=args.save_every,
                save_top_k=-1,
                filename="{step}",
            )  # fmt: skip
        )
    fsdp = args.strategy == "fsdp"
    # Lightning reduce-scatters every batch under ModelParallelStrategy: no accumulation there.
    accumulate = 1 if fsdp else 2
    trainer = pl.Trainer(
        accelerator="cpu", devices=RANKS, precision="bf16-mixed",
        strategy=ModelParallelStrategy(data_parallel_size=RANKS, tensor_parallel_size=1)
        if fsdp else "ddp",
        accumulate_grad_batches=accumulate, gradient_clip_val=1.0, max_steps=args.steps,
        callbacks=callbacks, enable_checkpointing=guard is not None, logger=False,
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
    )  # fmt: skip
    data = Tokens(RANKS * SEQUENCES * accumulate * args.steps)
    trainer.fit(module, DataLoader(data, batch_size=SEQUENCES))
    return module, clock


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        p = p.to_local() if hasattr(p, "to_local") else p  # this rank's shard under FSDP2
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checks(value: str) -> str | list | dict:
    """`all`, or the JSON of a list of check names or a mapping name -> parameters."""
    return value if value == "all" else json.loads(value)


def guarded(args: argparse.Namespace, out: Path, inject: dict | None) -> dict[str, Any]:
    """One fit with the callback, checkpoints into out/checkpoints; what this rank saw."""
    guard = SDCGuard(
        detectors=args.detectors, mode=args.mode, inject=inject, checkpoints=out / "checkpoints",
        ranks_per_node=1,
    )  # fmt: skip
    record: dict[str, Any] = {"alarm": None}
    try:
        module, clock = fit(args, guard, out)
        record |= {"digest": digest(module), "step_ms": clock.median_ms()}
    except SDCAlarm as alarm:
        record["alarm"] = {
            "detector": alarm.detector, "step": alarm.step, "suspect_ranks": alarm.suspect_ranks,
            "suspect_machines": alarm.suspect_machines, "exit_code": alarm.exit_code,
        }  # fmt: skip
    g = guard.guard
    assert g is not None, "the fit started"
    record |= {"steps": g.step, "checks": sorted(g.checks), "left_out": g.left_out}
    record["alerts"] = [
        {"step": a.step, "detector": a.detector, "suspect_ranks": a.suspect_ranks} for a in g.alerts
    ]
    if record["alarm"] is None and g.step - g.start_step > g.warmup_steps:  # costs() raises before
        g.write_costs(out / "costs.json")
    return record


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--detectors", type=checks, default="all")
    parser.add_argument("--mode", choices=("observe", "act"), default="act")
    parser.add_argument("--inject", type=json.loads, default=None)
    parser.add_argument("--rehearse", type=json.loads, default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--guard-off", action="store_true")
    parser.add_argument("--twin", action="store_true")
    args = parser.parse_args()
    for flag in ("steps", "save_every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: {getattr(args, flag)} must be at least 1")
    world = int(os.environ.get("WORLD_SIZE", RANKS))
    if world != RANKS:  # Lightning's own mismatch of devices and world read as a refusal
        launch = f"torchrun --nproc-per-node={RANKS}"
        parser.error(f"the example runs on {RANKS} processes ({launch}), not {world}")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    # One simulated node per process, so that replay finds its three nodes on one host.
    os.environ.setdefault("SDC_NODE_NAME", "host{node}")

    result: dict[str, Any] = {"unguarded": None, "unguarded_step_ms": None}
    try:
        if args.twin or args.guard_off:
            twin, clock = fit(args, None, args.out)
            result |= {"unguarded": digest(twin), "unguarded_step_ms": clock.median_ms()}
        fits = [] if args.guard_off else [guarded(args, args.out, args.inject)]
        if args.rehearse is not None:
            fits.append(guarded(args, args.out / "rehearsal", args.rehearse))
            result["rehearsal"] = fits[-1]
    except ValueError as exc:  # a setting the callback refuses: one line, exit 2, on every rank
        if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
            print(f"train_lightning.py: error: {exc}", file=sys.stderr)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        return 2
    if fits:
        result |= fits[0]
    args.out.mkdir(parents=True, exist_ok=True)
    rank = torch.distributed.get_rank()
    (args.out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    torch.distributed.destroy_process_group()
    return next((f["alarm"]["exit_code"] for f in fits if f["alarm"]), 0)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main())
