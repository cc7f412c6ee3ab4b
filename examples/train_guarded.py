"""A small language model trained in a hand-written DDP loop, with the guard attached
(harness/guard.py).

    torchrun --standalone --nproc-per-node=4 examples/train_guarded.py --out DIR
        [--model gpt|gpt2|llama] [--hidden H] [--layers L] [--heads A] [--dropout P]
        [--accumulate K] [--amp] [--clip C] [--cpu-numerics emulated|native]
        [--detectors JSON] [--mode observe|act] [--inject JSON] [--comm-hook none|fp16|bf16]
        [--steps N] [--guard-off] [--resume] [--checkpoint-every K] [--ranks-per-node K]

`--model` picks the harness's small GPT (no dropout) or a transformers GPT-2 or Llama built from
its config at the sizes given (random init; the `hf` extra), with `--dropout P` in every dropout
the config has. `--accumulate K` trains K micro-batches per step (the first K-1 under
`ddp.no_sync()`), each passed to `guard.audit_batch` before its forward and backpropagated as
loss / K. `--amp` runs forward and loss under `torch.autocast` in bfloat16 over float32
weights (its products through float32 kernels, as tensor cores compute them, unless
`--cpu-numerics native`: harness/runtime/numerics.py); `--clip C` clips the gradient's global
norm to C after the guard's checks (`guard.before_step()`) and before the optimizer step, where
an LLM recipe clips.

`--detectors` maps check names to their parameters (default: every check the guard offers, at
its defaults, replay included); `--inject` takes the keys of `fault.*` to rehearse a fault;
`--guard-off` trains the same loop without the guard (the reference for its overhead);
`--resume` restarts from the guard's restore point in DIR/checkpoints. `--ranks-per-node`
defaults to 1: every rank its own simulated node, so that replay has the three nodes it needs
under `--standalone`; on a real cluster give the ranks per host.

Writes DIR/summary.json: {"steps", "alarm", "alerts", "warnings", "exit_code", "digest", "losses",
"step_time_s", "replay_bytes", "replay_transfer_s"}, and exits with `exit_code` (0, or the
guard's code after an alarm in act mode: 86 suspect hardware, 87 could not attribute).
"""

import argparse
import contextlib
import gc
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import detectors
from harness import losses
from harness.guard import Guard, SDCAlarm
from harness.runtime import checkpoint, numerics
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


def user_batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch, as a data loader would hand it over: sequences that count up by
    a stride of their own, with a few random tokens; no other rank can regenerate it."""
    gen = torch.Generator().manual_seed(1_000_003 * step + 1_009 * micro + rank)
    n, t, vocab = MODEL.micro_batch_size, MODEL.context + 1, MODEL.vocab
    start = torch.randint(vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    tokens = (start + stride * torch.arange(t)) % vocab
    noise = torch.rand(n, t, generator=gen) < 0.05
    tokens = torch.where(noise, torch.randint(vocab, (n, t), generator=gen), tokens)
    return tokens[:, :-1], tokens[:, 1:]


def build_model(args: argparse.Namespace) -> nn.Module:
    """The model, from the seed: the harness's GPT, or a transformers GPT-2 or Llama."""
    torch.manual_seed(0)
    shape = dict(d_model=args.hidden, layers=args.layers, heads=args.heads)
    if args.model == "gpt":
        return GPT(replace(MODEL, **shape))
    import transformers  # the `hf` extra: only these two models need it

    common = dict(vocab_size=MODEL.vocab, bos_token_id=0, eos_token_id=0, use_cache=False)
    if args.model == "gpt2":
        p = args.dropout
        config = transformers.GPT2Config(
            n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
            n_positions=MODEL.context, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, **common,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    # Llama's feed-forward width: 8/3 of the hidden size, rounded up to a multiple of 8.
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=-(-8 * args.hidden // 24) * 8,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=MODEL.context,
        attention_dropout=args.dropout, **common,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def loss_function(amp: bool):
    """The one function from batch to loss: the loop trains on it, replay recomputes it (under
    autocast too, with --amp)."""

    def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp)
        with autocast:
            return losses.cross_entropy(model(inputs), targets)

    return loss_of


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
    parser.add_argument("--model", choices=("gpt", "gpt2", "llama"), default="gpt")
    parser.add_argument("--hidden", type=int, default=MODEL.d_model)
    parser.add_argument("--layers", type=int, default=MODEL.layers)
    parser.add_argument("--heads", type=int, default=MODEL.heads)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--cpu-numerics", choices=numerics.NUMERICS, default="emulated")
    args = parser.parse_args()
    if args.model == "gpt" and args.dropout:
        parser.error("--dropout: the harness's gpt has no dropout; use --model gpt2 or llama")
    if args.accumulate < 1:
        parser.error(f"--accumulate: {args.accumulate} must be at least 1")
    loss_of = loss_function(args.amp)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = args.out / "checkpoints"
    model = build_model(args)
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

    alarm, exit_code, done, trained, times = None, 0, start, [], []
    # bfloat16 products (--amp) through float32 kernels, as tensor cores compute them: the
    # CPU's own bfloat16 GEMM is about 45x slower (harness/runtime/numerics.py).
    with numerics.installed(args.cpu_numerics, "cpu"):
        try:
            for step in range(start, args.steps):
                started = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                step_loss = 0.0
                for micro in range(args.accumulate):
                    last = micro == args.accumulate - 1
                    batch = user_batch(rank, step, micro)
                    with contextlib.nullcontext() if last else ddp.no_sync():
                        if guard:
                            guard.audit_batch(batch)  # before the forward: its random state too
                        loss = loss_of(ddp, batch)
                        if guard:
                            loss = guard.loss(loss)
                        (loss / args.accumulate).backward()
                    step_loss += loss.item() / args.accumulate
                if guard:
                    guard.before_step()
                if args.clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
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
                trained.append(step_loss)
                done = step + 1
        except SDCAlarm as exc:
            alarm = {"detector": exc.detector, "step": exc.step, "suspect_ranks": exc.suspect_ranks,
                     "suspect_machines": exc.suspect_machines}  # fmt: skip
            exit_code = exc.exit_code

    keys = ("step", "detector", "phase", "suspect_ranks", "rank")
    mine = [{k: getattr(a, k) for k in keys} for a in (guard.alerts if guard else [])]
    mine += [{"warning": w.what, "step": w.step, "rank": w.rank}
             for w in (guard.warnings if guard else [])]  # fmt: skip
    every: list[list[dict]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    if rank == 0:
        shipped = guard.shipped if guard else None
        found = [a for r in every for a in r]
        summary = {
            "steps": done, "alarm": alarm, "alerts": [a for a in found if "warning" not in a],
            "warnings": [a for a in found if "warning" in a],
            "exit_code": exit_code, "digest": digest(model), "losses": trained,
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
