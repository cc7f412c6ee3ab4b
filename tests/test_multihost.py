"""A multi-host rehearsal on one machine: 3 hosts made of network namespaces (tests/namespaces.py),
one torchrun agent per host, c10d rendezvous on the first host's address, and no
GLOO_SOCKET_IFNAME: gloo finds each host's interface from its name, as on a real cluster.

The campaign is 6 of aws_reference_3node's scenarios on 3 hosts x 2 ranks, at one seed (and the
golden runs of the two reference seeds), cut to 13 steps: the faults strike at steps 10 and 12,
and the last at step 1, so that its trial trains 12 of them: a fast-forwarded trial of one or
three steps ends within a poll of the rows, and the cut could find the campaign done.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests import namespaces
from tests.conftest import BIN, rows, run_here, without_timing

# aws_reference_3node's detectors and world, with 6 of its 33 scenarios: a fault caught on each
# host's ranks (grad on rank 1, weight on rank 2), harmful and benign ones, both reduction scopes
# (the x1000 scalings of rank 1's gradient and rank 2's weights, on the same sites and ranks as
# the NaNs kept, are left out).
SCENARIOS = (
    "{site:none}",
    "{site:grad,model:scale,ranks:[1],factor:10.0,steps:[12]}",
    "{site:grad,model:value,ranks:[1],value:nan,steps:[12]}",
    "{site:weight,model:value,ranks:[2],value:nan,steps:[10]}",
    "{site:allreduce,model:scale,scope:reduction,ranks:[0],factor:1000.0,steps:[10]}",
    "{site:allreduce,model:value,scope:rank,ranks:[0],value:nan,steps:[1]}",
)
PLAN = [
    "campaign=aws_reference_3node",
    f"campaign.scenarios=[{','.join(SCENARIOS)}]",
    "topology.ranks_per_node=2",
    "workload.steps=13",
    "campaign.seeds=1",
    "campaign.noise_seeds=2",
    # A lost host is noticed within this; a step here takes well under a second.
    "topology.collective_timeout_s=10",
]
PORT = 29400  # inside the test's own namespaces: no one else listens there


@pytest.fixture(scope="module")
def hosts():
    reason = namespaces.unavailable()
    if reason:
        pytest.skip(reason)
    made = namespaces.Hosts(3)
    try:
        yield made
    finally:
        made.remove()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> list[dict[str, str]]:
    """The same plan in the spawned 3 x 2 simulation, on loopback (in this process: the
    reference rows, not the command, are what the torchrun runs are held to)."""
    cwd = tmp_path_factory.mktemp("spawned")
    run_here(*PLAN, f"out={cwd / 'out'}", cwd=cwd)
    return without_timing(rows(cwd / "out"))


def planned(cwd: Path, args: list[str], hosts: namespaces.Hosts) -> tuple[list[str], dict]:
    """Write the plan; return the command it prints, with the first host as the rendezvous,
    and the environment it runs in (the printed pins, and no GLOO_SOCKET_IFNAME). Planned in
    this process: what it prints is under test, not the command that prints it."""
    proc = run_here(*args, "launcher=torchrun", f"out={cwd / 'out'}", cwd=cwd)
    words = proc.stdout.strip().splitlines()[-1].split()
    pins = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    endpoint = f"{hosts.hosts[0].address}:{PORT}"
    command = [w.replace("HOST:PORT", endpoint) for w in words[len(pins) :]]
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    return command, dict(env, PATH=f"{BIN}:{env['PATH']}", **pins)


def start_agents(hosts, command, env, cwd: Path, attempt: str, before=None) -> list:
    before = before or {}
    return [
        hosts.start(
            host,
            command,
            cwd / f"{attempt}-{host.name}.log",
            before.get(host.name, ""),
            env=env,
            cwd=cwd,
        )  # fmt: skip
        for host in hosts.hosts
    ]


def finish(agents, cwd: Path, attempt: str, timeout: float) -> list[int]:
    codes = []
    for agent in agents:
        try:
            codes.append(agent.wait(timeout))
        except subprocess.TimeoutExpired:
            logs = "\n".join(p.read_text()[-2000:] for p in cwd.glob(f"{attempt}-*.log"))
            raise AssertionError(f"an agent did not finish within {timeout} s:\n{logs}") from None
    return codes


def log(cwd: Path, attempt: str, host: namespaces.Host) -> str:
    return (cwd / f"{attempt}-{host.name}.log").read_text()


def test_torchrun_across_three_hosts_writes_the_spawned_rows(tmp_path, hosts, spawned):
    """One campaign, one torchrun agent per host: every row is the spawned simulation's, and
    the faults on rank 1 (grad) and rank 2 (weight) are caught on their hosts' ranks."""
    command, env = planned(tmp_path, PLAN, hosts)
    assert "--nnodes=3" in command and "--rdzv-backend=c10d" in command
    assert "GLOO_SOCKET_IFNAME" not in env
    codes = finish(start_agents(hosts, command, env, tmp_path, "whole"), tmp_path, "whole", 240)
    assert codes == [0, 0, 0], log(tmp_path, "whole", hosts.hosts[0])[-3000:]
    table = without_timing(rows(tmp_path / "out"))
    assert table == spawned
    assert {r["effect"] for r in table} >= {"harmful", "benign"}
    assert any(r["detected"] == "True" and r["suspect_ranks"] == "2" for r in table)


# The slow set (45 s): the default run keeps the three hosts' rows above; torchrun's crash rows
# and its rerun's resume are in tests/test_world.py's slow set too.
@pytest.mark.slow
def test_torchrun_across_three_hosts_writes_the_spawned_rows_and_resumes_after_a_host_cut(
    tmp_path, hosts, spawned
):
    """One campaign: cut the third host's link mid-campaign, then rerun. Every row torchrun
    wrote, before the cut and after it, is the spawned simulation's; the trial in flight at the
    cut is a crash row naming the lost host's ranks."""
    command, env = planned(tmp_path, PLAN, hosts)
    assert "--nnodes=3" in command and "--rdzv-backend=c10d" in command
    assert "GLOO_SOCKET_IFNAME" not in env
    first, second, third = hosts.hosts
    out = tmp_path / "out"
    agents = start_agents(hosts, command, env, tmp_path, "cut")
    try:
        deadline = time.monotonic() + 200
        # Golden runs done and the faults on rank 1 (grad) and rank 2 (weight) recorded: the cut
        # strikes one of the last two trials.
        while not (out / "trials.csv").exists() or len(rows(out)) < 4:
            assert time.monotonic() < deadline, log(tmp_path, "cut", first)[-3000:]
            assert all(a.poll() is None for a in agents), log(tmp_path, "cut", first)[-3000:]
            time.sleep(0.2)
        hosts.cut(third)
        codes = finish(agents[:2], tmp_path, "cut", 90)
    finally:
        hosts.kill_all()  # the cut host's agent cannot reach the rendezvous to leave it
        hosts.mend(third)
    assert codes[0] == 1
    assert "torchrun's world was lost in" in log(tmp_path, "cut", first)
    cut = rows(out)
    crashed = [r for r in cut if r["effect"] == "crash"]
    assert len(crashed) == 1 and crashed[0] is cut[-1], [(r["trial_id"], r["effect"]) for r in cut]
    cause = crashed[0]["crash_cause"]
    assert f"ranks 4, 5 on {third.name} sent no report" in cause, cause
    assert f"{crashed[0]['trial_id']} crashed: {cause}" in (out / "crashes.log").read_text()

    agents = start_agents(hosts, command, env, tmp_path, "resume")
    codes = finish(agents, tmp_path, "resume", 240)
    assert codes == [0, 0, 0], log(tmp_path, "resume", first)[-3000:]
    resumed = without_timing(rows(out))
    assert [r["trial_id"] for r in resumed] == [r["trial_id"] for r in spawned]
    assert without_timing(cut) == resumed[: len(cut)]
    crash_id = crashed[0]["trial_id"]
    table = [r for r in resumed if r["trial_id"] != crash_id]
    assert table == [r for r in spawned if r["trial_id"] != crash_id]
    # The faults on rank 1 (grad) and rank 2 (weight) were caught on their hosts' ranks.
    assert {r["effect"] for r in table} >= {"harmful", "benign"}
    assert any(r["detected"] == "True" and r["suspect_ranks"] == "2" for r in table)


def test_a_store_that_not_every_host_sees_is_refused_before_any_trial(tmp_path, hosts):
    args = [
        *("fault=grad_nan", "fault.ranks=[1]", "fault.steps=[2]", "workload.steps=4"),
        *("campaign.noise_seeds=2", "topology.nodes=3", "topology.ranks_per_node=1"),
    ]
    command, env = planned(tmp_path, args, hosts)
    store = tmp_path / "out" / "store"
    store.mkdir()
    # The third host mounts a folder of its own over the store.
    own = {hosts.hosts[2].name: f"mount -t tmpfs sdc-own {store} &&"}
    agents = start_agents(hosts, command, env, tmp_path, "unshared", own)
    codes = finish(agents, tmp_path, "unshared", 120)
    assert all(code != 0 for code in codes)
    first, second, third = (h.name for h in hosts.hosts)
    errors = [
        line
        for line in log(tmp_path, "unshared", hosts.hosts[0]).splitlines()
        if "harness.torchrun_worker: error:" in line
    ]
    assert errors == [
        f"harness.torchrun_worker: error: out: {store} is not one folder on every host "
        f"({first} does not see {third}; {second} does not see {third}; {third} does not see "
        f"{first}, {second}); put out on a file system every host mounts"
    ]
    assert not (tmp_path / "out" / "campaign.json").exists()
    assert not any(store.iterdir())
