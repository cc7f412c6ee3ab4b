"""Benchmark 6: how detector cost grows with model size (1x, 4x, 16x) and with ranks (3, 4, 8).

Size: each detector's arithmetic per step on one rank (one thread, data read from memory) on
the `gpt` workload at widths 128, 256 and 512 (about 1x, 4x and 15x its parameters): nan_inf
(two passes: before and after the allreduce), allreduce_sketch (rider and check), the
consensus fingerprints (every 10 steps) and replay's recomputation (every 5 steps), next to
replay's floor, one plain forward and backward, and one read pass (`torch.sum`). The growth
exponent log(cost ratio) / log(parameter ratio) is 1 for linear growth; for the memory-bound
checks it is taken on their cost in read passes (see size_figures).

Ranks: a detector's arithmetic does not depend on the world's size (each rank checks what it
holds); its collectives do. So the collectives are timed in worlds of 3, 4 and 8 ranks
(collectives.py), and, for information, the whole-step overhead of benchmark 4 too: that is a
difference of step times, noisy on a shared machine, and on this 2-core machine the ranks share
the cores, so every step, with or without detectors, slows down with more ranks.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import collectives
from benchmarks.common import Rotation, bucket, detector, gpt, gpt_config, params_of
from benchmarks.kernels import STEP, fingerprint_table, sketch_work
from benchmarks.timing import Figure, interleaved, median, paired_ratio
from benchmarks.worlds import Worlds, base_run, steps_for, time_configs, with_detectors
from harness.runtime.workloads import Workload

CHECKS = ("nan_inf", "weight_consensus", "allreduce_sketch")
PER_STEP = {"read": 1, "nan_inf": 1, "allreduce_sketch": 1, "weight_consensus": 10, "replay": 5,
            "forward_backward": 5}  # every how many steps each cost is paid  # fmt: skip


@dataclass(frozen=True)
class Plan:
    widths: tuple[int, ...] = (128, 256, 512)
    ranks: tuple[int, ...] = (3, 4, 8)
    rounds: int = 9  # kernel samples
    world_rounds: int = 2
    collective_ranks: tuple[int, ...] = (3, 4, 8)
    collective_reps: int = 200
    cycle: int = 10  # consensus every 10, replay every 5
    workload: tuple[str, ...] = ()

    @classmethod
    def quick(cls) -> Plan:
        small = ("workload.micro_batch_size=2", "workload.context=16")
        return cls((32, 64), (3,), rounds=1, world_rounds=1, collective_ranks=(2,),
                   collective_reps=3, workload=small)  # fmt: skip


def size_costs(width: int, rounds: int, changes: dict) -> dict[str, tuple[float, float]]:
    """Per detector at one width: seconds per call, and that over one read pass of the
    parameters' bytes (paired, as in benchmarks 1-3)."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(gpt_config(), d_model=width, heads=max(1, width // 32), **changes)
    workload = Workload(cfg)
    model = workload.build_model()
    replay = detector("replay", model=model, workload=workload, world=4)
    n = params_of(model)
    buckets = Rotation(lambda: bucket(n, torch.float32), 4 * n)
    params = [p.detach() for p in model.parameters()]
    weights = Rotation(lambda: [p.clone() for p in params], 4 * n)
    nan_inf, sketch = detector("nan_inf"), detector("allreduce_sketch")

    def forward_backward() -> None:
        loss = workload.loss(model, workload.batch(0, 1, 0))
        torch.autograd.grad(loss, list(model.parameters()))

    fns = {
        "read": lambda: buckets.next().buffer.sum(),
        "nan_inf": lambda: [nan_inf.on_local_grad(STEP, buckets.next()) for _ in range(2)],
        "allreduce_sketch": lambda: sketch_work(sketch, buckets.next()),
        "weight_consensus": lambda: fingerprint_table(weights.next()),
        "replay": lambda: replay._recompute(model, 0, 1),
        "forward_backward": forward_backward,
    }
    times = interleaved(fns, rounds)
    return {name: (median(t), paired_ratio(times, name, "read")) for name, t in times.items()}


def size_table(plan: Plan) -> list[dict]:
    changes = _workload_changes(plan)
    rows = []
    for width in plan.widths:
        n = params_of(gpt(width, **changes))
        for name, (seconds, reads) in size_costs(width, plan.rounds, changes).items():
            every = PER_STEP[name]
            rows.append({"width": width, "params": n, "detector": name, "every": every,
                         "ms_per_call": round(1e3 * seconds, 4),
                         "ms_per_step": round(1e3 * seconds / every, 4),
                         "ns_per_param_per_call": round(1e9 * seconds / n, 3),
                         "read_passes_per_call": round(reads, 3)})  # fmt: skip
    return rows


def _workload_changes(plan: Plan) -> dict:
    pairs = (o.removeprefix("workload.").split("=") for o in plan.workload)
    return {k: int(v) for k, v in pairs}


def exponent(rows: list[dict], name: str, x: str, y: str) -> float:
    """log(y ratio) / log(x ratio) between the smallest and the largest x."""
    mine = sorted((r[x], r[y]) for r in rows if r["detector"] == name)
    (x0, y0), (x1, y1) = mine[0], mine[-1]
    if y0 <= 0 or y1 <= 0 or x0 == x1:
        return math.nan
    return math.log(y1 / y0) / math.log(x1 / x0)


def size_figures(sizes: list[dict], plan: Plan) -> list[Figure]:
    """Memory-bound checks: growth relative to a read pass (the cache hierarchy makes a read
    pass itself grow faster than linearly once the data leaves the cache; a check that does a
    fixed number of passes is linear in parameters and keeps its ratio to the read pass).
    Replay: its own growth (compute, not memory)."""
    span = f"widths {plan.widths[0]}..{plan.widths[-1]}"
    read = exponent(sizes, "read", "params", "ms_per_call")
    figures = [Figure("growth_params_read", f"one read pass: time growth in parameters ({span})",
                      read, "")]  # fmt: skip
    for name in ("nan_inf", "allreduce_sketch", "weight_consensus"):
        value = 1 + exponent(sizes, name, "params", "read_passes_per_call")
        label = f"{name}: cost growth in parameters, relative to a read pass ({span}; 1 = linear)"
        figures.append(Figure(f"growth_params_{name}", label, value, "", target=1.1))
    for name, target in (("replay", 1.1), ("forward_backward", None)):
        value = exponent(sizes, name, "params", "ms_per_call")
        label = f"{name}: cost growth in parameters ({span}; 1 = linear)"
        figures.append(Figure(f"growth_params_{name}", label, value, "", target=target))
    return figures


def ranks_table(worlds: Worlds, plan: Plan) -> list[dict]:
    """Overhead of the three cheap checks together, and of replay every 5 steps, per world
    size, as in benchmark 4 (wall time and CPU time)."""
    rows = []
    for nodes in plan.ranks:
        base = base_run(steps_for(plan.cycle, 2), nodes, *plan.workload)
        runs = {
            "checks": with_detectors(base, {c: {} for c in CHECKS}),
            "replay": with_detectors(base, {"replay": {"interval": 5}}),
        }
        timings = time_configs(worlds, base, runs, plan.world_rounds, plan.cycle)
        step_s, cpu_step_s = timings.seconds("none", plan.cycle), timings.cpu_step(base)
        for name in runs:
            wall, cpu = timings.ratio(name) - 1, timings.cpu_ratio(name) - 1
            rows.append({"ranks": nodes, "detector": name, "step_ms": round(1e3 * step_s, 3),
                         "overhead_ms": round(1e3 * wall * step_s, 3),
                         "overhead_pct": round(100 * wall, 3),
                         "cpu_step_ms": round(1e3 * cpu_step_s, 3),
                         "cpu_overhead_ms": round(1e3 * cpu * cpu_step_s, 3),
                         "cpu_overhead_pct": round(100 * cpu, 3)})  # fmt: skip
    return rows


def write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def run(worlds: Worlds, out: Path, plan: Plan) -> list[Figure]:
    """Figure 6; writes growth_size.csv, growth_ranks.csv and growth_collectives.csv."""
    sizes = size_table(plan)
    write(out / "growth_size.csv", sizes)
    ranks = ranks_table(worlds, plan)
    write(out / "growth_ranks.csv", ranks)
    links = collectives_table(plan)
    write(out / "growth_collectives.csv", links)
    figures = size_figures(sizes, plan)
    several = len(plan.collective_ranks) > 1
    for name in ("consensus all_gather", "replay all_gather", "gradient all_reduce"):
        value = exponent(links, name, "ranks", "ms") if several else math.nan
        label = f"{name}: time growth in ranks {plan.collective_ranks} (1 = linear)"
        target = None if name.startswith("gradient") else 1.1  # the step's own, for reference
        figures.append(Figure(f"growth_ranks_{name.split()[0]}", label, value, "", target=target))
    # In whole steps: noisy on a shared machine (differences of step times), for information.
    for name, (column, by) in itertools.product(
        ("checks", "replay"), (("overhead_ms", ""), ("cpu_overhead_ms", ", CPU time"))
    ):
        value = exponent(ranks, name, "ranks", column) if len(plan.ranks) > 1 else math.nan
        label = f"{name}: step overhead (ms{by}) growth in ranks {plan.ranks} (1 = linear)"
        figures.append(Figure(f"growth_ranks_{name}_step{'_cpu' if by else ''}", label, value, ""))
    return figures


def collectives_table(plan: Plan) -> list[dict]:
    """The detectors' collectives (and the gradient allreduce) per world size."""
    model = gpt(**_workload_changes(plan))
    tensors, params = len(list(model.parameters())), params_of(model)
    rows = []
    for world in plan.collective_ranks:
        medians = collectives.time_world(world, collectives.cases(world, tensors, params),
                                         plan.collective_reps)  # fmt: skip
        rows += [{"ranks": world, "detector": name, "ms": round(1e3 * seconds, 4)}
                 for name, seconds in medians.items()]  # fmt: skip
    return rows
