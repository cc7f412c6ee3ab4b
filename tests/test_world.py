"""The world survives its ranks: a killed rank costs one trial; torchrun runs the same code."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from harness.launch import stacks
from harness.launch.world import CAUSE_CHARACTERS, crash_cause, describe
from harness.runtime import environment
from tests.conftest import BIN, FAST, rows, without_timing


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# Slow set; the default-run twin is test_robustness'
# test_crashing_ranks_cost_one_trial_each_and_a_golden_run_lost_to_the_world_is_retried.
@pytest.mark.slow
def test_sigkilled_rank_costs_one_trial_and_the_campaign_goes_on(tmp_path):
    out = tmp_path / "run"
    args = [
        "fault=grad_nan",
        "workload.steps=200",
        "fault.steps=[150]",
        "campaign.seeds=3",
        "campaign.noise_seeds=2",
        f"out={out}",
    ]
    proc = subprocess.Popen(
        [str(BIN / "sdc-bench"), *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Goldens done and the first trial recorded: the world is mid-campaign.
        _wait_for(lambda: (out / "trials.csv").exists(), 240, "the first trial row")
        (world,) = (out / "world").glob("world-*")
        victim = int((world / "rank2.pid").read_text())
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    table = rows(out)
    assert len(table) == 3
    crashed = [r for r in table if r["effect"] == "crash"]
    assert len(crashed) == 1, [(r["trial_id"], r["effect"]) for r in table]
    assert "rank 2 killed by SIGKILL" in crashed[0]["crash_cause"]
    assert all(r["effect"] == "harmful" for r in table if r is not crashed[0])
    with_pid = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
    assert not any(p.name == str(victim) for p in with_pid)


def spawned_and_planned(tmp_path: Path, run_ok, args: list[str]) -> tuple[Path, Path, str]:
    """The campaign run in a spawned world, and planned for torchrun: both folders, and the
    torchrun command the plan printed."""
    spawned, planned = tmp_path / "spawned", tmp_path / "planned"
    run_ok(*args, f"out={spawned}", cwd=tmp_path)
    proc = run_ok(*args, "launcher=torchrun", f"out={planned}", cwd=tmp_path)
    return spawned, planned, proc.stdout.strip().splitlines()[-1]


# Slow set; the default run's twin is tests/test_multihost.py, whose agents run the command the
# plan prints (pins included) across three hosts and write the spawned simulation's rows.
@pytest.mark.slow
def test_torchrun_runs_the_same_worker_code_and_writes_the_same_rows(tmp_path, run_ok):
    args = [
        *FAST,
        "fault=grad_nan",
        "fault.steps=[5]",
        "topology.nodes=1",
        "topology.ranks_per_node=4",
    ]
    spawned, planned, printed = spawned_and_planned(tmp_path, run_ok, args)
    words = printed.split()
    # The command carries the kernel pins: torch reads them as it loads, before the worker runs.
    pins = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    assert pins == environment.pins("avx2")
    command = words[len(pins) :]
    assert command[:3] == ["torchrun", "--standalone", "--nproc-per-node=4"]
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", **pins)
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    spawned_rows, torchrun_rows = without_timing(rows(spawned)), without_timing(rows(planned))
    assert spawned_rows == torchrun_rows
    assert spawned_rows[0]["detected"] == "True" and spawned_rows[0]["suspect_ranks"] == "3"


# Slow set (about 2 minutes on 2 cores); the default run's twin is tests/test_multihost.py's
# rows on three hosts (the same engine; its crash rows and resume are in the slow set).
@pytest.mark.slow
def test_torchrun_recovers_in_a_shrunk_world_and_times_overhead_as_the_spawned_world(
    tmp_path, run_ok
):
    """One campaign engine: recovery (no spare, so the world shrinks to 3 ranks and back) and
    overhead.csv under torchrun, next to the spawned campaign's."""
    args = [
        *FAST,
        "recovery.enabled=true",
        "checkpoint.interval=2",
        "detectors=[replay,weight_consensus]",
        "detectors.replay.interval=5",
        "detectors.weight_consensus.interval=2",
        "campaign.scenarios=[{site:grad,model:scale,factor:1000,ranks:[1],steps:[5]}]",
        "campaign.seeds=1",
        "++campaign.overhead={steps:3,rounds:1}",
    ]
    spawned, planned, printed = spawned_and_planned(tmp_path, run_ok, args)
    # Four nodes of one rank: four agents on this machine, on loopback.
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{free.getsockname()[1]}"
    words = printed.replace("HOST:PORT", endpoint).split()
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", GLOO_SOCKET_IFNAME="lo")
    env.update(environment.pins("avx2"))
    agents = [
        subprocess.Popen(words[3:], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    errors = [agent.communicate(timeout=300)[1] for agent in agents]
    assert [agent.returncode for agent in agents] == [0] * 4, errors[0][-3000:]
    # recovery_s is wall time too: the world's start and the checkpoint's load.
    untimed = [
        [{**r, "recovery_s": ""} for r in without_timing(rows(out))] for out in (planned, spawned)
    ]
    (row,) = untimed[0]
    assert untimed[0] == untimed[1]
    assert row["recovered"] == "True" and row["final_nodes"] == "3"
    tables = [(out / "overhead.csv").read_text().splitlines() for out in (spawned, planned)]
    columns = [[line.split(",")[:2] for line in table] for table in tables]
    assert columns[0] == columns[1] and len(columns[0]) == 4  # header, hook, replay, consensus


# Slow set (about 45 s on 2 cores), beside tests/test_multihost.py's host cut and rerun; the
# default run's crash rows are the spawned world's (tests/test_robustness.py), whose causes
# torchrun's state the same way (harness/launch/world.py, `raised`).
@pytest.mark.slow
def test_torchrun_records_each_crash_and_its_max_restarts_resume_the_campaign(tmp_path, run_ok):
    args = [
        *("campaign=single", "fault.site=grad", "fault.model=crash", "fault.value=raise"),
        *("fault.ranks=[1]", "fault.steps=[3]", "workload.steps=6", "campaign.seeds=2"),
        *("campaign.noise_seeds=2", "topology.nodes=1", "topology.ranks_per_node=2"),
        "topology.collective_timeout_s=5",
    ]
    out = tmp_path / "out"
    proc = run_ok(*args, "launcher=torchrun", f"out={out}", cwd=tmp_path)
    words = proc.stdout.strip().splitlines()[-1].split()
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", GLOO_SOCKET_IFNAME="lo")
    env.update(environment.pins("avx2"))
    command = [words[3], "--max-restarts=2", *words[4:]]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    # Each crash ends torchrun's world after its row; torchrun starts a fresh one, which resumes.
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("campaign failed: torchrun's world was lost in") == 2
    table = rows(out)
    assert [r["effect"] for r in table] == ["crash", "crash"]
    for row in table:
        assert row["crash_cause"].startswith("rank 1 raised InjectedCrash: injected crash; rank 0 ")


def test_torchrun_refuses_a_world_that_does_not_match_the_plan(tmp_path, run_ok):
    planned = tmp_path / "planned"
    run_ok(*FAST, "fault=grad_nan", "launcher=torchrun", f"out={planned}", cwd=tmp_path)
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    done = subprocess.run(
        [
            "torchrun",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "harness.torchrun_worker",
            str(planned),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "the plan wants 4, 1 per node" in done.stderr
    assert not (planned / "trials.csv").exists()


def test_a_crash_names_its_root_cause_before_the_peers_that_lost_it():
    closed = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]"
    lost = f"{closed}:12447"
    waited = "RuntimeError: [gloo/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"
    own = "RuntimeError: injected crash at step 3"
    raised = crash_cause([None] * 4, set(), {0: lost, 1: lost, 2: own, 3: lost})
    assert raised.startswith(f"rank 2 raised {own}; rank 0 raised {closed};")
    hung = crash_cause([None] * 4, set(), {0: waited, 2: waited, 3: waited})
    assert hung.startswith("rank 1 hung; rank 0 raised")
    killed = crash_cause([None, None, -9, None], {0}, {1: lost})
    assert killed == f"rank 2 killed by SIGKILL; rank 3 hung; rank 1 raised {closed}"
    # The peer's port is ephemeral, another in every world: the same trial states one cause.
    other_world = crash_cause([None, None, -9, None], {0}, {1: f"{closed}:44432"})
    assert other_world == killed


def test_a_long_error_is_cut_at_a_word_and_says_so():
    """A peer's gloo message ran past 300 characters and was cut mid-word ("... an error. GL"),
    reading as the whole message."""
    sentence = "the peer closed its connection while reporting an error "
    text = describe(RuntimeError(sentence * 8))
    assert text.endswith(" ...") and len(text) <= len("RuntimeError: ") + CAUSE_CHARACTERS + 4
    kept = text.removeprefix("RuntimeError: ").removesuffix(" ...")
    assert (sentence * 8).startswith(kept + " ")  # whole words only
    assert describe(RuntimeError("short\nsecond line")) == "RuntimeError: short"


def test_a_hung_ranks_cause_names_the_innermost_frames_of_its_main_thread():
    root = Path(stacks.__file__).resolve().parents[2]
    lib = "/venv/lib/python3.11/site-packages/torch/distributed"
    dump = "\n".join(
        [
            "main thread 0x7f00000000aa",
            "Thread 0x00007f00000000bb (most recent call first):",
            '  File "/usr/lib/python3.11/threading.py", line 320 in wait',
            "",
            "Current thread 0x00007f00000000aa (most recent call first):",
            f'  File "{lib}/distributed_c10d.py", line 2169 in _new_process_group_helper',
            f'  File "{lib}/distributed_c10d.py", line 1899 in init_process_group',
            f'  File "{lib}/c10d_logger.py", line 97 in wrapper',
            f'  File "{lib}/c10d_logger.py", line 83 in wrapper',
            f'  File "{root}/harness/launch/world.py", line 96 in _rank_main',
        ]
    )
    frames = stacks.innermost(dump)
    assert frames == (
        "distributed_c10d.py:2169 _new_process_group_helper <- distributed_c10d.py:1899 "
        "init_process_group <- c10d_logger.py:97 wrapper <- ... world.py:96 _rank_main"
    )
    cause = crash_cause([None, None, 1], set(), {}, {0: frames, 1: None})
    assert cause == (
        f"rank 2 exited with code 1; rank 1 hung before reaching the harness (start or imports); "
        f"rank 0 hung in {frames}"
    )
