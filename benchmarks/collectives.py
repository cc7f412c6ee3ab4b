"""The part of a detector's cost that depends on the number of ranks: its collectives.

Each rank checks what it holds, so a detector's arithmetic is the same at any world size; what
grows with ranks is what the detectors exchange. Timed here in bare gloo worlds on loopback
(processes forked from the rank server a simulated world's ranks come from, torch already
imported, so they start quickly), many repetitions, the median:

- consensus: weight_consensus's all_gather of two int64 words per tensor (the `gpt` model's);
- replay: replay's all_gather of its six-number row (float64) per audit;
- gradient allreduce: the step's own all_reduce of the model's gradient plus the rider slots
  (the reference: riders add no collective, so the sketch's cost in ranks is this one's).
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import compose_run
from harness.launch import rank_server
from harness.runtime.comm import rider_slots

TIMEOUT_S = 120


def _loopback() -> str:
    """harness.launch.world.loopback_interface, without importing the trainer into every process."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), names[0])


def _collective(name: str, world: int, numel: int, dtype: torch.dtype):
    """A callable that runs one collective of `name`."""
    if name == "all_reduce":
        data = torch.zeros(numel, dtype=dtype)
        return lambda: dist.all_reduce(data)
    data = torch.zeros(numel, dtype=dtype)
    table = [torch.empty_like(data) for _ in range(world)]
    return lambda: dist.all_gather(table, data)


def _rank(rank: int, world: int, init: str, cases: dict, reps: int, results) -> None:
    """One rank: every case `reps` times after a warm-up; rank 0 reports the medians."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))  # fmt: skip
    medians = {}
    for name, (kind, numel, dtype) in cases.items():
        run = _collective(kind, world, numel, dtype)
        run()
        times = []
        for _ in range(reps):
            dist.barrier()  # every rank starts together: time the collective, not the stragglers
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        medians[name] = statistics.median(times)
    if rank == 0:
        results.put(medians)
    dist.barrier()
    dist.destroy_process_group()


def cases(world: int, tensors: int, params: int) -> dict[str, tuple[str, int, torch.dtype]]:
    """The collectives of a step of a model of `tensors` tensors and `params` parameters."""
    return {
        "consensus all_gather": ("all_gather", 2 * tensors, torch.int64),
        "replay all_gather": ("all_gather", 6, torch.float64),
        "gradient all_reduce": ("all_reduce", params + rider_slots(world), torch.float32),
    }


def time_world(world: int, case_list: dict, reps: int) -> dict[str, float]:
    """Median seconds of each collective in a fresh gloo world of `world` processes, one
    thread each, as the ranks of a simulated world."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = rank_server.context(compose_run().topology.cpu_kernels, Path(tmp))
        results = ctx.Queue()
        init = f"file://{Path(tmp) / 'rendezvous'}"
        procs = [ctx.Process(target=_rank, args=(r, world, init, case_list, reps, results),
                             daemon=True) for r in range(world)]  # fmt: skip
        for proc in procs:
            proc.start()
        try:
            medians = results.get(timeout=TIMEOUT_S)
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    return medians
