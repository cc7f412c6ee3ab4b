"""A user's own training loop, written from docs/guard.md with no harness code but the Guard:
a transformers Qwen2 (attention dropout), micro-batches accumulated without a reduction, bf16
autocast, clipping, AdamW as LLM recipes set it, under DDP or FSDP2's `fully_shard` (FSDP or
HSDP), run under torchrun.

    torchrun --standalone --nproc-per-node=N tests/loops/user_loop.py OUT
        [--parallel ddp|fsdp|hsdp] [--shard-size S] [--detectors JSON] [--mode observe|act]
        [--inject JSON] [--steps N] [--accumulate K] [--guard-off] [--twin]
        [--ending return|exit|close] [--costs FILE]

`--ending` is how the loop ends after an alarm: `return` (destroy the group, return from main),
`exit` (destroy the group, sys.exit with the alarm's code), `close` (the loop inside the Guard's
`with` block, which closes it before the group is destroyed and the loop exits with the code).
`--twin` first trains the same loop without the guard in the same processes (a clean run's
reference, without a second launch). Writes OUT/rank<r>.json: the SHA-256 of the weights this
rank holds (and the twin's, `unguarded`), the alarm, the checks that ran and this rank's alerts;
with `--costs`, what each check cost (guard.write_costs).
"""

import argparse
import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.guard import Guard, SDCAlarm

SEQUENCES, LENGTH, VOCAB = 4, 32, 128


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=96, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=LENGTH,
        attention_dropout=0.1, use_cache=False,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def batch(rank: int, step: int, micro: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_007 * step + 101 * micro + rank)
    tokens = torch.randint(VOCAB, (SEQUENCES, LENGTH), generator=gen)
    return {"input_ids": tokens, "labels": tokens}


def loss_of(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(**batch).loss


def wrapped(model: torch.nn.Module, parallel: str, shard_size: int) -> torch.nn.Module:
    if parallel == "ddp":
        return DDP(model)
    world = dist.get_world_size()
    if parallel == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
    else:
        shape = (world // shard_size, shard_size)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        h.update(local.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checks(value: str) -> str | list | dict:
    """`all`, or the JSON of a list of check names or a mapping name -> parameters."""
    return value if value == "all" else json.loads(value)


def train(model, optimizer, guard: Guard | None, args: argparse.Namespace, rank: int) -> None:
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(args.accumulate):
            last = micro == args.accumulate - 1
            if args.parallel == "ddp":
                sync = contextlib.nullcontext() if last else model.no_sync()
            else:
                model.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            data = batch(rank, step, micro)
            with sync:
                if guard:
                    guard.audit_batch(data)
                loss = loss_of(model, data)
                if guard:
                    loss = guard.loss(loss)
                (loss / args.accumulate).backward()
        if guard:
            guard.before_step()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        optimizer.step()
        if guard:
            guard.after_step(optimizer)


def built(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = wrapped(build_model(), args.parallel, args.shard_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                  weight_decay=0.1)  # fmt: skip
    return model, optimizer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--parallel", choices=("ddp", "fsdp", "hsdp"), default="ddp")
    parser.add_argument("--shard-size", type=int, default=2)
    parser.add_argument("--detectors", type=checks, default="all")
    parser.add_argument("--mode", default="act")
    parser.add_argument("--inject", type=json.loads, default=None)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--guard-off", action="store_true")
    parser.add_argument("--twin", action="store_true")
    parser.add_argument("--ending", choices=("return", "exit", "close"), default="exit")
    parser.add_argument("--costs", type=Path, default=None)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    unguarded = None
    if args.twin:
        model, optimizer = built(args)
        train(model, optimizer, None, args, rank)
        unguarded = digest(model)
    model, optimizer = built(args)
    guard = None
    if not args.guard_off:
        guard = Guard(model, detectors=args.detectors, mode=args.mode, inject=args.inject,
                      replay_fn=loss_of, ranks_per_node=1)  # fmt: skip
    try:
        with guard if args.ending == "close" and guard else contextlib.nullcontext():
            train(model, optimizer, guard, args, rank)
    except SDCAlarm as alarm:
        record(args, model, guard, alarm, unguarded)
        dist.destroy_process_group()
        if args.ending == "return":
            return 0
        sys.exit(alarm.exit_code)
    record(args, model, guard, None, unguarded)
    dist.destroy_process_group()
    return 0


def record(
    args: argparse.Namespace,
    model: torch.nn.Module,
    guard: Guard | None,
    alarm: SDCAlarm | None,
    unguarded: str | None,
) -> None:
    result = {"digest": digest(model), "unguarded": unguarded, "alarm": None}
    if alarm is not None:
        keys = ("detector", "step", "suspect_ranks", "exit_code")
        result["alarm"] = {key: getattr(alarm, key) for key in keys}
    if guard:
        result["checks"] = sorted(guard.checks)
        result["alerts"] = [{"step": a.step, "detector": a.detector,
                             "suspect_ranks": a.suspect_ranks} for a in guard.alerts]  # fmt: skip
        if args.costs is not None:
            guard.write_costs(args.costs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
