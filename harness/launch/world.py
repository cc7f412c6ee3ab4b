"""A simulated world: nodes x ranks_per_node real processes with DDP over gloo on loopback.

One world serves many trials. The parent watches its children: a rank that dies, raises or hangs
ends the current trial as a crash within a bounded time, the world is torn down, and the next
trial gets a fresh one. Rendezvous goes through a file store, so no port is ever chosen by hand.

Liveness rather than one long deadline: each rank stamps a shared clock once it has joined the
world and at every step. A world whose ranks have not all joined within
topology.startup_timeout_s did not start (`WorldStartError`, not a crash of any trial); a rank
silent (no heartbeat, no CPU time used) for longer than the collective timeout plus a grace while
a trial runs is hung. A hung rank is asked for its Python stack (harness/launch/stacks.py) before
the world goes; topology.trial_timeout_s stays as the last resort for a trial that never ends.
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import queue
import re
import signal
import socket
import threading
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from harness.config.schema import RunConfig, TopologyConfig, TrialSpec
from harness.core.plugins import RankInfo
from harness.launch import rank_server, stacks
from harness.results.schema import RankResult, TrialResult
from harness.runtime import determinism, devices, environment
from harness.runtime.trainer import run_trial

_POLL_S = 0.2
# After the first rank reports an error, how long the others get to report theirs.
_ERROR_GRACE_S = 2.0
# How long past the collective timeout a rank may go without a heartbeat while a trial runs. A
# step takes far less than either, and a rank blocked in a collective raises at the timeout.
SILENCE_GRACE_S = 10.0
_MIN_CPU_SHARE = 0.02
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class WorldStartError(RuntimeError):
    """The world's ranks did not all join it: the cause, and the stacks of those that hung."""

    def __init__(self, cause: str, dumps: dict[int, str]):
        super().__init__(cause)
        self.stacks = dumps


def loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), names[0])


def init_rank(topology: TopologyConfig, rank: int, local_rank: int | None = None) -> str:
    """Settings every rank needs before it joins, under either launcher: a fixed thread count,
    its GPU and, for exact replay there, what recomputation needs before NCCL and cuBLAS start.
    Its device. (The CPU kernel pins were set before it started; its report shows them.)"""
    # What the rank has imported (torch, the harness: some 250,000 objects) lives as long as it
    # does: out of the collector's reach, a full collection (Python's own, and shutdown's) reads
    # only the trials' objects. shutdown's took 0.1 s of CPU a rank; a world closed in 0.44 s on
    # 2 cores, and closes in 0.06 s.
    gc.freeze()
    torch.set_num_threads(topology.threads(rank))
    device = devices.rank_device(
        topology.device or "cpu", rank if local_rank is None else local_rank, devices.gpu_count()
    )
    if device.type == "cuda":
        if topology.deterministic:
            determinism.apply(topology.backend)
        torch.cuda.set_device(device)
    return str(device)


def _rank_main(
    rank: int,
    topology: TopologyConfig,
    init_file: str,
    tasks: mp.Queue,
    results: mp.Queue,
    workdir: str,
    store: str,
    beats: ctypes.Array,
) -> None:
    def beat() -> None:
        beats[rank] = time.monotonic()

    stacks.register(Path(workdir))  # its own file, not the rank server's it was forked from
    # The simulation listens on loopback only (docs/design.md, section 7); torchrun ranks use
    # the interface their host name resolves to, as on any cluster.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    device = init_rank(topology, rank)
    Path(workdir, f"rank{rank}.pid").write_text(str(os.getpid()))
    try:
        # A store, not a file:// URL: in a URL a relative path (the default out is) reads as a
        # host, file://results/runs/... as the file /runs/... on host "results", and every rank
        # waited for that folder to appear: a campaign's first run hung.
        rendezvous = dist.FileStore(init_file, topology.world_size)
        dist.init_process_group(
            topology.backend,
            store=rendezvous,
            rank=rank,
            world_size=topology.world_size,
            timeout=timedelta(seconds=topology.collective_timeout_s),
        )
    except Exception as exc:  # reported to the parent, which judges the start
        _report_error(results, rank, exc)
    # Joined: the world has started once every rank has reported what it computes with.
    results.put(
        (
            "ok",
            rank,
            environment.report(
                topology.cpu_kernels, device, dist.get_backend(), topology.cpu_numerics
            ),
        )
    )
    beat()
    info = RankInfo(rank, topology.world_size, topology.ranks_per_node, device)
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if not mp.parent_process().is_alive():  # orphaned: the campaign process is gone
                os._exit(1)
            continue
        if task is None:
            break
        run, spec = task
        beat()
        try:
            results.put(("ok", rank, run_trial(run, spec, info, Path(store), beat)))
        except Exception as exc:  # reported to the parent, which ends the trial as a crash
            _report_error(results, rank, exc)
    shutdown()
    # Every result is delivered; skip the interpreter's teardown of torch, which costs every
    # campaign about two seconds of closing its world on 2 cores.
    results.close()
    results.join_thread()
    os._exit(0)


# A rank's error in the crash cause: its first line, up to this many characters.
CAUSE_CHARACTERS = 300


def describe(exc: BaseException) -> str:
    """An error as a crash cause names it: its type and first line, cut at a word with an
    ellipsis where it runs past CAUSE_CHARACTERS (a cut mid-word read as the whole message)."""
    line = (str(exc).splitlines() or [""])[0]
    if len(line) > CAUSE_CHARACTERS:
        line = line[:CAUSE_CHARACTERS].rsplit(" ", 1)[0] + " ..."
    return f"{type(exc).__name__}: {line}"


def _report_error(results: mp.Queue, rank: int, exc: Exception) -> NoReturn:
    """Hand the error to the parent, with the line that raised it, and leave."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    results.put(("error", rank, f"{describe(exc)}{where}"))
    results.close()
    results.join_thread()
    os._exit(1)


def shutdown() -> None:
    """Leave the process group cleanly: collect the trial's DDP objects (whose threads abort the
    process if they outlive the group, and whose reducer, left holding the group's last
    reference, destroys it with the GIL held while the group's worker thread waits for the GIL
    to drop its last work: a deadlock at exit) and let every rank arrive before the group goes."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


# What a rank reports when a peer, not the rank itself, failed: its collective lost the peer.
PEER_FAILURE = ("Connection closed by peer", "Timed out waiting", "Connection reset by peer")
# A peer's address in gloo's message ("[127.0.0.1]:12447"): its port is ephemeral, another in
# every world, and the same trial's row states the same cause.
_PEER_PORT = re.compile(r"(\[[^\]\s/]+\]):\d+")


def raised(rank: int, error: str) -> tuple[bool, str]:
    """A rank's error as a crash cause states it, and whether it is the fallout of a peer's
    failure rather than the rank's own."""
    fallout = any(marker in error for marker in PEER_FAILURE)
    return fallout, f"rank {rank} raised " + _PEER_PORT.sub(r"\1", error)


def crash_cause(
    codes: list[int | None],
    finished: set[int],
    errors: dict[int, str],
    where: dict[int, str | None] | None = None,
) -> str:
    """Why a trial crashed, root cause first: ranks that died, ranks that raised an error of
    their own, ranks that went silent (hung), then ranks whose collective lost a peer.

    `where` holds, for a hung rank that was asked, its innermost frames, or None when it had not
    reached the harness yet (interpreter start or imports): those come first among the hung."""
    where = where or {}
    dead, own, unreached, hung, fallout = [], [], [], [], []
    for rank, code in enumerate(codes):
        if rank in errors:
            secondary, cause = raised(rank, errors[rank])
            (fallout if secondary else own).append(cause)
        elif rank in finished:
            continue
        elif code is not None:
            dead.append(f"rank {rank} {describe_exit(code)}")
        elif rank in where and where[rank] is None:
            unreached.append(f"rank {rank} hung before reaching the harness (start or imports)")
        elif where.get(rank):
            hung.append(f"rank {rank} hung in {where[rank]}")
        else:
            hung.append(f"rank {rank} hung")
    return "; ".join(dead + own + unreached + hung + fallout)


def cpu_ticks(pid: int) -> int | None:
    """The CPU time a process has used, in clock ticks; None where /proc cannot tell (not
    Linux, or the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])  # utime + stime


class Liveness:
    """When each rank last showed life while a trial runs: a heartbeat, or CPU time. A rank that
    computes slowly on a loaded machine is not hung; one asleep or blocked is, though its
    background threads (gloo's) wake now and then: it lives on under 2% of a core."""

    def __init__(self, procs: list[mp.Process], beats: ctypes.Array, since: float):
        self.procs = procs
        self.beats = beats
        self.seen = [since] * len(procs)
        self.ticks = [cpu_ticks(p.pid) for p in procs]

    def silent_for(self, rank: int, now: float) -> float:
        ticks, before = cpu_ticks(self.procs[rank].pid), self.ticks[rank]
        busy = _MIN_CPU_SHARE * (now - self.seen[rank]) * _CLOCK_TICKS
        if ticks is not None and before is not None and ticks - before >= max(busy, 1):
            self.ticks[rank], self.seen[rank] = ticks, now
        return now - max(self.seen[rank], self.beats[rank])


class World:
    """The rank processes of one simulated world, and the watchdog around each trial."""

    def __init__(
        self, topology: TopologyConfig, workdir: Path, store: Path, preload: tuple[str, ...] = ()
    ):
        self.topology = topology
        self.workdir = workdir / f"world-{uuid.uuid4().hex[:8]}"
        self.workdir.mkdir(parents=True)
        ctx = rank_server.context(topology.cpu_kernels, workdir, preload)
        self.tasks = [ctx.Queue() for _ in range(topology.world_size)]
        self.results = ctx.Queue()
        # When each rank last showed progress (time.monotonic, one clock for every process);
        # 0 until it has joined the world.
        self.beats = ctx.Array("d", topology.world_size, lock=False)
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
                    self.beats,
                ),
                daemon=True,
                name=f"sdc-rank{r}",
            )
            for r in range(topology.world_size)
        ]
        self.alive = True
        # From a thread: each start waits for the rank server, and a server stuck in its imports
        # must not hold the world's start past its timeout.
        threading.Thread(target=self._start_ranks, daemon=True, name="sdc-world-start").start()
        try:
            self.environments = self._await_start()
        except KeyboardInterrupt:
            # The server and its ranks ignore SIGINT (rank_server): the ranks started go, and the
            # server with them, mid-import or mid-fork (left alone, it went on into the world's
            # removed folder and printed a traceback).
            self.kill()
            rank_server.stop()
            raise
        refused = environment.refusal(topology.cpu_kernels, self.environments)
        if refused:
            self.kill()
            raise refused

    def _start_ranks(self) -> None:
        for proc in self.procs:
            if not self.alive:  # killed while it started
                return
            try:
                proc.start()
            except (OSError, EOFError):  # the server was stopped while it hung
                return

    def _await_start(self) -> list[environment.RankEnvironment]:
        """Every rank's report once all have joined; otherwise kill the world and raise
        WorldStartError."""
        errors: dict[int, str] = {}
        reports: dict[int, environment.RankEnvironment] = {}
        limit = self.topology.startup_timeout_s
        deadline = time.monotonic() + limit
        settle = None
        while len(reports) < len(self.procs):
            now = time.monotonic()
            if now >= min(deadline, settle or deadline):
                break
            settle = self._receive(reports, errors, settle)
        else:
            return [reports[r] for r in range(len(self.procs))]
        joined = {r for r, t in enumerate(self.beats) if t}
        if any(proc.pid is None for proc in self.procs):
            rank_server.stop()  # it never forked them: the next world gets a fresh one
        cause, dumps = self._judge(joined, errors)
        if time.monotonic() >= deadline:
            cause = f"{cause} (topology.startup_timeout_s={limit:g})"
        raise WorldStartError(f"world did not start: {cause}", dumps)

    def _receive(
        self, parts: dict[int, Any], errors: dict[int, str], settle: float | None
    ) -> float | None:
        """Take one report, if one comes within a poll; return when to stop waiting for the
        others once a rank has failed."""
        try:
            kind, rank, payload = self.results.get(timeout=_POLL_S)
        except queue.Empty:
            if settle is None and any(p.exitcode is not None for p in self.procs):
                return time.monotonic() + _ERROR_GRACE_S
            return settle
        (parts if kind == "ok" else errors)[rank] = payload
        if kind != "ok" and settle is None:
            return time.monotonic() + _ERROR_GRACE_S
        return settle

    def run(self, run: RunConfig, spec: TrialSpec) -> TrialResult:
        for q in self.tasks:
            q.put((run, spec))
        parts: dict[int, RankResult] = {}
        errors: dict[int, str] = {}
        started = time.monotonic()
        deadline = started + self.topology.trial_timeout_s
        silence = self.topology.collective_timeout_s + SILENCE_GRACE_S
        liveness = Liveness(self.procs, self.beats, started)
        settle = None  # once a rank failed, how long the others get to report
        timed_out = False
        while len(parts) + len(errors) < len(self.procs):
            now = time.monotonic()
            timed_out = now >= deadline
            waiting = [r for r in range(len(self.procs)) if r not in parts and r not in errors]
            silent = any(liveness.silent_for(r, now) > silence for r in waiting)
            if timed_out or silent or (settle is not None and now >= settle):
                break
            settle = self._receive(parts, errors, settle)
        if len(parts) == len(self.procs):
            return TrialResult(parts=[parts[r] for r in range(len(self.procs))])
        cause, dumps = self._judge(set(parts), errors)
        if timed_out:
            limit = self.topology.trial_timeout_s
            cause = f"no result within topology.trial_timeout_s={limit:g}; {cause}"
        # Every rank raised the same error on the same line: the workload fails, not the world.
        same = len(errors) == len(self.procs) and len(set(errors.values())) == 1
        return TrialResult(crash=cause, stacks=dumps, workload_error=same)

    def _judge(self, finished: set[int], errors: dict[int, str]) -> tuple[str, dict[int, str]]:
        """The cause of a failure, with the stacks of the ranks that hung; kills the world."""
        hung = {
            r: p.pid
            for r, p in enumerate(self.procs)
            if r not in finished and r not in errors and p.exitcode is None
        }  # a rank the server never forked has no pid, and no stack file: it did not start
        dumps = stacks.collect(self.workdir, hung)
        codes = [proc.exitcode for proc in self.procs]
        self.kill()
        # A rank without a stack file had not reached the harness; one that did not answer the
        # signal gets no frames.
        where = {
            r: stacks.innermost(dumps.get(r, "")) if stacks.reached(self.workdir, pid) else None
            for r, pid in hung.items()
        }
        return crash_cause(codes, finished, errors, where), dumps

    def kill(self) -> None:
        self.alive = False
        started = [proc for proc in self.procs if proc.pid is not None]
        for proc in started:
            if proc.is_alive():
                proc.kill()
        for proc in started:
            proc.join(timeout=5)

    def close(self) -> None:
        if not self.alive:
            return
        for q in self.tasks:
            q.put(None)
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(timeout=10)
        self.kill()
