"""The world torchrun starts (one agent per host, its ranks on every host) run as the campaign's
world: rank 0 runs harness/campaign/run.py's loop, as the spawned campaign's parent does, and its
executor hands each trial to every rank, trains its own part and gathers the others'.

Control goes through torchrun's rendezvous store, which every rank reaches: rank 0 posts task n
under its number and the others take it; a rank that fails posts its error there. Process groups
are formed from the same store, one per world: a recovery segment in a smaller world (no spare
for a quarantined node) runs on the first ranks in a group of their own while the rest sit it
out, as the spawned campaign runs it in a smaller world.

A crash: a failed collective raises on the ranks still alive (every collective has the
topology's timeout). Each posts its error and leaves; rank 0 waits a grace for the reports, names
the cause (a rank's own error first, then the ranks that sent none, then those that only lost a
peer), and the campaign records the trial as a crash. A lost rank cannot be replaced inside
torchrun's world, so the campaign then stops (exit 1): rerunning the same command, or torchrun's
own --max-restarts, resumes in a fresh world after the last recorded trial.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from harness.config.schema import RunConfig, TopologyConfig, TrialSpec
from harness.core.plugins import RankInfo
from harness.launch import stacks
from harness.launch.world import describe, raised, shutdown
from harness.results.schema import RankResult, TrialResult
from harness.runtime import environment
from harness.runtime.trainer import run_trial

# How long rank 0 waits for the other ranks' reports once its own part of a trial failed.
REPORT_GRACE_S = 5.0
# How long a rank that failed waits for rank 0 to record the crash, beyond the time rank 0 may
# take to notice it (a collective timeout and the grace): torchrun stops every rank of a host
# as soon as one of them exits.
RECORD_WAIT_S = 30.0
# How long a host may take to see the files the others wrote in the store. No host looks a
# token's name up before every host has written its own (a barrier between), so no network file
# system holds a stale "no such file" for it; this covers a server slow to publish.
SHARED_WAIT_S = 2.0
END = None  # the task after the last one: every rank leaves the world cleanly
STOP = "stop"  # rank 0 ended the campaign early: every rank leaves without a word
PLAN_KEY = "plan"  # the resolved RunConfig rank 0 validated, for the other ranks


@dataclass(frozen=True)
class Task:
    """One trial (or recovery segment, or timed run) for every rank; `world` numbers the group
    it runs in, a new one whenever the world's size changes."""

    world: int
    run: RunConfig
    spec: TrialSpec


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def crash_cause(errors: dict[int, str], size: int, hosts: list[str]) -> str:
    """Why a trial crashed, root cause first: ranks that raised an error of their own, ranks
    (by host) that reported nothing within the grace, then ranks whose collective lost a peer."""
    own, fallout = [], []
    for rank, error in sorted(errors.items()):
        secondary, cause = raised(rank, error)
        (fallout if secondary else own).append(cause)
    silent: dict[str, list[int]] = {}
    for rank in range(size):
        if rank not in errors:
            silent.setdefault(hosts[rank], []).append(rank)
    quiet = [
        f"{_ranks(ranks)} on {host} sent no report within {REPORT_GRACE_S:g} s"
        for host, ranks in silent.items()
    ]
    return "; ".join(own + quiet + fallout)


def mixed_devices(kinds: list[str], hosts: list[str]) -> str | None:
    """None when every rank computes on one kind of device; otherwise which hosts resolved to
    which, in one line. The weight fingerprint differs between the CPU and a GPU
    (detectors/fingerprint.py), so a mixed world would disagree with itself on every check."""
    if len(set(kinds)) <= 1:
        return None
    where = {k: sorted({hosts[r] for r, kind in enumerate(kinds) if kind == k}) for k in kinds}
    what = "; ".join(f"{kind} on {', '.join(on)}" for kind, on in sorted(where.items()))
    return (
        f"topology.device: the hosts resolved different devices ({what}); set "
        "topology.device=cpu or topology.device=cuda"
    )


def rendezvous_store(rank: int, topology: TopologyConfig) -> dist.Store:
    """torchrun's rendezvous store, as this campaign's ranks share it. Rank 0 may keep the others
    waiting on it for a whole recovery segment they sit out."""
    wait = timedelta(seconds=topology.startup_timeout_s + topology.trial_timeout_s)
    # The agent's store outlives a restart of its workers (--max-restarts): each attempt keeps
    # its own keys.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=rank == 0 and not agent_store,
        timeout=wait,
    )
    return dist.PrefixStore(f"sdc-bench/attempt{attempt}/", client)


class PlanRefused(Exception):
    """Rank 0 could not validate the plan, and says why itself."""


def shared_plan(store: dist.Store, rank: int, validate: Callable[[], RunConfig]) -> RunConfig:
    """The plan, validated once: rank 0 validates it (`validate`) and hands the resolved config
    to every other rank through the store, as the spawned campaign's parent hands it to its
    ranks. Whatever stops rank 0's validation reaches the others at once, as PlanRefused."""
    if rank != 0:
        shared = store.get(PLAN_KEY)
        if not shared:
            raise PlanRefused
        return pickle.loads(shared)
    try:
        run = validate()
    except BaseException:
        store.set(PLAN_KEY, b"")
        raise
    store.set(PLAN_KEY, pickle.dumps(run))
    return run


class TorchrunWorld:
    """This rank's side of the world: the store, the group of the current world, and each
    task's part."""

    def __init__(
        self,
        run: RunConfig,
        rank: int,
        size: int,
        store: dist.Store,
        store_dir: Path,
        device: str = "cpu",
    ):
        topo = run.topology
        self.rank, self.size, self.per_node = rank, size, topo.ranks_per_node
        self.device = device  # this rank's (harness/runtime/devices.py)
        self.backend = topo.backend
        self.timeout = timedelta(seconds=topo.collective_timeout_s)
        self.store_dir = store_dir
        self.record_wait = topo.collective_timeout_s + REPORT_GRACE_S + RECORD_WAIT_S
        self.hosts: list[str] = []  # each rank's host name, once the world is joined
        # What each rank computes with, as it reported it on joining.
        self.environments: list[environment.RankEnvironment] = []
        self.cpu_kernels = topo.cpu_kernels
        self.cpu_numerics = topo.cpu_numerics
        self.store = store
        self.world: int | None = None
        self._join_first(timedelta(seconds=topo.startup_timeout_s))

    def _join_first(self, limit: timedelta) -> None:
        """Join the full world once every rank is up: hosts start their ranks at different
        times, and the group's own timeout is the collective one."""
        self.store.set(f"up/{self.rank}", "1")
        self.store.wait([f"up/{r}" for r in range(self.size)], limit)
        self._join(0, self.size)
        mine = environment.report(
            self.cpu_kernels, self.device, dist.get_backend(), self.cpu_numerics
        )
        self.environments = [None] * self.size
        dist.all_gather_object(self.environments, mine)
        self.hosts = [e.host for e in self.environments]

    def _join(self, world: int, size: int) -> bool:
        """Enter world `world`, the first `size` ranks; False when this rank sits it out."""
        if world != self.world:
            if dist.is_initialized():
                self.leave()
            self.world = world
            if self.rank < size:
                dist.init_process_group(
                    self.backend,
                    store=dist.PrefixStore(f"world{world}/", self.store),
                    rank=self.rank,
                    world_size=size,
                    timeout=self.timeout,
                )
        return self.rank < size

    def leave(self) -> None:
        """Leave the current group cleanly, if this rank is in one."""
        if dist.is_initialized():
            shutdown()

    def post(self, n: int, task: Task | str | None) -> None:
        self.store.set(f"task/{n}", pickle.dumps(task))

    def take(self, n: int) -> Task | str | None:
        return pickle.loads(self.store.get(f"task/{n}"))

    def train(self, task: Task) -> list[RankResult] | None:
        """This rank's part of a task; rank 0 returns every rank's."""
        size = task.run.topology.world_size
        if not self._join(task.world, size):
            return None
        info = RankInfo(self.rank, size, self.per_node, self.device)
        part = run_trial(task.run, task.spec, info, self.store_dir)
        parts = [None] * size if self.rank == 0 else None
        dist.gather_object(part, parts, dst=0)
        return parts

    def report(self, n: int, exc: BaseException) -> None:
        """Post this rank's error for task n; a store out of reach (this host lost its link)
        gets a few seconds, not the store's long timeout."""
        key, value = f"error/{n}/{self.rank}", describe(exc)
        thread = threading.Thread(target=self.store.set, args=(key, value), daemon=True)
        thread.start()
        thread.join(REPORT_GRACE_S)

    def await_end(self, n: int) -> None:
        """After a failure: wait until rank 0 has recorded the crash and posted task `n` (its
        end), or a bounded time when it cannot (it died, or this host lost its link)."""
        thread = threading.Thread(target=self.take, args=(n,), daemon=True)
        thread.start()
        thread.join(self.record_wait)

    def cause(self, n: int, size: int, exc: BaseException) -> str:
        """Rank 0: the crash cause of task n, from its own error and the others' reports."""
        errors = {0: describe(exc)}
        deadline = time.monotonic() + REPORT_GRACE_S
        while len(errors) < size and time.monotonic() < deadline:
            for rank in range(1, size):
                key = f"error/{n}/{rank}"
                if rank not in errors and self.store.check([key]):
                    errors[rank] = self.store.get(key).decode()
            time.sleep(0.1)
        return crash_cause(errors, size, self.hosts)

    def refusal(self) -> str | None:
        """Why this world may not run the plan, in one line, from every rank's report (the same
        answer on every rank): a rank that does not run the plan's kernel pins, or hosts that
        resolved different devices."""
        refused = environment.refusal(self.cpu_kernels, self.environments)
        if refused:
            return str(refused)
        return mixed_devices([e.device for e in self.environments], self.hosts)

    def shared(self, folder: Path) -> str | None:
        """Whether every host sees what every other host writes in `folder`; otherwise the
        hosts that do not, in one line (the same on every rank)."""
        folder.mkdir(parents=True, exist_ok=True)
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        mine = folder / f".shared-{token[0]}-{self.rank}"
        mine.write_text(self.hosts[self.rank])
        dist.barrier()
        deadline = time.monotonic() + SHARED_WAIT_S
        while True:
            unseen = [
                r for r in range(self.size) if not (folder / f".shared-{token[0]}-{r}").exists()
            ]
            if not unseen or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        every = [None] * self.size
        dist.all_gather_object(every, unseen)
        dist.barrier()
        mine.unlink(missing_ok=True)
        blind = {
            self.hosts[r]: sorted({self.hosts[u] for u in missing})
            for r, missing in enumerate(every)
            if missing
        }
        if not blind:
            return None
        what = "; ".join(f"{host} does not see {', '.join(of)}" for host, of in blind.items())
        return (
            f"out: {folder} is not one folder on every host ({what}); put out on a file "
            "system every host mounts"
        )


class TorchrunExecutor:
    """Rank 0's executor for harness.campaign.run.run_campaign: each trial goes to every rank.
    `log` (the run's crashes.log) gets each crash's cause."""

    def __init__(self, world: TorchrunWorld, log: Path):
        self.world = world
        self.log = log
        self.tasks = 0
        self.group, self.size = 0, world.size
        self.lost: str | None = None

    def start(self, topology: TopologyConfig) -> list[environment.RankEnvironment]:
        """What every rank of torchrun's world computes with (it started before the campaign)."""
        return self.world.environments

    def run(self, run: RunConfig, spec: TrialSpec) -> TrialResult:
        if self.lost:
            return TrialResult(crash=f"not run: {self.lost}")
        if run.topology.world_size != self.size:
            self.group, self.size = self.group + 1, run.topology.world_size
        n, task = self.tasks, Task(self.group, run, spec)
        self.tasks += 1
        self.world.post(n, task)
        try:
            return TrialResult(parts=self.world.train(task))
        except Exception as exc:  # a rank or a link failed: the trial crashed
            self.lost = f"torchrun's world was lost in {spec.trial_id}"
            cause = self.world.cause(n, self.size, exc)
            stacks.append_log(self.log, f"{spec.trial_id} crashed: {cause}")
            return TrialResult(crash=cause)

    # A golden run that crashed cannot get a second try in this world: the campaign stops, and
    # the rerun that resumes it runs the golden run again.
    run_golden = run

    def end(self, task: str | None) -> None:
        """Tell every rank the campaign is over: END to leave the world cleanly, STOP to just
        go."""
        self.world.post(self.tasks, task)

    def kill(self) -> None:
        """Ctrl-C reaches every rank from torchrun itself."""

    def close(self) -> None:
        """The world outlives the campaign loop: the worker ends it (`end`)."""


def follow(world: TorchrunWorld) -> int:
    """A rank other than 0: run every task rank 0 posts; the exit code when the campaign ends."""
    n = 0
    while True:
        task = world.take(n)
        if task is END:
            world.leave()
            return 0
        if task == STOP:
            return 1
        try:
            world.train(task)
        except Exception as exc:  # rank 0 records the crash; this rank's world is gone
            world.report(n, exc)
            world.await_end(n + 1)
            return 1
        n += 1
