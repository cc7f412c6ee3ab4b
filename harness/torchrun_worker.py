"""Run a campaign plan under torchrun: the campaign loop of harness/campaign/run.py in the world
torchrun starts (harness/launch/torchrun_world.py), with node identity from torchrun's variables.
`sdc-bench launcher=torchrun out=DIR` writes DIR/plan.json and prints the command, for example:

    ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2 \
        torchrun --standalone --nproc-per-node=4 -m harness.torchrun_worker DIR

Rank 0 validates the plan (the code or the machine may have changed since it was written) and
hands the resolved config to the others through torchrun's store; they never validate it. On
several hosts, DIR must be one folder that every host sees (checked before any trial): rank 0
writes the records, and every rank reads the golden runs' snapshots from DIR/store. A crash
ends the run (exit 1) after its row is written; rerunning the same command resumes.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from harness.campaign.run import CampaignError, run_campaign
from harness.config.load import run_config, topology_config
from harness.config.schema import RunConfig, TopologyConfig
from harness.core import logs
from harness.core.plugins import RankInfo
from harness.errors import ConfigError
from harness.launch.torchrun_world import (
    END,
    STOP,
    PlanRefused,
    TorchrunExecutor,
    TorchrunWorld,
    follow,
    rendezvous_store,
    shared_plan,
)
from harness.launch.world import init_rank
from harness.results.folder import RunFolder
from harness.runtime import determinism, devices, environment, numerics

PLAN = "plan.json"


def command(run: RunConfig, out: Path) -> str:
    topo = run.topology
    trust = " --trust-plan" if run.workload.name == "custom" else ""
    rendezvous = (
        "--standalone"
        if topo.nodes == 1
        else f"--nnodes={topo.nodes} --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT"
    )
    # torch reads its kernel pin when it loads, before the worker runs: the command carries it.
    pins = "".join(f"{k}={v} " for k, v in environment.pins(topo.cpu_kernels).items())
    return (
        f"{pins}torchrun {rendezvous} --nproc-per-node={topo.ranks_per_node} "
        f"-m harness.torchrun_worker {shlex.quote(str(out))}{trust}"
    )


def write_plan(raw: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / PLAN
    tmp = out / f".{PLAN}.tmp"
    # Key order is meaning: a scenario's grid expands in the order its keys were written.
    tmp.write_text(json.dumps(raw, indent=1))
    tmp.replace(path)
    return path


def rank_info(run: RunConfig) -> RankInfo:
    """This rank's place, from torchrun's variables; they must match the plan's topology."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    topo = run.topology
    if (world, per_node) != (topo.world_size, topo.ranks_per_node):
        raise ConfigError(
            "topology",
            f"torchrun started {world} ranks, {per_node} per node; the plan wants "
            f"{topo.world_size}, {topo.ranks_per_node} per node",
        )
    return RankInfo(rank, world, per_node)


def placed(topology: TopologyConfig) -> TopologyConfig:
    """The plan's topology with its device resolved on this machine (harness/runtime/devices.py)."""
    device = devices.resolve(
        topology.device, topology.backend, topology.ranks_per_node, devices.gpu_count()
    )
    numerics.resolve(topology.cpu_numerics, device)
    if device == "cuda" and topology.deterministic:
        determinism.settings(os.environ, topology.backend)
    return replace(topology, device=device)


def main(argv: list[str] | None = None) -> None:
    logs.configure("harness.torchrun_worker")
    args = argv or sys.argv[1:]
    if not args or args[0].startswith("-") or any(a != "--trust-plan" for a in args[1:]):
        fail(f"arguments: OUT [--trust-plan] are allowed (the command sdc-bench printed); got "
             f"{' '.join(args) or 'none'}", 2)  # fmt: skip
    unset = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE") if v not in os.environ]
    if unset:
        fail(f"{', '.join(unset)} unset: run it under torchrun, as sdc-bench printed it", 2)
    out = Path(args[0])
    rank = int(os.environ["RANK"])
    try:
        raw = json.loads((out / PLAN).read_text())
        if raw["workload"]["name"] == "custom" and "--trust-plan" not in args:
            # Targets are instantiated only from the user's own config, never from a file in a
            # results folder, unless the user says the plan is theirs.
            raise ConfigError("workload", "a custom plan names code to run; add --trust-plan")
        # The plan's own topology says how long rank 0 may take to validate the whole plan.
        store = rendezvous_store(rank, topology_config(dict(raw["topology"])))
        run = shared_plan(store, rank, lambda: run_config(raw))
        info = rank_info(run)
        run = replace(run, topology=placed(run.topology))
        local_rank = int(os.environ.get("LOCAL_RANK", info.rank % info.ranks_per_node))
        info = replace(info, device=init_rank(run.topology, info.rank, local_rank))
    except PlanRefused:
        fail("", 2)  # rank 0 says why
    except (ConfigError, OSError) as exc:
        fail(str(exc), 2)
    folder = RunFolder(out)
    world = TorchrunWorld(run, info.rank, info.world_size, store, folder.store, info.device)
    refused = world.refusal() or world.shared(folder.store)
    if refused:
        fail(refused if info.rank == 0 else "", 2)
    if info.rank != 0:
        _exit(follow(world))
    executor = TorchrunExecutor(world, folder.crash_log)
    try:
        trials = run_campaign(run, out, executor)
    except BaseException as exc:
        executor.end(STOP)  # the other ranks wait for their next task
        if isinstance(exc, ConfigError):
            fail(str(exc), 2)
        if isinstance(exc, CampaignError):
            fail(f"campaign failed: {exc}", 1)
        raise
    executor.end(END)
    world.leave()
    _report(trials, out)


def _report(trials: Path, out: Path) -> None:
    """Rank 0's summary and report. Imported here, not at the top: pandas and matplotlib cost
    every rank that imports them close to half a second, and only rank 0 writes the report."""
    from harness.analysis import report, tables

    df = tables.load_trials([trials.parent])
    print(report.summary(df))
    print(f"trials: {trials}\nreport: {report.write_report(df, out)}")


def fail(message: str, code: int) -> NoReturn:
    if message:
        print(f"harness.torchrun_worker: error: {message}", file=sys.stderr)
    _exit(code)


def _exit(code: int) -> NoReturn:
    """Leave without the interpreter's teardown: a world that failed leaves DDP's threads
    behind, which abort the process if they outlive their group."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
