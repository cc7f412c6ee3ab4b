"""The GPU check: the code that ships, timed on a GPU, in one table.

    python -m benchmarks.gpu_check --out results/runs/gpu-check              # a GPU machine
    python -m benchmarks.gpu_check --device cpu --quick --out /tmp/gc        # the same, on a CPU

Everything runs through the harness: a spawned world (harness/launch/world.py) of real DDP ranks on
the device, the campaigns' trainer, its comm hook and the detectors as they ship. On one or
two GPUs the world is 4 ranks sharing GPU 0 over gloo (`topology.device=cuda`); with 3 or more
GPUs it is one rank per GPU (up to 4) over NCCL.

1. step: each workload's step time without checks (the harness's hook; plain DDP too), and
   with each check alone at its default interval (harness/campaign/overhead.py's sandwich of timed
   runs); replay next to its floor (one forward and backward of the audited micro-batches).
2. kernel: each check's per-call work on the device (nan_inf on a bucket, the sketch's rider
   and check, weight_consensus's fingerprints of a model, matmul_checksum's forward check of
   one product with its arithmetic eager and compiled by Inductor, Triton on a GPU) against one
   read pass of the same bytes (`torch.sum`), the device synchronised around every timing.
3. host_reads: device-to-host reads per step of a clean trial with every check, in act mode
   and in observe mode (harness.core.verdicts.Verdicts counts them).

Writes OUT/gpu_check.csv and OUT/gpu_check.md: section, workload, item, value, unit, note.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from benchmarks.common import compose_run
from detectors import detector_class
from detectors.checksum_kernels import Kernels
from detectors.fingerprint import fingerprint_words
from detectors.product_bounds import Rounding, bound_of, roundoff
from harness.campaign import overhead
from harness.config.schema import FaultConfig, RunConfig, TrialSpec
from harness.core.plugins import Bucket, DetectorContext, EventLog, RankInfo
from harness.launch.world import World
from harness.runtime import devices
from harness.runtime.workloads import Workload

CHECKS = (
    "nan_inf",
    "grad_stats",
    "allreduce_sketch",
    "weight_consensus",
    "replay",
    "matmul_checksum",
)
COLUMNS = ["section", "workload", "item", "value", "unit", "note"]
# A GPT of about 17M parameters at 4096 tokens per rank per step: big enough that a step is
# compute, not kernel launches, small enough that 4 ranks share one GPU over gloo in minutes.
GPT_GPU = (
    "workload=gpt", "workload.d_model=384", "workload.heads=12", "workload.layers=6",
    "workload.vocab=8192", "workload.context=512", "workload.micro_batch_size=8",
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    workloads: dict[str, tuple[str, ...]]
    steps: int  # timed steps per run (after harness/campaign/overhead.py's warm-up)
    rounds: int
    kernel_numel: int  # elements of the bucket the kernels read
    reps: int  # timed calls per kernel and round
    model: tuple[str, ...] = GPT_GPU  # whose parameters the fingerprints read
    product: tuple[int, int, int] = (8192, 1024, 4096)  # [m, q] @ [q, p] matmul_checksum checks
    compile: bool = True  # time matmul_checksum's compiled arithmetic too
    settings: tuple[str, ...] = ()  # more overrides for every run


FULL = Plan({"mlp": ("workload=mlp",), "gpt": GPT_GPU}, steps=10, rounds=1,
            kernel_numel=25 * 2**18, reps=20)  # fmt: skip
# The same code paths at tiny sizes; intervals of 2 keep every check in a few steps.
QUICK = Plan({"mlp": ("workload=mlp",)}, steps=2, rounds=1, kernel_numel=2**14, reps=3,
             model=("workload=gpt",), product=(256, 64, 96), compile=False,
             settings=("workload.steps=12", "detectors.replay.interval=2",
                       "detectors.weight_consensus.interval=2"))  # fmt: skip


def topology(device: str) -> tuple[str, ...]:
    """4 ranks sharing one GPU over gloo, or one rank per GPU over NCCL with 3 or more; 3
    ranks on a CPU (replay and consensus need 3)."""
    if device == "cpu":
        return ("topology.nodes=3", "topology.device=cpu", "topology.backend=gloo")
    gpus = devices.gpu_count()
    if gpus >= 3:
        return (f"topology.nodes={min(gpus, 4)}", "topology.device=cuda", "topology.backend=nccl")
    return ("topology.nodes=4", "topology.device=cuda", "topology.backend=gloo")


def configure(plan: Plan, device: str, workload: tuple[str, ...]) -> RunConfig:
    checks = f"detectors=[{','.join(CHECKS)}]"
    timing = f"campaign.overhead={{steps:{plan.steps},rounds:{plan.rounds}}}"
    return compose_run("campaign=single", checks, timing, *topology(device), *workload,
                       *plan.settings)  # fmt: skip


def step_rows(name: str, run: RunConfig, world: World) -> list[dict]:
    """Section 1: step times, from harness/campaign/overhead.py's ratios and one reference run."""
    base = overhead.timed_runs(run)[overhead.REFERENCE][0]
    outcome = world.run(base, TrialSpec(f"gpu-reference-{name}", run.workload.seed, FaultConfig()))
    reference = overhead.amortized_step([overhead.step_series(outcome, "reference")], 1) * 1e3
    rounds = overhead.ratios(run, world.run)
    plain = reference / statistics.median(rounds[overhead.PLAIN])
    rows = [
        _row("step", name, "no checks (the harness's hook)", reference, "ms"),
        _row("step", name, "plain DDP, no hook", plain, "ms"),
    ]
    for row in overhead.rows(run, rounds)[1:]:
        pct, k = float(row["overhead_pct"]), row["interval"]
        note = f"{pct:+.1f}% of a step"
        if row["floor_pct"] != "":
            floor = float(row["floor_pct"])
            note += f"; floor {floor:+.2f}%, {pct / floor:.2f}x it" if floor > 0 else "; no floor"
        every = f" every {k} steps" if k not in ("", 1) else ""
        rows.append(
            _row("step", name, f"{row['detector']}{every}", reference * (1 + pct / 100), "ms", note)
        )
    return rows


def read_rows(name: str, run: RunConfig, world: World) -> list[dict]:
    """Section 3: host reads per step of a clean trial with every check, act and observe."""
    rows = []
    for mode in ("act", "observe"):
        checks = {n: c.in_mode(mode) for n, c in run.detectors.items()}
        spec = TrialSpec(f"gpu-reads-{name}-{mode}", run.workload.seed, FaultConfig())
        outcome = world.run(replace(run, detectors=checks), spec)
        if outcome.parts is None:
            raise RuntimeError(f"{spec.trial_id} crashed: {outcome.crash}")
        per_step = [max(s) for s in zip(*(p.host_reads for p in outcome.parts), strict=True)]
        note = f"{len(per_step)} steps; checkpoint every {run.checkpoint.interval}"
        rows += [
            _row("host_reads", name, f"{mode}: most in a step", max(per_step), "reads", note),
            _row("host_reads", name, f"{mode}: mean per step",
                 statistics.fmean(per_step), "reads", note),
        ]  # fmt: skip
    return rows


def kernel_rows(plan: Plan, device: torch.device) -> list[dict]:
    """Section 2: each check's per-call device work against one read pass of its bytes."""
    rows = []
    model = Workload(compose_run(*plan.model).workload, device).build_model()
    params = [p.detach() for p in model.parameters()]
    for dtype in (torch.float32, torch.bfloat16):
        bucket = _bucket(plan.kernel_numel, dtype, device)
        nan_inf, sketch = (_check(n, dtype, device) for n in ("nan_inf", "allreduce_sketch"))

        def sketch_call(b: Bucket = bucket, s=sketch) -> None:
            b.riders = {id(s): s.rider(1, b)}
            s.on_reduced_grad(1, b)
            s._log.verdicts.pending.clear()  # the verdicts' one read per step is not a kernel's

        def nan_inf_call(b: Bucket = bucket, c=nan_inf) -> None:
            c.on_local_grad(1, b)
            c._log.verdicts.pending.clear()

        typed = [p.to(dtype) for p in params]
        kind = str(dtype).removeprefix("torch.")
        mib = f"{plan.kernel_numel * bucket.buffer.element_size() / 2**20:.3g} MiB"
        weights = f"{sum(p.numel() for p in typed) / 1e6:.3g}M params"
        for item, fn, read, size in [
            ("nan_inf / read pass", nan_inf_call, lambda b=bucket: b.buffer.sum(), mib),
            ("sketch rider + check / read pass", sketch_call, lambda b=bucket: b.buffer.sum(), mib),
            ("fingerprints / read pass", lambda t=typed: [fingerprint_words(p) for p in t],
             lambda t=typed: [p.sum() for p in t], weights),
        ]:  # fmt: skip
            ratio, read_ms = _ratio(fn, read, plan.reps, device)
            rows.append(_row("kernel", "", f"{item} ({kind})", ratio, "x",
                             f"{size}; read pass {read_ms:.3f} ms"))  # fmt: skip
        rows += checksum_rows(plan, dtype, device)
    return rows


def checksum_rows(plan: Plan, dtype: torch.dtype, device: torch.device) -> list[dict]:
    """matmul_checksum's forward check of one product against one read of its operands and
    output, eager and compiled (detectors/checksum_kernels.py), and natively on a CPU; the first
    call apart."""
    m, q, p = plan.product
    left, right = (torch.randn(*shape, device=device).to(dtype) for shape in ((m, q), (q, p)))
    output = left @ right
    rounding = Rounding(roundoff(dtype), roundoff(torch.float32), 0.0, 8.0)
    bound, rows = bound_of(rounding, q, p), []
    kind = str(dtype).removeprefix("torch.")
    # A quick run's compile would be a CPU's, which tests/unit/test_checksum_kernels.py makes;
    # the C kernels are the CPU's (a GPU runs the eager path in their place).
    names = ["eager", *(["compiled"] if plan.compile else [])]
    for name in names + (["native"] if device.type == "cpu" else []):
        kernels = Kernels(name)

        def check(k: Kernels = kernels) -> object:
            return k.output(left, right, output, None, dtype, 1.0, 1.0, False, bound,
                            not rounding.fine, False)  # fmt: skip

        started = time.perf_counter()
        check()
        devices.synchronize(device)
        first = time.perf_counter() - started
        ratio, read_ms = _ratio(check, lambda: [t.sum() for t in (left, right, output)],
                                plan.reps, device)  # fmt: skip
        rows.append(_row("kernel", "", f"matmul_checksum forward, {name} / read pass ({kind})",
                         ratio, "x", f"[{m}x{q}] @ [{q}x{p}]; read pass {read_ms:.3f} ms; "
                         f"first call {first:.2f} s"))  # fmt: skip
    return rows


def _check(name: str, dtype: torch.dtype, device: torch.device):
    """A real detector on rank 0 of a one-rank world on `device`."""
    cls = detector_class(name)
    info = RankInfo(0, 1, 1, str(device))
    model = torch.nn.Linear(1, 1).to(device=device, dtype=dtype)
    ctx = DetectorContext(info, model, None, steps=2, data=((0,),))
    return cls(cls.configure(name, {}, None), ctx, EventLog(0, 0))


def _bucket(numel: int, dtype: torch.dtype, device: torch.device, tensors: int = 16) -> Bucket:
    buffer = (torch.randn(numel, device=device) * 1e-3).to(dtype)
    bounds = torch.linspace(0, numel, tensors + 1).long().tolist()
    spans = zip(bounds[:-1], bounds[1:], strict=True)
    views = [(f"layer{i}.weight", buffer[a:b]) for i, (a, b) in enumerate(spans)]
    return Bucket(index=0, buffer=buffer, tensors=views, is_last=True)


def _ratio(
    fn: Callable[[], object], read: Callable[[], object], reps: int, device: torch.device
) -> tuple[float, float]:
    """The median over rounds of fn's time / read's (alternating), and read's median in ms."""

    def timed(call: Callable[[], object]) -> float:
        devices.synchronize(device)
        started = time.perf_counter()
        for _ in range(reps):
            call()
        devices.synchronize(device)
        return (time.perf_counter() - started) / reps

    timed(fn), timed(read)  # warm-up: caches, allocations, lazy initialisation
    pairs = [(timed(fn), timed(read)) for _ in range(5)]
    return statistics.median(a / b for a, b in pairs), statistics.median(b for _, b in pairs) * 1e3


def _row(section: str, workload: str, item: str, value: float, unit: str, note: str = "") -> dict:
    return {"section": section, "workload": workload, "item": item,
            "value": round(float(value), 4), "unit": unit, "note": note}  # fmt: skip


def write(out: Path, rows: list[dict], header: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "gpu_check.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: the code paths only")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not devices.gpu_count():
        parser.error("--device cuda: this machine has no GPU (try --device cpu --quick)")
    plan = QUICK if args.quick else FULL
    started = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, workload in plan.workloads.items():
            run = configure(plan, args.device, workload)
            world = World(run.topology, Path(tmp) / name, Path(tmp) / f"{name}-store")
            try:
                rows += step_rows(name, run, world) + read_rows(name, run, world)
            finally:
                world.close()
    device = devices.rank_device(args.device, 0, devices.gpu_count())
    if device.type == "cpu":
        torch.set_num_threads(1)  # as a rank runs (topology.threads_per_rank=1)
    rows += kernel_rows(plan, device)
    topo = run.topology
    header = (
        f"# gpu_check: {topo.world_size} ranks over {topo.backend} on {args.device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
        f"torch {torch.__version__}, {time.perf_counter() - started:.0f} s"
        f"{', --quick (code paths only, no meaningful numbers)' if args.quick else ''}"
    )
    write(args.out, rows, header)
    print((args.out / "gpu_check.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
