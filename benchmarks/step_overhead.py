"""Benchmark 4: what each detector adds to a training step of the reference workload (`gpt`,
1024 tokens per rank per step) in a 4-rank gloo world; writes overhead.csv (docs/design.md,
section 4).

overhead = amortized step time with the detector / without - 1 (see worlds.py for the
amortization over the detector's interval): overhead.csv. The same by the ranks' CPU time, which
a loaded machine moves much less but which misses the latency of collectives: overhead_cpu.csv.
The floors:

- replay: one micro-batch forward and backward per interval. Measured in the same world under
  the same load, as the extra step time of a trial with two micro-batches per step instead of
  one (the extra micro-batch is exactly one more forward and backward), divided by the interval.
- nan_inf, allreduce_sketch, weight_consensus: the read passes over their data that they cannot
  avoid (two over the gradient for nan_inf and for the sketch, one over the weights per
  consensus), timed in this process on one thread as `torch.sum`, relative to the same step.
- matmul_checksum: one read pass over every product's operands and output, forward and
  backward (a checksum reads each once at least).

The budgeted checks' twin (`twin_run`, with the overhead): nan_inf, consensus and the sketch
again on `llama` with the LLM recipe (where transformers is installed), against the same hooked
step, so the 3% budget is read on a real architecture as well as on the reference.

The hook's own cost (`hook_run`, its own part of `python -m benchmarks`: `--only hook`): the
harness's comm hook without checks (the fixed reduction layout, its rider slot and copies)
against plain DDP's own allreduce, on `gpt` (the reference, whose target is 3% of a step), the
nightly's `mlp` and `llama` (where transformers is installed), each workload's hook trials
sandwiched between plain-DDP trials in the same world.
"""

from __future__ import annotations

import csv
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import Rotation, params_of
from benchmarks.timing import Figure, interleaved, median
from benchmarks.worlds import Timings, Worlds, base_run, steps_for, time_configs, with_detectors
from detectors.product_bounds import product_of
from harness.config.schema import RunConfig
from harness.core.matmuls import MatmulCall, Watch, watching
from harness.runtime.workloads import Workload

CHECKS = ("nan_inf", "weight_consensus", "allreduce_sketch", "matmul_checksum")
# The every-step checks whose sum the published budget (3% of a step) is set for.
BUDGETED = ("nan_inf", "weight_consensus", "allreduce_sketch")
OVERHEAD_COLUMNS = ["detector", "interval", "overhead_pct", "floor_pct"]


@dataclass(frozen=True)
class Plan:
    """Cadences and sizes; `quick` shrinks them to exercise the code in seconds."""

    replay_intervals: tuple[int, ...] = (1, 5, 20)
    consensus_interval: int = 10
    cycle: int = 20  # a multiple of every interval above
    cycles: int = 2  # per trial (see worlds.steps_for)
    rounds: int = 5
    workload: tuple[str, ...] = ()  # extra overrides, e.g. a smaller batch for quick runs
    nodes: int = 4
    hook_workloads: tuple[str, ...] = ("gpt", "mlp", "llama")
    # Where the budgeted checks are timed again: the LLM recipe's llama, the reference's twin.
    twin_workloads: tuple[str, ...] = ("llama",)

    @classmethod
    def quick(cls) -> Plan:
        """The smallest world replay and consensus accept (3 nodes), a tiny batch."""
        small = ("workload.micro_batch_size=2", "workload.context=16")
        return cls((1, 2), 2, cycle=2, cycles=2, rounds=1, workload=small, nodes=3,
                   hook_workloads=("gpt", "mlp"), twin_workloads=("mlp",))  # fmt: skip


def budgeted(plan: Plan) -> dict[str, dict]:
    """The checks of the published budget, consensus at the plan's interval."""
    return {"nan_inf": {}, "weight_consensus": {"interval": plan.consensus_interval},
            "allreduce_sketch": {}}  # fmt: skip


def configs(plan: Plan) -> dict[str, RunConfig]:
    """Every configuration timed, by name: none, the floor, each check, replay per interval."""
    base = base_run(steps_for(plan.cycle, plan.cycles), plan.nodes, *plan.workload)
    consensus = {"weight_consensus": budgeted(plan)["weight_consensus"]}
    runs = {
        "none": base,
        "floor": with_detectors(base, {}, micro_batches=2 * base.workload.micro_batches),
        "nan_inf": with_detectors(base, {"nan_inf": {}}),
        "weight_consensus": with_detectors(base, consensus),
        "allreduce_sketch": with_detectors(base, {"allreduce_sketch": {}}),
        "matmul_checksum": with_detectors(base, {"matmul_checksum": {}}),
        "checks": with_detectors(base, budgeted(plan)),
    }
    for k in plan.replay_intervals:
        runs[f"replay@{k}"] = with_detectors(base, {"replay": {"interval": k}})
    return runs


def read_pass_s(numel: int) -> float:
    """One thread's `torch.sum` over `numel` float32 values read from memory, in seconds."""
    torch.set_num_threads(1)
    data = Rotation(lambda: torch.randn(numel), numel * 4)
    return median(interleaved({"read": lambda: data.next().sum()}, 15)["read"])


@dataclass
class Overheads:
    """overhead.csv rows by wall time (docs/design.md's definition) and by CPU time, and the
    trials."""

    wall: list[dict]
    cpu: list[dict]
    timings: Timings
    step_s: float  # wall time of a step without detectors
    cpu_step_s: float  # CPU time of one rank's step without detectors


def measure(worlds: Worlds, plan: Plan) -> Overheads:
    """Time every configuration in `worlds`; the overhead rows by both measures."""
    runs = configs(plan)
    base = runs.pop("none")
    timings = time_configs(worlds, base, runs, plan.rounds, plan.cycle)
    step_s = timings.seconds("none", plan.cycle)
    cpu_step_s = timings.cpu_step(base)
    params = params_of(Workload(base.workload).build_model())
    read_s = read_pass_s(params)
    products = 2 * product_elements(base) / params  # forward and backward, in weights' reads
    wall = _rows(timings.ratio, plan, 100 * read_s / step_s, products)
    cpu = _rows(timings.cpu_ratio, plan, 100 * read_s / cpu_step_s, products)
    return Overheads(wall, cpu, timings, step_s, cpu_step_s)


def product_elements(run: RunConfig) -> int:
    """The elements of every matrix product's operands and output in one rank's forward."""
    workload = Workload(run.workload)
    model = workload.build_model()
    total = 0

    def count(call: MatmulCall) -> torch.Tensor:
        nonlocal total
        output = call.func(*call.args, **call.kwargs)
        product = product_of(call)
        if product is not None:
            total += product.left.numel() + product.right.numel() + output.numel()
        return output

    with watching(model, Watch(count)), torch.no_grad():
        workload.loss(model, workload.batch(0, 0, 0))
    return total * run.workload.micro_batches


def _rows(ratio, plan: Plan, read_pct: float, products: float) -> list[dict]:
    """overhead.csv rows from `ratio(config)` (a step cost over that of the bare step);
    `products`: matmul_checksum's floor in reads of the weights."""

    def overhead(name: str) -> float:
        return 100.0 * (ratio(name) - 1)

    intervals = {"nan_inf": 1, "weight_consensus": plan.consensus_interval, "allreduce_sketch": 1,
                 "matmul_checksum": 1}  # fmt: skip
    # The read passes a check cannot avoid: the gradient before and after the allreduce; the
    # weights once per consensus; every product's operands and output.
    passes = {"nan_inf": 2.0, "weight_consensus": 1.0 / plan.consensus_interval,
              "allreduce_sketch": 2.0, "matmul_checksum": products}  # fmt: skip
    rows = [_row(n, intervals[n], overhead(n), passes[n] * read_pct) for n in CHECKS]
    budget = sum(passes[n] for n in BUDGETED) * read_pct
    rows.append(_row("+".join(BUDGETED), "", overhead("checks"), budget))
    for k in plan.replay_intervals:
        rows.append(_row("replay", k, overhead(f"replay@{k}"), overhead("floor") / k))
    return rows


def _row(detector: str, interval: int | str, overhead: float, floor: float) -> dict:
    return {"detector": detector, "interval": interval,
            "overhead_pct": round(overhead, 3), "floor_pct": round(floor, 4)}  # fmt: skip


def write(out: Path, result: Overheads) -> None:
    for name, rows in (("overhead.csv", result.wall), ("overhead_cpu.csv", result.cpu)):
        with open(out / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=OVERHEAD_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    with open(out / "step_times.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["config", "round", "trial", "trial_cpu_s", "step", "seconds"])
        for i, t in enumerate(result.timings.trials):
            writer.writerows(
                [t.name, t.round, i, f"{t.cpu_s:.2f}", s, f"{x:.6f}"]
                for s, x in enumerate(t.series)
            )


def _spread(values: list[float]) -> str:
    """The range of the per-round overheads: how far to trust the median on this machine."""
    pcts = [100.0 * (x - 1) for x in values]
    return f"rounds {min(pcts):.3g}..{max(pcts):.3g}%"


def figures(result: Overheads, plan: Plan) -> list[Figure]:
    label = f"gpt step without detectors ({plan.nodes} ranks, gloo)"
    out = [Figure("step_ms", label, 1e3 * result.step_s, "ms",
                  note=f"CPU {1e3 * result.cpu_step_s:.3g} ms per rank")]  # fmt: skip
    timings = result.timings
    for measure, rows, ratios in (("", result.wall, timings.wall),
                                  ("_cpu", result.cpu, timings.cpu)):  # fmt: skip
        by = " (CPU time)" if measure else ""
        for row in rows:
            out.append(_figure(row, measure, by, ratios, plan))
    return out


def _figure(row: dict, measure: str, by: str, ratios: dict, plan: Plan) -> Figure:
    name, k, pct = row["detector"], row["interval"], row["overhead_pct"]
    # Targets belong to the wall-time figures (docs/design.md's definition); CPU time is the
    # cross-check.
    wall = not measure
    if name == "replay":
        floor = row["floor_pct"]
        ratio = pct / floor if floor > 0 else float("nan")
        note = f"{pct:.3g}% vs floor {floor:.3g}%; {_spread(ratios[f'replay@{k}'])}"
        label = f"replay every {k} steps / its floor{by}"
        return Figure(f"replay{k}_vs_floor{measure}", label, ratio,
                      target=1.2 if wall else None, note=note)  # fmt: skip
    if "+" in name:
        label = (
            f"nan_inf + weight_consensus (every {plan.consensus_interval}) + "
            f"allreduce_sketch, step overhead{by}"
        )
        return Figure(f"checks_overhead_pct{measure}", label, pct, "%",
                      target=3.0 if wall else None, note=_spread(ratios["checks"]))  # fmt: skip
    label = f"{name} (every {k}), step overhead{by}"
    # The checksum's target: every product of the step checked, forward and backward.
    target = 10.0 if wall and name == "matmul_checksum" else None
    note = f"floor {row['floor_pct']:.3g}%; {_spread(ratios[name])}"
    return Figure(f"{name}_overhead_pct{measure}", label, pct, "%", target=target, note=note)


def run(worlds: Worlds, out: Path, plan: Plan) -> list[Figure]:
    """Figure 4 and its twins; writes overhead.csv, overhead_cpu.csv and step_times.csv into
    `out`."""
    result = measure(worlds, plan)
    write(out, result)
    return figures(result, plan) + twin_run(worlds, plan)


def twin_run(worlds: Worlds, plan: Plan) -> list[Figure]:
    """`checks_overhead_pct`'s twins: the budgeted checks against the same hooked step on each
    of `plan.twin_workloads` as the workload is configured (llama: the LLM recipe), the median
    of `plan.rounds` interleaved rounds."""
    figures = []
    steps = steps_for(plan.cycle, plan.cycles)
    for name in available(plan.twin_workloads):
        base = base_run(steps, plan.nodes, workload=name)
        runs = {"checks": with_detectors(base, budgeted(plan))}
        timings = time_configs(worlds, base, runs, plan.rounds, plan.cycle)
        pct = 100.0 * (timings.ratio("checks") - 1)
        label = (
            f"nan_inf + weight_consensus (every {plan.consensus_interval}) + allreduce_sketch, "
            f"{name} step overhead ({plan.nodes} ranks, gloo)"
        )
        step_ms = 1e3 * timings.seconds("none", plan.cycle)
        note = f"step {step_ms:.3g} ms; {_spread(timings.wall['checks'])}"
        target = 3.0 if name == "llama" else None
        figures.append(Figure(f"checks_overhead_pct_{name}", label, pct, "%", target, note=note))
    return figures


def available(workloads: tuple[str, ...]) -> list[str]:
    """The workloads that can run here: `llama` only where transformers is installed."""
    return [
        name
        for name in workloads
        if name != "llama" or importlib.util.find_spec("transformers") is not None
    ]


def hook_run(worlds: Worlds, plan: Plan) -> list[Figure]:
    """The harness's comm hook against plain DDP, per workload: a step's extra wall time, in
    percent (CPU time in the note)."""
    figures = []
    steps = steps_for(plan.cycle, plan.cycles)
    for name in available(plan.hook_workloads):
        # `plan.workload` sizes the reference workload; the others run as configured.
        overrides = plan.workload if name == "gpt" else ()
        base = base_run(steps, plan.nodes, *overrides, workload=name)
        timings = time_configs(worlds, base, {"hook": base}, plan.rounds, plan.cycle, True)
        pct = 100.0 * (timings.ratio("hook") - 1)
        cpu = 100.0 * (timings.cpu_ratio("hook") - 1)
        step_ms = 1e3 * timings.seconds("none", plan.cycle)
        label = f"harness comm hook vs plain DDP, {name} step ({plan.nodes} ranks, gloo)"
        note = f"CPU time {cpu:.3g}%; plain step {step_ms:.3g} ms; {_spread(timings.wall['hook'])}"
        target = 3.0 if name == "gpt" else None
        figures.append(Figure(f"hook_overhead_pct_{name}", label, pct, "%", target, note=note))
    return figures
