"""Benchmark 6, continued: what one `replay` audit costs its rank beyond its floor, in one
process, away from the world's noise.

replay's floor is one forward and backward of the audited rank's micro-batches per audit
(harness/campaign/overhead.py). Here one rank, in a world of one (gloo over a file store), times
the audit's own work (its gradient's projections as the comm hook hands them, the
recomputation, its projections, the gather and the read) against one more forward and backward
of the same micro-batches accumulated into the gradients. Each audit follows `cadence - 1`
steps without one: a cost per audit beyond the floor shows at cadence 1, and one that grows
with the interval (cold caches, memory returned and faulted in again) at 20. The world's
figures (replay*_vs_floor, step_overhead.py) add the gather's wait for the slowest rank.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import compose_run, detector
from benchmarks.timing import Figure
from harness.core.plugins import Bucket
from harness.runtime import numerics
from harness.runtime.workloads import Workload

CADENCES = (1, 20)


def run(rounds: int = 15, quick: bool = False) -> list[Figure]:
    torch.set_num_threads(1)
    overrides = ("workload=gpt", *(("workload.micro_batch_size=2",) if quick else ()))
    cadences = (1, 2) if quick else CADENCES
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            ratios = _ratios(compose_run(*overrides), cadences, rounds)
        finally:
            dist.destroy_process_group()
    return [
        Figure(f"replay_audit_vs_floor_{k}",
               f"replay: one audit's work / one forward and backward, every {k} steps "
               "(one rank, one thread, no world)", statistics.median(ratios[k]),
               note=f"rounds {min(ratios[k]):.2f}..{max(ratios[k]):.2f}")
        for k in cadences
    ]  # fmt: skip


def _ratios(run_cfg, cadences: tuple[int, ...], rounds: int) -> dict[int, list[float]]:
    workload = Workload(run_cfg.workload)
    model = workload.build_model()
    optimizer = workload.build_optimizer(model)
    replay = detector("replay", model=model, workload=workload, interval=1)

    def forward_backward(step: int) -> torch.Tensor:
        with numerics.installed(run_cfg.topology.cpu_numerics, "cpu"):
            with workload.forward_rng(step, 0, 0):
                loss = workload.loss(model, workload.batch(step, 0, 0))
            loss.backward()
        return loss

    def step(number: int, audited: bool) -> float:
        """One training step; the seconds of its audit's work, or of the floor's."""
        optimizer.zero_grad(set_to_none=False)
        loss = forward_backward(number)
        started = time.perf_counter()
        if audited:
            replay.on_loss(number, loss)
            grads = [(name, p.grad) for name, p in model.named_parameters()]
            replay.on_local_grad(number, Bucket(0, torch.empty(0), grads, True))
            replay.on_audit(number)
            replay._log.verdicts.pending.clear()
        else:
            forward_backward(number)
        spent = time.perf_counter() - started
        optimizer.step()
        return spent

    for _ in range(2):  # warm-up: allocations, the signs' cache
        step(0, True), step(0, False)
    ratios: dict[int, list[float]] = {k: [] for k in cadences}
    for _ in range(rounds):
        for k in cadences:
            timed = {}
            for audited in (True, False):
                for _ in range(k - 1):
                    step(0, False)
                timed[audited] = step(1, audited)
            ratios[k].append(timed[True] / timed[False])
    return ratios
