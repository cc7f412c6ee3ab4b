"""A small GPT trained in a hand-written DDP loop, with the guard attached (harness/guard.py).

    torchrun --standalone --nproc-per-node=4 examples/train_guarded.py --out DIR
        [--detectors JSON] [--mode observe|act] [--inject JSON] [--comm-hook none|fp16|bf16]
        [--steps N] [--guard-off] [--resume] [--checkpoint-every K] [--ranks-per-node K]

`--detectors` maps check names to their parameters (default: every check the guard offers, at
its defaults, replay included); `--inject` takes the keys of `fault.*` to rehearse a fault;
`--guard-off` trains the same loop without the guard (the reference for its overhead);
`--resume` restarts from the guard's restore point in DIR/checkpoints. `--ranks-per-node`
defaults to 1: every rank its own simulated node, so that replay has the three nodes it needs
under `--standalone`; on a real cluster give the ranks per host.

Writes DIR/summary.json: {"steps", "alarm", "alerts", "exit_code", "digest", "losses",
"step_time_s", "replay_bytes", "replay_transfer_s"}, and exits with `exit_code` (0, or the
guard's code after an alarm in act mode: 86 suspect hardware, 87 could not attribute).
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
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import detectors
from harness.guard import Guard, SDCAlarm
from harness.runtime import checkpoint
from harness.runtime.workloads import GPT, WorkloadConfig

HOOKS = {
    "none": None,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}
MODEL = WorkloadConfig(
    name="gpt", steps=0, dtype="float32", seed=0, micro_batches=1, micro_batch_size=8, lr=3e-3,
    vocab=64, context=32, d_model=64, layers=2, heads=4,
)  # fmt: skip


def bf16_on_any_backend(state, bucket):
    """torch's bf16_compress_hook under another name: DDP refuses that name unless on NCCL,
    though gloo sums bfloat16 on the CPU too (the guard's own hook wraps it unseen)."""
    return default_hooks.bf16_compress_hook(state, bucket)


def user_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch, as a data loader would hand it over: sequences that count up by a
    stride of their own, with a few random tokens; no other rank can regenerate it."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    n, t, vocab = MODEL.micro_batch_size, MODEL.context + 1, MODEL.vocab
    start = torch.randint(vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    tokens = (start + stride * torch.arange(t)) % vocab
    noise = torch.rand(n, t, generator=gen) < 0.05
    tokens = torch.where(noise, torch.randint(vocab, (n, t), generator=gen), tokens)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The one function from batch to loss: the loop trains on it, replay recomputes it."""
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--detectors", type=json.loads, default=None)
    parser.add_argument("--mode", choices=("observe", "act"), default="observe")
    parser.add_argument("--inject", type=json.loads, default=None)
    parser.add_argument("--comm-hook", choices=tuple(HOOKS), default="none")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guard-off", action="store_true")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = args.out / "checkpoints"
    torch.manual_seed(0)
    model = GPT(MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=MODEL.lr)
    start = 0
    if args.resume:
        step, path = Guard.restore_point(folder)
        if path:
            state = checkpoint.load(Path(path))
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = step + 1
    ddp = DDP(model)
    hook = HOOKS[args.comm_hook]
    guard = None
    if args.guard_off:
        if hook is not None:
            ddp.register_comm_hook(None, {"bf16": bf16_on_any_backend}.get(args.comm_hook, hook))
    else:
        every = {name: {} for name in detectors.available()}
        checks = every if args.detectors is None else args.detectors
        guard = Guard(
            ddp, detectors=checks, mode=args.mode, inject=args.inject,
            comm_hook=(None, hook) if hook else None, replay_fn=loss_of,
            ranks_per_node=args.ranks_per_node, checkpoints=folder, start_step=start,
        )  # fmt: skip

    alarm, exit_code, done, losses, times = None, 0, start, [], []
    try:
        for step in range(start, args.steps):
            started = time.perf_counter()
            batch = user_batch(rank, step)
            if guard:
                guard.audit_batch(batch)
            loss = loss_of(ddp, batch)
            if guard:
                loss = guard.loss(loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if guard:
                guard.before_step()
            optimizer.step()
            if guard:
                guard.after_step(optimizer)
            if (step + 1) % args.checkpoint_every == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                if guard:
                    guard.save(state)
                elif rank == 0:
                    checkpoint.save(folder / f"step_{step:06d}.pt", {"step": step, **state})
            times.append(time.perf_counter() - started)
            losses.append(loss.item())
            done = step + 1
    except SDCAlarm as exc:
        alarm = {"detector": exc.detector, "step": exc.step, "suspect_ranks": exc.suspect_ranks,
                 "suspect_machines": exc.suspect_machines}  # fmt: skip
        exit_code = exc.exit_code

    mine = [{k: a[k] for k in ("step", "detector", "phase", "suspect_ranks", "rank")}
            for a in (guard.alerts if guard else [])]  # fmt: skip
    every: list[list[dict]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    if rank == 0:
        shipped = guard.shipped if guard else None
        summary = {
            "steps": done, "alarm": alarm, "alerts": [a for r in every for a in r],
            "exit_code": exit_code, "digest": digest(model), "losses": losses,
            "step_time_s": statistics.median(times) if times else None,
            "replay_bytes": shipped.bytes if shipped else 0,
            "replay_transfer_s": shipped.seconds if shipped else 0.0,
        }  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    del ddp, guard
    gc.collect()  # DDP's threads must not outlive the process group
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(exit_code)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
