"""A transformers causal LM trained by a plain `transformers.Trainer` under DDP, with the guard
attached as a callback (harness/integrations/transformers.py).

    torchrun --standalone --nproc-per-node=4 examples/train_hf_trainer.py --out DIR
        [--detectors JSON] [--mode observe|act] [--inject JSON] [--steps N]
        [--rehearse JSON] [--save-every K] [--guard-off] [--twin] [--ranks-per-node K]

A Qwen2 from a small config (random init, nothing downloaded; attention dropout 0.1) trains on
synthetic token sequences, each rank on its own share of them (accelerate shards the loader),
as an LLM recipe sets the Trainer: two accumulated micro-batches a step, bf16 autocast over
float32 weights, clipping at 1.0, AdamW, a checkpoint every `--save-every` steps into
DIR/checkpoints, on the CPU over gloo (one thread a rank). `--detectors` maps check names to
their parameters (default: "all", every check that applies, at its defaults); `--inject` takes
the keys of `fault.*` to rehearse a fault; `--mode` defaults to act. `--guard-off` trains without
the callback; `--twin` first trains the same thing without it in the same processes (a fresh
model and Trainer, the same seed): the bit-identity reference, without a second launch;
`--rehearse JSON` then trains once more with that fault rehearsed, into DIR/rehearsal (its
record under "rehearsal"): a clean fit and a rehearsal in one launch.
`--ranks-per-node` defaults to 1 and SDC_NODE_NAME to "host{node}": every rank its own simulated
machine, so that replay has the three nodes it needs under `--standalone`.

Writes DIR/rank<r>.json: {"digest", "unguarded" (the twin's digest), "steps", "checks",
"left_out", "alerts", "warnings", "alarm" (detector, step, suspect_ranks, suspect_machines),
"exit_code", "step_ms", "unguarded_step_ms"} (the median step, on_step_end to on_step_end),
DIR/costs.json (what each check cost, `sdc-plan --costs`) when a clean fit trained past the
guard's warm-up,
and exits with the first fit's `exit_code` that is not 0: the alarm's (86 suspect hardware, 87 not
attributed); 2 with one line for a setting the callback refuses.
"""

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from harness.guard import SDCAlarm
from harness.integrations.transformers import SDCGuardCallback

SEQUENCES, LENGTH, VOCAB = 512, 32, 128


class Tokens(torch.utils.data.Dataset):
    """Sequences that count up by a stride of their own, with a few random tokens: what a
    tokenized corpus hands the Trainer (`labels` are the inputs; the model shifts them)."""

    def __len__(self) -> int:
        return SEQUENCES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        start = torch.randint(VOCAB, (1,), generator=gen)
        stride = torch.randint(1, 4, (1,), generator=gen)
        tokens = (start + stride * torch.arange(LENGTH)) % VOCAB
        noise = torch.rand(LENGTH, generator=gen) < 0.05
        tokens = torch.where(noise, torch.randint(VOCAB, (LENGTH,), generator=gen), tokens)
        return {"input_ids": tokens, "labels": tokens}


class StepClock(transformers.TrainerCallback):
    """The time of each on_step_end: a step is the time between two."""

    def __init__(self):
        self.marks: list[float] = []

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self.marks.append(time.perf_counter())

    def median_ms(self) -> float | None:
        """The median step after the first (which pays for start-up)."""
        steps = [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return 1000 * statistics.median(steps) if steps else None


def build_model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
        attention_dropout=0.1, use_cache=False,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def trainer_for(
    out: Path, args: argparse.Namespace, callbacks: list[transformers.TrainerCallback]
) -> transformers.Trainer:
    """A fresh model and Trainer, the same for every run of the example."""
    training = transformers.TrainingArguments(
        output_dir=str(out), use_cpu=True, ddp_backend="gloo", seed=0,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=args.steps,
        learning_rate=1e-3, bf16=True, max_grad_norm=1.0,
        save_strategy="steps" if args.save_every else "no", save_steps=args.save_every or 1,
        logging_strategy="no", report_to=[], disable_tqdm=True, ddp_find_unused_parameters=False,
    )  # fmt: skip
    return transformers.Trainer(
        model=build_model(), args=training, train_dataset=Tokens(), callbacks=callbacks
    )


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checks(value: str) -> str | list | dict:
    """`all`, or the JSON of a list of check names or a mapping name -> parameters."""
    return value if value == "all" else json.loads(value)


def unguarded(args: argparse.Namespace) -> dict:
    """The twin: the same fit without the callback, its digest and step time. Its Trainer (and
    the DDP wrapper in it) is gone when this returns: kept to the end of `main`, it was freed at
    the interpreter's exit, after the process group, and a rank could wait forever in DDP's
    reducer tearing down gloo's threads."""
    clock = StepClock()
    twin = trainer_for(args.out / "twin", args, [clock])
    twin.train()
    record = {"unguarded": digest(twin.model), "unguarded_step_ms": clock.median_ms()}
    del twin
    gc.collect()  # the Trainer and its accelerator hold each other
    return record


def guarded(args: argparse.Namespace, out: Path, inject: dict | None) -> dict:
    """One Trainer with the callback (or without, `--guard-off`), checkpoints into
    out/checkpoints; what this rank saw."""
    clock = StepClock()
    guard = None if args.guard_off else SDCGuardCallback(
        detectors=args.detectors, mode=args.mode, inject=inject,
        checkpoints=out / "checkpoints", ranks_per_node=args.ranks_per_node,
    )  # fmt: skip
    trainer = trainer_for(out / "checkpoints", args, [c for c in (guard, clock) if c])
    record: dict = {"alarm": None, "exit_code": 0}
    try:
        trainer.train()
    except SDCAlarm as alarm:
        record["alarm"] = {"detector": alarm.detector, "step": alarm.step,
                           "suspect_ranks": alarm.suspect_ranks,
                           "suspect_machines": alarm.suspect_machines}  # fmt: skip
        record["exit_code"] = alarm.exit_code
    checked = guard.guard if guard else None
    if (
        checked
        and record["alarm"] is None
        and checked.step - checked.start_step > checked.warmup_steps
    ):
        checked.write_costs(out / "costs.json")  # costs() raises within the warm-up
    return record | {
        "digest": digest(trainer.model),
        "steps": trainer.state.global_step,
        "checks": sorted(checked.checks) if checked else [],
        "left_out": checked.left_out if checked else {},
        "alerts": [{"step": a.step, "detector": a.detector, "phase": a.phase,
                    "suspect_ranks": a.suspect_ranks} for a in checked.alerts] if checked else [],
        "warnings": [{"warning": w.what, "step": w.step} for w in checked.warnings]
                    if checked else [],
        "step_ms": clock.median_ms(),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--detectors", type=checks, default="all")
    parser.add_argument("--mode", choices=("observe", "act"), default="act")
    parser.add_argument("--inject", type=json.loads, default=None)
    parser.add_argument("--rehearse", type=json.loads, default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--guard-off", action="store_true")
    parser.add_argument("--twin", action="store_true")
    parser.add_argument("--ranks-per-node", type=int, default=1)
    args = parser.parse_args()
    for flag in ("steps", "save_every", "ranks_per_node"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: {getattr(args, flag)} must be at least 1")

    torch.set_num_threads(1)
    # One simulated node per process, so that replay finds its three nodes on one host.
    os.environ.setdefault("SDC_NODE_NAME", "host{node}")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record: dict = {"unguarded": None, "unguarded_step_ms": None}
    try:
        if args.twin:
            record |= unguarded(args)
        record |= guarded(args, args.out, args.inject)
        if args.rehearse is not None:
            record["rehearsal"] = guarded(args, args.out / "rehearsal", args.rehearse)
    except ValueError as exc:  # a setting the callback refuses: one line, exit 2, on every rank
        if rank == 0:
            print(f"train_hf_trainer.py: error: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        sys.exit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()  # every rank's record (and rank 0's quarantine.json) is written before any exits
    dist.destroy_process_group()
    codes = [record["exit_code"], record.get("rehearsal", {}).get("exit_code", 0)]
    sys.exit(next((code for code in codes if code), 0))


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
