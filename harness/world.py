"""A simulated world: nodes x ranks_per_node real processes with DDP over gloo on loopback.

One world serves many trials. The parent watches its children: a rank that dies, raises or hangs
ends the current trial as a crash within a bounded time, the world is torn down, and the next
trial gets a fresh one. Rendezvous goes through a file store, so no port is ever chosen by hand.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from harness import environment
from harness.config import RunConfig, TopologyConfig, TrialSpec
from harness.plugins import RankInfo
from harness.trainer import RankResult, run_trial

_POLL_S = 0.2
# After the first rank reports an error, how long the others get to report theirs.
_ERROR_GRACE_S = 2.0


@dataclass
class Outcome:
    """A trial's result: one part per rank, or the cause of its crash."""

    parts: list[RankResult] | None = None
    crash: str | None = None
    recovery: dict | None = None  # what harness.recovery did, when it ran


def loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), names[0])


def init_rank(topology: TopologyConfig, rank: int) -> None:
    """Settings every rank needs before it joins: loopback only, a fixed thread count, and the
    pinned CPU kernels (set in its environment before it started)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    torch.set_num_threads(topology.threads(rank))
    environment.check_rank(topology.cpu_kernels)


def _rank_main(
    rank: int,
    topology: TopologyConfig,
    init_file: str,
    tasks: mp.Queue,
    results: mp.Queue,
    workdir: str,
    store: str,
) -> None:
    init_rank(topology, rank)
    parent = os.getppid()
    Path(workdir, f"rank{rank}.pid").write_text(str(os.getpid()))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=topology.world_size,
        timeout=timedelta(seconds=topology.collective_timeout_s),
    )
    info = RankInfo(rank, topology.world_size, topology.ranks_per_node)
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # orphaned: the campaign process is gone
                os._exit(1)
            continue
        if task is None:
            break
        run, spec = task
        try:
            results.put(("ok", rank, run_trial(run, spec, info, Path(store))))
        except Exception as exc:  # reported to the parent, which ends the trial as a crash
            results.put(("error", rank, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))
            results.close()
            results.join_thread()
            os._exit(1)
    shutdown()
    # Every result is delivered; skip the interpreter's teardown of torch, which costs every
    # campaign about two seconds of closing its world on 2 cores.
    results.close()
    results.join_thread()
    os._exit(0)


def shutdown() -> None:
    """Leave the process group cleanly: collect the trial's DDP objects (whose threads abort the
    process if they outlive the group) and let every rank arrive before the group goes."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


# What a rank reports when a peer, not the rank itself, failed: its collective lost the peer.
PEER_FAILURE = ("Connection closed by peer", "Timed out waiting", "Connection reset by peer")


def crash_cause(codes: list[int | None], finished: set[int], errors: dict[int, str]) -> str:
    """Why a trial crashed, root cause first: ranks that died, ranks that raised an error of
    their own, ranks that went silent (hung), then ranks whose collective lost a peer."""
    dead, raised, hung, fallout = [], [], [], []
    for rank, code in enumerate(codes):
        if rank in errors:
            error = errors[rank]
            secondary = any(marker in error for marker in PEER_FAILURE)
            (fallout if secondary else raised).append(f"rank {rank} raised {error}")
        elif rank in finished:
            continue
        elif code is not None:
            dead.append(f"rank {rank} {describe_exit(code)}")
        else:
            hung.append(f"rank {rank} hung")
    return "; ".join(dead + raised + hung + fallout)


class World:
    """The rank processes of one simulated world, and the watchdog around each trial."""

    def __init__(self, topology: TopologyConfig, workdir: Path, store: Path):
        self.topology = topology
        self.workdir = workdir / f"world-{uuid.uuid4().hex[:8]}"
        self.workdir.mkdir(parents=True)
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(topology.world_size)]
        self.results = ctx.Queue()
        # Absolute: a relative path in a file:// URL reads as a host name, and ranks wait forever.
        init_file = str((self.workdir / "rendezvous").resolve())
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    r,
                    topology,
                    init_file,
                    self.tasks[r],
                    self.results,
                    str(self.workdir),
                    str(store),
                ),
                daemon=True,
                name=f"sdc-rank{r}",
            )
            for r in range(topology.world_size)
        ]
        # A spawned rank imports torch before it runs a line of ours: the pins must be in the
        # environment it inherits.
        with environment.pinned(topology.cpu_kernels):
            for proc in self.procs:
                proc.start()
        self.alive = True

    def run(self, run: RunConfig, spec: TrialSpec) -> Outcome:
        for q in self.tasks:
            q.put((run, spec))
        parts: dict[int, RankResult] = {}
        errors: dict[int, str] = {}
        now = time.monotonic()
        deadline = now + self.topology.trial_timeout_s
        settle = None  # once a rank failed, how long the others get to report
        while len(parts) + len(errors) < len(self.procs) and now < min(
            deadline, settle or deadline
        ):
            try:
                kind, rank, payload = self.results.get(timeout=_POLL_S)
                (parts if kind == "ok" else errors)[rank] = payload
                if kind != "ok":
                    settle = settle or time.monotonic() + _ERROR_GRACE_S
            except queue.Empty:
                if settle is None and any(p.exitcode is not None for p in self.procs):
                    settle = time.monotonic() + _ERROR_GRACE_S
            now = time.monotonic()
        if len(parts) == len(self.procs):
            return Outcome(parts=[parts[r] for r in range(len(self.procs))])
        cause = self._cause(parts, errors)
        if now >= deadline:
            limit = self.topology.trial_timeout_s
            cause = f"no result within topology.trial_timeout_s={limit:g}; {cause}"
        self.kill()
        return Outcome(crash=cause)

    def _cause(self, parts: dict[int, RankResult], errors: dict[int, str]) -> str:
        codes = [proc.exitcode for proc in self.procs]
        return crash_cause(codes, set(parts), errors)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5)
        self.alive = False

    def close(self) -> None:
        if not self.alive:
            return
        for q in self.tasks:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
        self.kill()
