"""A small language model trained in a hand-written loop, DDP or FSDP2, with the guard attached
(harness/guard/).

    torchrun --standalone --nproc-per-node=4 examples/train_guarded.py --out DIR
        [--model gpt|gpt2|llama] [--hidden H] [--layers L] [--heads A] [--dropout P]
        [--parallel ddp|fsdp|hsdp] [--shard-size S]
        [--accumulate K] [--amp] [--clip C] [--cpu-numerics emulated|native]
        [--detectors JSON] [--mode observe|act] [--inject JSON] [--comm-hook none|fp16|bf16]
        [--steps N] [--guard-off] [--resume] [--checkpoint-every K] [--ranks-per-node K]

`--model` picks the harness's small GPT (no dropout) or a transformers GPT-2 or Llama built from
its config at the sizes given (random init; the `hf` extra), with `--dropout P` in every dropout
the config has. `--parallel fsdp` shards it with FSDP2's `fully_shard` (each block, then the
root) over the world, `hsdp` over replica groups of `--shard-size` ranks. `--accumulate K`
trains K micro-batches per step (the first K-1 without a reduction: `ddp.no_sync()`, or
`set_requires_gradient_sync(False)`), each passed to `guard.audit_batch` before its forward and
backpropagated as loss / K. `--amp` runs forward and loss under `torch.autocast` in bfloat16
over float32 weights (its products through float32 kernels, as tensor cores compute them,
unless `--cpu-numerics native`: harness/runtime/numerics.py); `--clip C` clips the gradient's
global norm to C after the guard's checks (`guard.before_step()`) and before the optimizer step,
where an LLM recipe clips.

`--detectors` maps check names to their parameters (default: "all", every check the guard can
run in this loop, at its defaults); `--inject` takes the keys of `fault.*` to rehearse a fault;
`--guard-off` trains the same loop without the guard (the reference for its overhead);
`--resume` restarts from the guard's restore point in DIR/checkpoints. `--ranks-per-node`
defaults to 1, and then SDC_NODE_NAME to "host{node}": every rank its own simulated node and
machine, so that replay has the three nodes it needs under `--standalone` and an alarm names
the machine (one host's name for every rank made it name all of them: exit 87); on a real
cluster give the ranks per host, and each machine keeps its own name.

Writes DIR/summary.json: {"steps", "checks", "left_out", "alarm", "alerts", "warnings",
"exit_code", "digest", "losses", "step_time_s", "replay_bytes", "replay_transfer_s"}, and
DIR/costs.json (what each check cost, `sdc-plan --costs`) when it trained past the guard's
warm-up; exits with `exit_code` (0, or the guard's code after an alarm in act mode: 86 suspect
hardware, 87 could not attribute).
"""

import argparse
import contextlib
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

from harness import losses
from harness.errors import ConfigError
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
        autocast = torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=amp)
        with autocast:
            return losses.cross_entropy(model(inputs), targets)

    return loss_of


def shard(model: nn.Module, parallel: str, shard_size: int) -> nn.Module:
    """FSDP2 as users apply it: each transformer block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    device = next(model.parameters()).device.type
    if parallel == "fsdp":
        mesh = init_device_mesh(device, (world,))
    else:
        shape = (world // shard_size, shard_size)
        mesh = init_device_mesh(device, shape, mesh_dim_names=("replicate", "shard"))
    if isinstance(model, GPT):
        blocks = model.blocks
    elif hasattr(model, "transformer"):  # GPT-2
        blocks = model.transformer.h
    else:  # Llama
        blocks = model.model.layers
    for block in blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool) -> dict:
    if not sharded:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def resume(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The step after the guard's restore point (0: none), its state loaded."""
    step, path = Guard.restore_point(folder)
    if not path:
        return 0
    if path.endswith(".dcp"):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = state_of(model, optimizer, sharded=True)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])  # fmt: skip
    else:
        state = checkpoint.load(Path(path))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    return step + 1


def digest(model: nn.Module) -> str:
    """This rank's weights: its replica, or its own shards."""
    h = hashlib.sha256()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        h.update(local.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def checks(value: str) -> str | list | dict:
    """`all`, or the JSON of a list of check names or a mapping name -> parameters."""
    return value if value == "all" else json.loads(value)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--detectors", type=checks, default="all")
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
    parser.add_argument("--parallel", choices=("ddp", "fsdp", "hsdp"), default="ddp")
    parser.add_argument("--shard-size", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--cpu-numerics", choices=numerics.NUMERICS, default="emulated")
    args = parser.parse_args()
    if args.ranks_per_node == 1:  # simulated nodes on one host: a machine each
        os.environ.setdefault("SDC_NODE_NAME", "host{node}")
    if args.model == "gpt" and args.dropout:
        parser.error("--dropout: the harness's gpt has no dropout; use --model gpt2 or llama")
    for flag in ("steps", "checkpoint_every", "accumulate", "hidden", "layers", "heads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: {getattr(args, flag)} must be at least 1")
    if args.hidden % args.heads:
        parser.error(f"--hidden: {args.hidden} must be a multiple of --heads {args.heads}")
    if args.clip is not None and not args.clip > 0:  # a negative norm turns every gradient
        parser.error(f"--clip: {args.clip} must be above 0 (a gradient norm to clip at)")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout: {args.dropout} must be in [0, 1)")
    if args.parallel != "ddp" and args.comm_hook != "none":
        parser.error("--comm-hook: a DDP comm hook; --parallel fsdp|hsdp reduces through FSDP")
    loss_of = loss_function(args.amp)

    torch.set_num_threads(1)
    device = torch.device("cpu")
    if torch.cuda.is_available():  # torchrun's LOCAL_RANK: one GPU per rank
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    if args.parallel == "hsdp" and not (
        2 <= args.shard_size < world and world % args.shard_size == 0
    ):
        # HSDP's replicas need two shard groups at least; one group of the world is fsdp.
        groups = [d for d in range(2, world) if world % d == 0]
        if rank == 0:
            print(f"train_guarded.py: error: --shard-size: {args.shard_size} must divide the "
                  f"world of {world} ranks into two or more groups; allowed: "
                  f"{', '.join(map(str, groups)) or 'none (use --parallel fsdp)'}",
                  file=sys.stderr)  # fmt: skip
        dist.destroy_process_group()
        sys.exit(2)
    folder = args.out / "checkpoints"
    sharded = args.parallel != "ddp"
    model = build_model(args).to(device)
    model = shard(model, args.parallel, args.shard_size) if sharded else DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=MODEL.lr)
    start = resume(folder, model, optimizer) if args.resume else 0
    hook = HOOKS[args.comm_hook]
    guard = None
    if args.guard_off:
        if hook is not None:
            model.register_comm_hook(None, {"bf16": bf16_on_any_backend}.get(args.comm_hook, hook))
    else:
        try:
            guard = Guard(
                model, detectors=args.detectors, mode=args.mode, inject=args.inject,
                comm_hook=(None, hook) if hook else None, replay_fn=loss_of,
                ranks_per_node=args.ranks_per_node, checkpoints=folder, start_step=start,
                steps=args.steps if args.steps > start else None,  # a finished run resumed
            )  # fmt: skip
        except ValueError as exc:  # a setting the guard refuses: one line, exit 2, on every rank
            if rank == 0:
                print(f"train_guarded.py: error: {exc}", file=sys.stderr)
            dist.destroy_process_group()
            sys.exit(2)
    shipped = guard.shipped if guard else None

    alarm, exit_code, done, trained, times = None, 0, start, [], []
    # bfloat16 products (--amp) through float32 kernels, as tensor cores compute them: the
    # CPU's own bfloat16 GEMM is about 45x slower (harness/runtime/numerics.py).
    with numerics.installed(args.cpu_numerics, device.type):
        try:
            for step in range(start, args.steps):
                started = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                step_loss = 0.0
                for micro in range(args.accumulate):
                    last = micro == args.accumulate - 1
                    batch = tuple(t.to(device) for t in user_batch(rank, step, micro))
                    if sharded:
                        model.set_requires_gradient_sync(last)
                    with contextlib.nullcontext() if last or sharded else model.no_sync():
                        if guard:
                            guard.audit_batch(batch)  # before the forward: its random state too
                        loss = loss_of(model, batch)
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
                    state = state_of(model, optimizer, sharded)
                    if guard:
                        guard.save(state)
                    elif sharded:
                        import torch.distributed.checkpoint as dcp

                        dcp.save(state, checkpoint_id=folder / f"step_{step:06d}.dcp")
                    elif rank == 0:
                        checkpoint.save(folder / f"step_{step:06d}.pt", {"step": step, **state})
                times.append(time.perf_counter() - started)
                trained.append(step_loss)
                done = step + 1
        except SDCAlarm as exc:
            alarm = {"detector": exc.detector, "step": exc.step, "suspect_ranks": exc.suspect_ranks,
                     "suspect_machines": exc.suspect_machines}  # fmt: skip
            exit_code = exc.exit_code
        except ConfigError as exc:  # a module fault's target, checked on the first forward
            if rank == 0:
                print(f"train_guarded.py: error: {exc}", file=sys.stderr)
            guard.close()
            dist.destroy_process_group()
            sys.exit(2)

    if guard and done - start > guard.warmup_steps:
        guard.write_costs(args.out / "costs.json")
    mine = {
        "digest": digest(model),
        "alerts": [{k: getattr(a, k) for k in ("step", "detector", "phase", "suspect_ranks",
                                               "rank")} for a in (guard.alerts if guard else [])],
        "warnings": [{"warning": w.what, "step": w.step, "rank": w.rank}
                     for w in (guard.warnings if guard else [])],
    }  # fmt: skip
    if guard:
        guard.close()
    ranks = args.out / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    (ranks / f"rank{rank}.json").write_text(json.dumps(mine))
    dist.barrier()  # every rank's part is written
    if rank == 0:
        parts = [json.loads((ranks / f"rank{r}.json").read_text())
                 for r in range(dist.get_world_size())]  # fmt: skip
        summary = {
            "steps": done, "alarm": alarm,
            "checks": sorted(guard.checks) if guard else [],
            "left_out": guard.left_out if guard else {},
            "alerts": [a for part in parts for a in part["alerts"]],
            "warnings": [w for part in parts for w in part["warnings"]],
            "exit_code": exit_code,
            # One replica's weights (DDP), or every rank's shards in rank order (FSDP).
            "digest": parts[0]["digest"] if not sharded else hashlib.sha256(
                "".join(p["digest"] for p in parts).encode()).hexdigest(),
            "losses": trained,
            "step_time_s": statistics.median(times) if times else None,
            "replay_bytes": shipped.bytes if shipped else 0,
            "replay_transfer_s": shipped.seconds if shipped else 0.0,
        }  # fmt: skip
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    dist.destroy_process_group()
    sys.exit(exit_code)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
