"""The GPU check of issue 7: one command, a few minutes, results to a folder.

    python -m benchmarks.gpu_check --out results/runs/gpu-check          # on one GPU (NCCL)
    python -m benchmarks.gpu_check --device cpu --quick --out /tmp/gc    # the same code on a CPU

1. Device-to-device copy bandwidth (bytes read + written per second) on a 4 GiB buffer, and
   one read pass (`torch.sum`) for reference.
2. `nan_inf` (first_non_finite), the weight fingerprint (bits_fingerprint) and the sketch's
   per-bucket arithmetic (rider before the allreduce, projection after) on 2^30-element
   float32 (4 GiB) and bfloat16 (2 GiB) buffers, each as a fraction of the copy bandwidth; and
   the peer method for the fingerprint (copy to the CPU, SHA-1), for the >= 10x target.
3. Per-detector step overhead on a GPT of about 110M parameters in bfloat16, world size 1 over
   NCCL (replay against itself), next to replay's floor (one forward and backward per audit).

The harness trainer runs on the CPU only (harness/workloads.py builds position indices on the
CPU, detectors/fingerprint.signs builds signs on the CPU, weight_consensus gathers a CPU tensor),
so part 3 is built here, self-contained: the same step order as harness/trainer.py and the
same arithmetic as each detector, with the detectors' own functions where they run on any
device (first_non_finite, bits_fingerprint, the sketch's project and rider_of) and replay's
signs generated on the device.
"""

import argparse
import csv
import functools
import hashlib
import json
import math
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from detectors.allreduce_sketch import project, rider_of, step_weights
from detectors.fingerprint import bits_fingerprint
from detectors.nan_inf import first_non_finite

GIB = 2**30


@dataclass(frozen=True)
class Plan:
    buffer_numel: int = 2**30  # float32 4 GiB, bfloat16 2 GiB
    reps: int = 10  # timed calls per kernel (median)
    width: int = 768  # GPT: 12 layers x 768 wide, vocabulary 16384: about 110M parameters
    layers: int = 12
    vocab: int = 16384
    context: int = 1024
    batch: int = 8  # sequences per step: 8192 tokens
    replay_intervals: tuple[int, ...] = (1, 5, 20)
    consensus_interval: int = 10
    cycle: int = 20
    rounds: int = 3
    budget_s: float = 420.0  # stop starting new rounds after this: the whole run stays < 8 min

    @classmethod
    def quick(cls) -> "Plan":
        return cls(2**20, 3, width=64, layers=2, vocab=128, context=32, batch=2,
                   replay_intervals=(1, 2, 4), consensus_interval=2, cycle=4, rounds=1)  # fmt: skip


# ---------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds per call, after one untimed call; the device is drained around each."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# ---------------------------------------------------------------- 1 and 2: kernels


def device_signs(numel: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """+1/-1 float32, as detectors/fingerprint.signs, but generated where they are used."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bits = torch.randint(0, 2, (numel,), generator=gen, device=device, dtype=torch.int8)
    return bits.float().mul_(2).sub_(1)


@functools.cache
def sketch_weights(numel: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """allreduce_sketch's weights for one step of a bucket of `numel`, on the device."""
    return tuple(w.to(device) for w in step_weights(1, 0, numel))


def sketch_check(buf: torch.Tensor, weights: tuple, rider: torch.Tensor) -> bool:
    """allreduce_sketch.on_reduced_grad: project what was received, compare within the bound."""
    got = float(project(buf, weights))
    expected, norm = (float(x) for x in rider)
    return abs(got - expected) <= 1e-3 * 4 * math.sqrt(buf.numel()) * norm


def bandwidth(plan: Plan, device: torch.device) -> dict[str, float]:
    """Copy (read + write) and read-only bandwidth in bytes per second."""
    src = torch.randn(plan.buffer_numel, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, plan.reps)
    read_s = timed(lambda: src.sum(), device, plan.reps)
    return {"copy_Bps": 2 * src.nbytes / copy_s, "read_Bps": src.nbytes / read_s}


def peer_hash(buf: torch.Tensor) -> bytes:
    """Megatron-LM's weight check for one tensor: copy to the CPU, SHA-1 (as kernels.sha1_table)."""
    return hashlib.sha1(buf.data.to("cpu").float().numpy(force=True)).digest()


def kernel_rows(plan: Plan, device: torch.device, copy_bps: float) -> list[dict]:
    """Each check on a float32 and a bfloat16 buffer: time, bytes per second, and that as a
    fraction of the copy bandwidth. The peer method takes seconds per call: 3 calls."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        buf = (torch.randn(plan.buffer_numel, device=device) * 1e-3).to(dtype)
        signs = sketch_weights(buf.numel(), device)
        rider = rider_of(buf, signs)
        checks = {
            "read (torch.sum)": (lambda b=buf: b.sum(), plan.reps),
            "nan_inf": (lambda b=buf: first_non_finite(b), plan.reps),
            "fingerprint": (lambda b=buf: bits_fingerprint(b), plan.reps),
            "sketch rider + check": (
                lambda b=buf, s=signs, r=rider: (rider_of(b, s), sketch_check(b, s, r)),
                plan.reps,
            ),
            "peer: copy to CPU + SHA-1": (lambda b=buf: peer_hash(b), min(3, plan.reps)),
        }
        for name, (fn, reps) in checks.items():
            seconds = timed(fn, device, reps)
            bps = buf.nbytes / seconds
            rows.append({"dtype": str(dtype).removeprefix("torch."), "check": name,
                         "GiB": round(buf.nbytes / GIB, 3), "ms": round(1e3 * seconds, 3),
                         "GBps": round(bps / 1e9, 1),
                         "fraction_of_copy": round(bps / copy_bps, 3)})  # fmt: skip
        del buf, signs, checks
    return rows


# ---------------------------------------------------------------- 3: the step


class Block(nn.Module):
    """The block of harness/workloads.py's GPT."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """harness/workloads.py's GPT, with its position indices on the model's device."""

    def __init__(self, plan: Plan):
        super().__init__()
        d = plan.width
        self.tok, self.pos = nn.Embedding(plan.vocab, d), nn.Embedding(plan.context, d)
        self.blocks = nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(plan.layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, plan.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch_for(step: int, plan: Plan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A pure function of the step, so replay regenerates it (random tokens: speed only)."""
    gen = torch.Generator(device=device).manual_seed(step)
    tokens = torch.randint(plan.vocab, (plan.batch, plan.context + 1), generator=gen, device=device)
    return tokens[:, :-1], tokens[:, 1:]


@dataclass
class Checks:
    """Which checks the step runs, and their state; the comm hook and the step read it."""

    nan_inf: bool = False
    sketch: bool = False
    consensus: int = 0  # every N steps; 0: off
    replay: int = 0  # every N steps; 0: off
    step: int = 0
    param_signs: dict[str, torch.Tensor] = field(default_factory=dict)
    own: dict[str, float] = field(default_factory=dict)
    alerts: int = 0

    def use(self, nan_inf: bool = False, sketch: bool = False, consensus: int = 0,
            replay: int = 0) -> None:  # fmt: skip
        self.nan_inf, self.sketch, self.consensus, self.replay = nan_inf, sketch, consensus, replay

    def audited(self) -> bool:
        return self.replay > 0 and self.step % self.replay == 0


def comm_hook(checks: Checks, bucket):
    """Sites 3-5 of harness/trainer.py's hook: local checks, one allreduce (riders appended to
    float32 buckets, a collective of their own otherwise), checks on the average."""
    buffer = bucket.buffer()
    if checks.nan_inf and first_non_finite(buffer) is not None:
        checks.alerts += 1
    if checks.audited():
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            checks.own[str(id(p))] = _projection(checks, str(id(p)), g)
    buffer.div_(dist.get_world_size())
    weights = sketch_weights(buffer.numel(), buffer.device) if checks.sketch else None
    rider = rider_of(buffer, weights) if weights is not None else None
    n = buffer.numel()
    if buffer.dtype == torch.float32:
        slot = torch.zeros(8, device=buffer.device)  # the trainer always appends its slots
        if rider is not None:
            slot[:2] = rider
        future = dist.all_reduce(torch.cat([buffer, slot]), async_op=True).get_future()
    else:
        futures = [dist.all_reduce(buffer, async_op=True).get_future()]
        if rider is not None:
            futures.append(dist.all_reduce(rider, async_op=True).get_future())
        future = torch.futures.collect_all(futures)

    def reduced(fut):
        summed = None
        if buffer.dtype == torch.float32:
            result = fut.value()[0]
            buffer.copy_(result[:n])
            summed = result[n : n + 2]
        elif rider is not None:
            summed = fut.value()[1].value()[0]
        if checks.nan_inf and first_non_finite(buffer) is not None:
            checks.alerts += 1
        if rider is not None and not sketch_check(buffer, weights, summed):
            checks.alerts += 1
        return buffer

    return future.then(reduced)


def _projection(checks: Checks, name: str, grad: torch.Tensor) -> float:
    """replay's _project: a float64 projection onto the tensor's signs."""
    if name not in checks.param_signs:
        checks.param_signs[name] = device_signs(
            grad.numel(), grad.device, zlib.crc32(name.encode())
        )
    flat = grad.reshape(-1).double()
    return float(torch.dot(flat, checks.param_signs[name].double()))


def consensus(model: nn.Module, device: torch.device) -> None:
    """weight_consensus: two words per tensor, gathered from every replica."""
    words = [w for p in model.parameters() for w in bits_fingerprint(p)]
    mine = torch.tensor(words, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(table, mine)


def replay(model: nn.Module, checks: Checks, plan: Plan, device: torch.device) -> None:
    """replay.on_audit against itself: recompute loss and gradient of this step's batch,
    project, and gather (own, replay) rows."""
    params = list(model.parameters())
    loss = loss_of(model, batch_for(checks.step, plan, device))
    grads = torch.autograd.grad(loss, params)
    dots = [_projection(checks, str(id(p)), g) for p, g in zip(params, grads, strict=True)]
    row = torch.tensor([float(loss.detach()), math.fsum(dots)], dtype=torch.float64, device=device)
    table = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(table, row)


def train_steps(ddp: DDP, model, opt, checks: Checks, plan: Plan, device, steps: int) -> list:
    """Seconds of each of `steps` steps (the device drained at each step's end)."""
    times = []
    for _ in range(steps):
        sync(device)
        started = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(ddp, batch_for(checks.step, plan, device))
        loss.backward()
        if checks.audited():
            replay(model, checks, plan, device)
        opt.step()
        if checks.consensus and (checks.step + 1) % checks.consensus == 0:
            consensus(model, device)
        sync(device)
        times.append(time.perf_counter() - started)
        checks.step += 1
    return times


def amortized(times: list[float], cycle: int, first_step: int) -> float:
    """Per-position medians over the cycle, averaged (see benchmarks/worlds.py)."""
    at: dict[int, list[float]] = {}
    for i, seconds in enumerate(times):
        at.setdefault((first_step + i) % cycle, []).append(seconds)
    return statistics.fmean(statistics.median(v) for v in at.values())


def configs(plan: Plan) -> dict[str, dict]:
    """The detector settings timed, by name (each against the step without detectors)."""
    every = plan.consensus_interval
    named = {
        "nan_inf": {"nan_inf": True},
        "weight_consensus": {"consensus": every},
        "allreduce_sketch": {"sketch": True},
        "checks": {"nan_inf": True, "consensus": every, "sketch": True},
    }
    return named | {f"replay@{k}": {"replay": k} for k in plan.replay_intervals}


def overhead_rows(plan: Plan, device: torch.device, deadline: float) -> tuple[list[dict], dict]:
    """overhead.csv rows for the GPT step, and the step and floor times."""
    model = GPT(plan).to(device=device, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    checks = Checks()
    ddp.register_comm_hook(checks, comm_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    named = configs(plan)
    steps = plan.cycle + 2

    def trial(settings: dict) -> float:
        checks.use(**settings)
        checks.step = (checks.step // plan.cycle + 1) * plan.cycle  # start on a cycle boundary
        times = train_steps(ddp, model, opt, checks, plan, device, steps)
        return amortized(times[2:], plan.cycle, 2)

    trial({})  # warm-up: kernels, allocator, DDP's bucket rebuild
    ratios: dict[str, list[float]] = {name: [] for name in named}
    base_times = []
    for r in range(plan.rounds):
        if r and time.monotonic() > deadline:
            break
        before = trial({})
        for name in list(named) if r % 2 == 0 else reversed(list(named)):
            seconds, after = trial(named[name]), trial({})
            ratios[name].append(2 * seconds / (before + after))
            base_times += [before, after]
            before = after
    step_s = statistics.median(base_times)
    floor_s = timed(lambda: _forward_backward(model, plan, device), device, 5)
    rows = _rows(ratios, plan, step_s, floor_s)
    return rows, {"params": params, "step_ms": 1e3 * step_s, "forward_backward_ms": 1e3 * floor_s}


def _forward_backward(model: nn.Module, plan: Plan, device: torch.device) -> None:
    loss = loss_of(model, batch_for(0, plan, device))
    torch.autograd.grad(loss, list(model.parameters()))


def _rows(ratios: dict, plan: Plan, step_s: float, floor_s: float) -> list[dict]:
    def pct(name: str) -> float:
        return round(100 * (statistics.median(ratios[name]) - 1), 3)

    rows = [
        {"detector": "nan_inf", "interval": 1, "overhead_pct": pct("nan_inf")},
        {"detector": "weight_consensus", "interval": plan.consensus_interval,
         "overhead_pct": pct("weight_consensus")},
        {"detector": "allreduce_sketch", "interval": 1, "overhead_pct": pct("allreduce_sketch")},
        {"detector": "nan_inf+weight_consensus+allreduce_sketch", "interval": "",
         "overhead_pct": pct("checks")},
    ]  # fmt: skip
    for row in rows:
        row["floor_pct"] = ""  # memory floors: see the kernel table, in fractions of bandwidth
    rows += [{"detector": "replay", "interval": k, "overhead_pct": pct(f"replay@{k}"),
              "floor_pct": round(100 * floor_s / k / step_s, 3)}
             for k in plan.replay_intervals]  # fmt: skip
    return rows


# ---------------------------------------------------------------- the command


def init_world(device: torch.device, workdir: Path) -> None:
    """World size 1: NCCL on a GPU, gloo on the CPU; a file store, no port."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{workdir / 'pg'}", rank=0, world_size=1)


def print_table(result: dict) -> None:
    bw = result["bandwidth"]
    print(f"device: {result['device_name']}; copy {bw['copy_Bps'] / 1e9:.0f} GB/s "
          f"(read + write), read {bw['read_Bps'] / 1e9:.0f} GB/s")  # fmt: skip
    print("\n| dtype | check | ms | GB/s | fraction of copy bandwidth |\n|---|---|---:|---:|---:|")
    for r in result["kernels"]:
        print(
            f"| {r['dtype']} | {r['check']} | {r['ms']} | {r['GBps']} | {r['fraction_of_copy']} |"
        )
    ms = {(r["dtype"], r["check"]): r["ms"] for r in result["kernels"]}
    for dtype in ("float32", "bfloat16"):
        speedup = ms[dtype, "peer: copy to CPU + SHA-1"] / ms[dtype, "fingerprint"]
        print(f"fingerprint speed-up over the peer method, {dtype}: {speedup:.3g}x (target >= 10x)")
    step = result["step"]
    print(f"\nGPT {step['params'] / 1e6:.3g}M bfloat16: step {step['step_ms']:.1f} ms, "
          f"forward+backward {step['forward_backward_ms']:.1f} ms")  # fmt: skip
    print("\n| detector | interval | overhead % | floor % |\n|---|---:|---:|---:|")
    for r in result["overhead"]:
        print(f"| {r['detector']} | {r['interval']} | {r['overhead_pct']} | {r['floor_pct']} |")


def write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    for name, rows in (
        ("gpu_kernels.csv", result["kernels"]),
        ("overhead.csv", result["overhead"]),
    ):
        with open(out / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for a CPU smoke run)")
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    parser.add_argument("--out", type=Path, default=Path("results/runs") / f"gpu-check-{stamp}")
    args = parser.parse_args(argv)
    plan = Plan.quick() if args.quick else Plan()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        init_world(device, Path(tmp))
        try:
            result = run(plan, device, started + plan.budget_s)
        finally:
            dist.destroy_process_group()
    result["seconds"] = round(time.monotonic() - started, 1)
    write(args.out, result)
    print_table(result)
    print(f"\n{result['seconds']} s; results: {args.out}")
    return 0


def run(plan: Plan, device: torch.device, deadline: float) -> dict:
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    bw = bandwidth(plan, device)
    kernels = kernel_rows(plan, device, bw["copy_Bps"])
    rows, step = overhead_rows(plan, device, deadline)
    return {"device_name": name, "torch": torch.__version__, "plan": asdict(plan),
            "bandwidth": bw, "kernels": kernels, "step": step, "overhead": rows}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
