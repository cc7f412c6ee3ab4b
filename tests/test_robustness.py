"""The harness survives faults in itself: dying, hanging and raising ranks, interrupted and
killed campaigns, a full disk. Nothing is lost, nothing is counted twice, nothing is left behind."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from harness.campaign.run import SpawnExecutor
from harness.launch import world as world_module
from harness.launch.world import World
from tests.conftest import BIN, compose_run, rows, sdc_bench, without_timing

SMALL = ["workload.steps=8", "campaign.noise_seeds=2", "topology.collective_timeout_s=5"]


class PidWatcher(threading.Thread):
    """Collects the pid of every rank any world of a campaign starts."""

    def __init__(self, out: Path):
        super().__init__(daemon=True)
        self.out, self.pids, self.done = out, set(), threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            # A pid file may be half-written or gone with its world: skip it this round.
            found = []
            with contextlib.suppress(OSError):
                found = list(self.out.glob("world/world-*/rank*.pid"))
            for f in found:
                with contextlib.suppress(OSError, ValueError):
                    self.pids.add(int(f.read_text()))
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: set[int], timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return {p for p in pids if _alive(p)}


def _scenarios(*items: str) -> str:
    return "campaign.scenarios=[" + ",".join("{" + s + "}" for s in items) + "]"


# sdc-bench in a world that loses rank 0 to SIGKILL the first time golden-s1 runs in it, as a
# world whose node dies under a golden run would.
KILL_UNDER_GOLDEN_ONCE = """
import sys
from harness import cli
from harness.launch.world import World

run, killed = World.run, []

def run_losing_rank_0_once(world, config, spec):
    if spec.trial_id == "golden-s1" and not killed:
        killed.append(spec.trial_id)
        world.procs[0].kill()
    return run(world, config, spec)

World.run = run_losing_rank_0_once
sys.argv = ["sdc-bench", *sys.argv[1:]]
cli.main()
"""


def test_crashing_ranks_cost_one_trial_each_and_a_golden_run_lost_to_the_world_is_retried(
    tmp_path,
):
    out = tmp_path / "run"
    crash = "site:grad,model:crash,steps:[3],ranks:[{rank}],value:{action}"
    actions = [("raise", 1), ("exit", 2), ("hang", 3), ("kill", 0)]
    scenarios = [crash.format(rank=r, action=a) for a, r in actions]
    scenarios.append("site:grad,model:value,value:nan,ranks:[1],steps:[3]")
    watcher = PidWatcher(out)
    watcher.start()
    proc = subprocess.run(
        # Off: golden-s1 must run here, not come from another test's golden store entry.
        [sys.executable, "-c", KILL_UNDER_GOLDEN_ONCE, *SMALL, "campaign.seeds=1",
         "campaign.golden_cache=false", "checkpoint.keep=true", _scenarios(*scenarios),
         f"out={out}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    watcher.done.set()
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = rows(out)
    assert [r["effect"] for r in table] == ["crash"] * 4 + ["harmful"]
    # Each crash struck, though its rank returned no events: it kept its strike before it acted.
    struck = [(r["fired"], r["inject_step"], r["injected_ranks"]) for r in table[:4]]
    assert struck == [("True", "3", str(rank)) for _, rank in actions]
    # Read into the rows, then gone from the kept store, which holds checkpoints.
    assert (out / "store").is_dir() and not list((out / "store").rglob("*.last_words.jsonl"))
    causes = [r["crash_cause"] for r in table[:4]]
    # The root cause first, then the peers whose collectives lost it.
    assert causes[0].startswith("rank 1 raised InjectedCrash: injected crash")
    assert causes[1].startswith("rank 2 exited with code 0")
    assert causes[3].startswith("rank 0 killed by SIGKILL")
    # The hung rank shows where it hangs; its peers gave up at the collective timeout (5 s),
    # long before the trial timeout (300 s).
    assert causes[2].startswith("rank 3 hung in crash.py:"), causes[2]
    assert " corrupt <- " in causes[2] and "Timed out" in causes[2]
    assert "trial_timeout_s" not in causes[2]
    log = (out / "crashes.log").read_text()
    assert "--- rank 3: Python stacks" in log and 'injectors/crash.py", line' in log
    # The golden run lost to the world: both tries in the log, then the campaign went on.
    first, retry, second = (
        log.index("golden-s1 crashed: rank 0 killed by SIGKILL"),
        log.index("golden-s1 failed: retrying once in a fresh world"),
        log.index("golden-s1 finished on its second try"),
    )
    assert first < retry < second
    assert "golden-s1 failed (rank 0 killed by SIGKILL" in proc.stderr
    assert len((out / "golden.jsonl").read_text().splitlines()) == 2
    assert len(watcher.pids) >= 4 * 6, "a fresh world after each crash"
    assert not _wait_gone(watcher.pids, 15), "no rank process may be left behind"


def test_a_rank_hung_outside_any_collective_is_found_by_its_silence_with_its_stack(
    tmp_path, monkeypatch
):
    # Rank 3 hangs in the last step's weight update: no collective follows, so its peers
    # finish, and only its silence tells.
    # The grace covers a rank blocked in a collective on its way from the timeout to its report;
    # no rank here is, so 2 s instead of 10 s of waiting judge the same silence.
    grace = 2.0
    monkeypatch.setattr(world_module, "SILENCE_GRACE_S", grace)
    run = compose_run(
        "campaign.scenarios=[{site:weight,model:crash,value:hang,ranks:[3],steps:[7]}]",
        "campaign.seeds=1",
        "workload.steps=8",
        "topology.collective_timeout_s=3",
    )
    world = World(run.topology, tmp_path / "world", tmp_path / "store")
    outcome = world.run(run, run.trials[0])
    # Reported this long after the hung rank's last heartbeat (the start of its last step).
    silent = time.monotonic() - world.beats[3]
    assert outcome.crash is not None and outcome.crash.startswith("rank 3 hung in crash.py:")
    # Its innermost frames, the crash model's own first: where it hangs, and who called it.
    assert "<- model.py:" in outcome.crash and ";" not in outcome.crash, outcome.crash
    assert silent < run.topology.collective_timeout_s + grace + 10
    assert "Current thread" in outcome.stacks[3] or "Thread 0x" in outcome.stacks[3]
    assert not world.alive


# Interpreter start-up of the rank server that ranks fork from (harness/launch/rank_server.py),
# before any harness code: the first server stalls, as one stuck in its imports would; the next
# starts.
STALL_ONCE = """
import os, sys, time
if "multiprocessing.forkserver" in " ".join(sys.orig_argv) and "STALL_ONCE" in os.environ:
    try:
        os.close(os.open(os.environ["STALL_ONCE"], os.O_CREAT | os.O_EXCL))
        time.sleep(3600)
    except FileExistsError:
        pass
"""


# The slow set (13 s): the default run keeps a world lost and started afresh in the crashing
# ranks' test above (a golden run's world, retried once).
@pytest.mark.slow
def test_a_world_whose_rank_cannot_start_is_reported_and_started_afresh(tmp_path, monkeypatch):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(STALL_ONCE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("STALL_ONCE", str(tmp_path / "stalled"))
    run = compose_run(
        "campaign=single",
        "workload.steps=2",
        # A fresh world starts and runs its trial in about 5 s, idle or under 2-worker load.
        "topology.startup_timeout_s=10",
        "topology.collective_timeout_s=60",  # the joined ranks wait in rendezvous, not raise
    )
    log = tmp_path / "crashes.log"
    executor = SpawnExecutor(run.topology, tmp_path / "world", tmp_path / "store", log)
    begun = datetime.now(UTC)
    try:
        outcome = executor.run(run, run.trials[0])
    finally:
        executor.close()
    assert outcome.crash is None
    lines = log.read_text().splitlines()
    stamp, _, first = lines[0].partition(" ")
    assert first.startswith("world did not start: rank "), first
    assert "hung before reaching the harness" in first and "startup_timeout_s=10" in first
    assert (datetime.fromisoformat(stamp) - begun).total_seconds() < 10 + 5
    assert "failed: retrying once in a fresh world" in lines[-1]
    assert sum("world did not start" in line for line in lines) == 1


def test_a_ctrl_c_while_the_command_imports_torch_ends_in_one_line(tmp_path):
    """The signal lands once the command's process has loaded torch's library, a second or more
    before any of sdc-bench's own code could answer it (harness/entry.py). The child's SIGINT
    is made the default first: a shell that starts this suite in the background ignores it, and
    its children inherit that."""
    child = subprocess.Popen(
        [str(BIN / "sdc-bench"), f"out={tmp_path / 'run'}"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    maps = Path(f"/proc/{child.pid}/maps")
    deadline = time.monotonic() + 60
    while "libtorch" not in maps.read_text():
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.01)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=60)
    assert (child.returncode, stderr) == (130, "sdc-bench: interrupted; nothing was run\n")
    assert not (tmp_path / "run").exists()


def _reference_and_interrupted(tmp_path, stop_signal: int, run_ok):
    # 6 trials of 8 steps, each fast-forwarded to its fault at step 5: the signal lands after
    # the second row, with four still to come. One seed: the golden runs are the two noise
    # seeds', not six.
    faults = ",".join(
        f"{{site:grad,model:scale,factor:{2 ** (k + 1)},ranks:[1],steps:[5]}}" for k in range(6)
    )
    args = [*SMALL, "campaign.seeds=1", f"campaign.scenarios=[{faults}]"]
    # The reference and the resume in this process: only the interrupted run is the command
    # under test (its signal).
    reference = tmp_path / "reference"
    run_ok(*args, f"out={reference}", cwd=tmp_path)
    out = tmp_path / "interrupted"
    child = subprocess.Popen(
        [str(BIN / "sdc-bench"), *args, f"out={out}"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    watcher = PidWatcher(out)
    watcher.start()
    deadline = time.monotonic() + 240
    while not (out / "trials.csv").exists() or len(rows(out)) < 2:
        assert time.monotonic() < deadline and child.poll() is None
        time.sleep(0.05)
    child.send_signal(stop_signal)
    _, stderr = child.communicate(timeout=60)
    watcher.done.set()
    return args, reference, out, child.returncode, stderr, watcher.pids


# SIGKILL (the harder case: nothing runs after it) in the default run; SIGINT and SIGTERM (a
# scheduler's stop: it exited 143 in silence, its world folder left behind) in the slow one.
@pytest.mark.parametrize(
    "stop_signal",
    [
        pytest.param(signal.SIGINT, marks=pytest.mark.slow),
        pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
        signal.SIGKILL,
    ],
    ids=["SIGINT", "SIGTERM", "SIGKILL"],
)
def test_an_interrupted_campaign_resumes_to_the_same_rows(tmp_path, run_ok, stop_signal):
    args, reference, out, code, stderr, pids = _reference_and_interrupted(
        tmp_path, stop_signal, run_ok
    )
    if stop_signal != signal.SIGKILL:
        assert code == 128 + stop_signal and "rerun with out=" in stderr, stderr
        assert "Traceback" not in stderr and not (out / "world").exists(), stderr
    assert 2 <= len(rows(out)) < 6
    # Orphaned ranks notice their parent is gone and leave within a trial plus a second.
    assert not _wait_gone(pids, 30)
    run_ok(*args, f"out={out}", cwd=tmp_path)
    assert without_timing(rows(out)) == without_timing(rows(reference))


def test_a_full_disk_ends_with_a_clear_error_and_every_written_row_intact(tmp_path, run_ok):
    out = tmp_path / "run"
    args = [
        *SMALL,
        "campaign.seeds=4",  # each trial appends about 20 kB of events: the limit stops the third
        "fault=grad_nan",
        "fault.steps=[1]",
        "checkpoint.interval=1000",
        f"out={out}",
    ]

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, 60_000))

    proc = subprocess.run(
        [str(BIN / "sdc-bench"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=small_disk,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("sdc-bench: campaign failed: cannot write results in")
    assert "File too large" in last
    written = rows(out)
    assert 0 < len(written) < 4
    assert all(r["effect"] == "harmful" and r["step_time_s"] for r in written)
    # With room again, the same campaign completes (in this process: the command's limit and
    # exit code were the full-disk run's).
    run_ok(*args, cwd=tmp_path)
    assert len(rows(out)) == 4 and len({r["trial_id"] for r in rows(out)}) == 4


def _listening_addresses(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                addresses.add(fields[1].rsplit(":", 1)[0])
    return addresses


def test_ranks_talk_over_loopback_only(tmp_path, monkeypatch):
    run = compose_run("campaign=single", "fault=none", "workload.steps=2")
    # Relative folders, as under the default out: they once hung every rank's rendezvous.
    monkeypatch.chdir(tmp_path)
    world = World(run.topology, Path("world"), Path("store"))
    try:
        outcome = world.run(run, run.trials[0])
        assert outcome.crash is None
        addresses = _listening_addresses([p.pid for p in world.procs])
    finally:
        world.close()
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    assert addresses and addresses <= loopback, addresses


def test_sdc_report_refuses_folders_without_a_usable_table(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "trials.csv").write_text("trial_id,seed\nx,0\n")
    for folder, message in ((empty, "no trials.csv"), (broken, "missing columns: workload")):
        proc = subprocess.run(
            [str(BIN / "sdc-report"), str(folder)], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2
        assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(3600)  # about 15 minutes on an idle 2-core machine
def test_soak_200_trials_of_faults_crashes_and_hangs_end_with_200_rows(tmp_path):
    out = tmp_path / "soak"
    scenarios = _scenarios(
        "site:grad,model:bitflip,ranks:[1],steps:[2],grid:{bit:[sign,exponent,mantissa]}",
        "site:allreduce,model:scale,factor:100,scope:reduction,ranks:[0],steps:[3]",
        "site:weight,model:value,value:nan,ranks:[2],steps:[4]",
        "site:grad,model:crash,value:kill,ranks:[3],steps:[3]",
        "site:grad,model:crash,value:hang,ranks:[1],steps:[3]",
        "site:grad,model:crash,value:raise,ranks:[2],steps:[3]",
        "site:none",
        "site:activation,model:scale,factor:1000,ranks:[0],steps:[5]",
        "site:optimizer,model:bitflip,bit:exponent_msb,ranks:[1],steps:[2]",
        "site:loss,model:value,value:inf,ranks:[2],steps:[1]",
    )
    proc = sdc_bench(
        *SMALL, "campaign.seeds=17", scenarios, f"out={out}", cwd=tmp_path, timeout=3600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = rows(out)
    assert len(table) == 12 * 17 and len({r["trial_id"] for r in table}) == len(table)
    assert sum(r["effect"] == "crash" for r in table) == 3 * 17


@pytest.mark.slow
@pytest.mark.timeout(5400)  # about 20 minutes on an idle 2-core machine
def test_soak_30_default_campaigns_each_in_a_fresh_world_start_and_finish(tmp_path):
    """A first-run hang: start-up, again and again, with nothing reused."""
    for i in range(30):
        out = tmp_path / f"run{i}"
        proc = sdc_bench(f"out={out}", cwd=tmp_path, timeout=600)
        assert proc.returncode == 0, f"campaign {i}: {proc.stderr[-3000:]}"
        # Nothing crashed, no world start or golden run needed its second try.
        assert not (out / "crashes.log").exists(), (out / "crashes.log").read_text()[-3000:]
        assert len(rows(out)) == 40
