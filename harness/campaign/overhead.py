"""overhead.csv: what each configured detector adds to a training step of the campaign's own
workload and world, measured after its trials (`campaign.overhead`, docs/design.md, sections 4-6).

overhead = step time with the detector alone / step time without detectors - 1, in percent,
against two references: the harness's comm hook without checks (`overhead_pct`: what the check
itself costs) and plain DDP without the harness's hook (`overhead_vs_ddp_pct`: what a job
pays). The `hook` row is the hook's own cost against plain DDP (its fixed layout, its rider
slot and the copy of each chunk into what it sends; harness/runtime/comm.py).
A step's time is its slowest rank's (the ranks wait for each other in the allreduce). A check
that runs every k steps makes the series periodic, and a plain median over steps would return
the steps it skips: the median is taken at each position of the cycle (step mod k) and the
positions are averaged, so the cost is amortized over the interval (k = 1: the plain median).

The load of a shared machine drifts over seconds, so each detector's run sits between two runs
without detectors and is compared with their mean (a sandwich); with several rounds, the order
alternates and the median ratio over rounds is kept, with the lowest and the highest round's
(`overhead_low_pct`, `overhead_high_pct`; the `hook` row's against plain DDP): the spread
sdc-regress tells noise from growth by.

floor = the least a check could cost. For replay, one forward and backward of the audited
rank's micro-batches per interval: measured in the same world, as the extra step time of a run
with FLOOR_SETS more sets of micro-batches per step (each extra set is exactly that work), per
set, divided by the interval. Other checks have no floor defined here: the column is blank.

Timed runs are clean, start at step 0 and write no checkpoint (consensus also runs before every
checkpoint, and writing one is rank 0's I/O, not a check's cost): each check runs at its own
interval only.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

import detectors
from harness.config.schema import FaultConfig, RunConfig, TrialSpec
from harness.core.checks import CheckConfig
from harness.results.schema import HOOK, OVERHEAD_COLUMNS, OVERHEAD_FILE, TrialResult

WARMUP_STEPS = 2  # the first steps allocate, and DDP rebuilds its buckets after step 0
REFERENCE = "none"
FLOOR = "floor"  # more micro-batches per step, no detectors: replay's floor
PLAIN = "plain_ddp"  # DDP's own allreduce, no harness hook
# A difference of two step times carries the noise of both: on a loaded machine one extra
# forward and backward of a small model can drown in it, four of them stand well clear.
FLOOR_SETS = 4

Execute = Callable[[RunConfig, TrialSpec], TrialResult]


class OverheadError(RuntimeError):
    """A timed run crashed: no overhead.csv is written (the campaign's trials are intact)."""


def timed_checks(run: RunConfig) -> dict[tuple[str, int | None], CheckConfig]:
    """Every (check, interval) that the campaign's trials run, with its settings (a scenario
    may set them: audit_frequency times each interval)."""
    found: dict[tuple[str, int | None], CheckConfig] = {}
    for checks in [run.checks(t) for t in run.trials] or [run.detectors]:
        for name, config in checks.items():
            found.setdefault((name, config.every), config)
    return dict(sorted(found.items(), key=lambda item: (item[0][0], item[0][1] or 0)))


def timed_runs(run: RunConfig) -> dict[Any, tuple[RunConfig, int]]:
    """Every timed configuration by key ((check, interval), REFERENCE or FLOOR), with the cycle
    its steps are amortized over."""
    checks = timed_checks(run)
    cycles = {key: key[1] or 1 for key in checks}
    steps = WARMUP_STEPS + max(run.overhead.steps, *cycles.values(), 1)
    base = replace(
        run,
        detectors={},
        workload=replace(run.workload, steps=steps),
        checkpoint=replace(run.checkpoint, interval=steps + 1),
        scenarios=(),
        trials=(),
    )
    runs: dict[Any, tuple[RunConfig, int]] = {REFERENCE: (base, 1), PLAIN: (base, 1)}
    if any(detectors.detector_class(name).recomputes_batches and k for name, k in checks):
        more = replace(base.workload, micro_batches=(1 + FLOOR_SETS) * base.workload.micro_batches)
        runs[FLOOR] = (replace(base, workload=more), 1)
    for (name, k), config in checks.items():
        runs[(name, k)] = (replace(base, detectors={name: config}), cycles[(name, k)])
    return runs


def step_series(outcome: TrialResult, trial_id: str) -> list[float]:
    """Seconds per step of the slowest rank."""
    if outcome.parts is None:
        raise OverheadError(f"timed run {trial_id} crashed: {outcome.crash}")
    per_rank = [part.step_times for part in outcome.parts]
    return [max(times) for times in zip(*per_rank, strict=True)]


def amortized_step(series: list[list[float]], cycle: int) -> float:
    """Seconds per step of one or more runs' step series: the median at each position of the
    cycle, averaged over positions; NaN when too few steps to see every position."""
    at: dict[int, list[float]] = defaultdict(list)
    for times in series:
        for step, seconds in enumerate(times):
            if step >= WARMUP_STEPS:
                at[step % cycle].append(seconds)
    if len(at) < cycle:
        return math.nan
    return statistics.fmean(statistics.median(v) for v in at.values())


def ratios(run: RunConfig, execute: Execute) -> dict[Any, list[float]]:
    """Each configuration's step time over that of the reference runs on either side of it, one
    per round."""
    runs = timed_runs(run)
    reference = runs.pop(REFERENCE)[0]
    rounds = run.overhead.rounds
    found: dict[Any, list[float]] = {key: [] for key in runs}
    bar = tqdm(total=rounds * (2 * len(runs) + 1), desc="overhead", unit="run", mininterval=1.0)

    def timed(key: Any, config: RunConfig, r: int) -> list[float]:
        label = key if isinstance(key, str) else "-".join(str(part) for part in key)
        trial_id = f"overhead-{label}-r{r}-{bar.n}"
        spec = TrialSpec(trial_id, run.workload.seed, FaultConfig(), hook=key != PLAIN)
        outcome = execute(config, spec)
        bar.update()
        return step_series(outcome, trial_id)

    try:
        for r in range(rounds):
            before = timed(REFERENCE, reference, r)
            for key in list(runs) if r % 2 == 0 else reversed(list(runs)):
                config, cycle = runs[key]
                mine, after = timed(key, config, r), timed(REFERENCE, reference, r)
                bare = (amortized_step([before], cycle) + amortized_step([after], cycle)) / 2
                found[key].append(amortized_step([mine], cycle) / bare)
                before = after
    finally:
        bar.close()
    return found


def _pct(ratio: float) -> float:
    return round(100 * (ratio - 1), 3)


def rows(run: RunConfig, rounds: dict[Any, list[float]]) -> list[dict[str, object]]:
    """overhead.csv's rows: the hook's own, then one per (check, interval) the trials ran, from
    `ratios` (each against the hook reference; plain DDP's ratio converts them)."""
    ratio = {key: statistics.median(values) for key, values in rounds.items()}
    hook = 1 / ratio[PLAIN]
    # The hook's own rounds are against plain DDP, as its cost is.
    out: list[dict[str, object]] = [
        {"detector": HOOK, "interval": "", "overhead_pct": "", "floor_pct": "",
         "overhead_vs_ddp_pct": _pct(hook), "overhead_low_pct": _pct(1 / max(rounds[PLAIN])),
         "overhead_high_pct": _pct(1 / min(rounds[PLAIN]))}
    ]  # fmt: skip
    for name, k in timed_checks(run):
        floor: float | str = ""
        if detectors.detector_class(name).recomputes_batches and k is not None:
            floor = round(100 * (ratio[FLOOR] - 1) / FLOOR_SETS / k, 4)
        out.append(
            {
                "detector": name,
                "interval": "" if k is None else k,
                "overhead_pct": _pct(ratio[(name, k)]),
                "floor_pct": floor,
                "overhead_vs_ddp_pct": _pct(ratio[(name, k)] * hook),
                "overhead_low_pct": _pct(min(rounds[(name, k)])),
                "overhead_high_pct": _pct(max(rounds[(name, k)])),
            }
        )
    return out


def write(path: Path, table: list[dict[str, object]]) -> Path:
    """Whole or not at all: a reader never sees half a table."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=OVERHEAD_COLUMNS)
        writer.writeheader()
        writer.writerows(table)
    tmp.replace(path)
    return path


def wanted(run: RunConfig, out: Path) -> bool:
    """Whether `measure` has a table to write: the campaign asks for one (`campaign.overhead`)
    with detectors to time, and a resumed campaign has not written it yet."""
    return run.overhead is not None and bool(run.detectors) and not (out / OVERHEAD_FILE).exists()


def measure(run: RunConfig, out: Path, execute: Execute) -> Path | None:
    """Time the campaign's detectors in the world `execute` runs trials in, and write
    out/overhead.csv (`wanted`); the table a resumed campaign already wrote, or None."""
    path = out / OVERHEAD_FILE
    if not wanted(run, out):
        return path if path.exists() else None
    return write(path, rows(run, ratios(run, execute)))
