"""Run a campaign plan under torchrun: the same trainer, with env:// rendezvous and node identity
from torchrun's variables. `sdc-bench launcher=torchrun out=DIR` writes DIR/plan.json and prints
the command, for example:

    ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2 \
        torchrun --standalone --nproc-per-node=4 -m harness.torchrun_worker DIR

torchrun itself is the watchdog here: a rank that dies ends the whole run, and a rerun of the
same command resumes after the last complete trial.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from harness import determinism, devices, environment, report
from harness.campaign import Campaign
from harness.config import ConfigError, RunConfig, TopologyConfig, run_config
from harness.plugins import RankInfo
from harness.trainer import run_trial
from harness.world import Outcome, init_rank, shutdown

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
        f"-m harness.torchrun_worker {out}{trust}"
    )


def write_plan(raw: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / PLAN
    tmp = out / f".{PLAN}.tmp"
    tmp.write_text(json.dumps(raw, indent=1, sort_keys=True))
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
    """The plan's topology with its device resolved on this machine (harness/devices.py)."""
    device = devices.resolve(
        topology.device, topology.backend, topology.ranks_per_node, devices.gpu_count()
    )
    if device == "cuda" and topology.deterministic:
        determinism.settings(os.environ, topology.backend)
    return replace(topology, device=device)


def _run(run: RunConfig, spec, info: RankInfo, out: Path) -> Outcome:
    """Every rank trains the trial; rank 0 gathers the parts."""
    part = run_trial(run, spec, info, out / "store")
    parts = [None] * info.world_size if info.rank == 0 else None
    dist.gather_object(part, parts, dst=0)
    return Outcome(parts=parts)


def main(argv: list[str] | None = None) -> None:
    args = argv or sys.argv[1:]
    out = Path(args[0])
    try:
        raw = json.loads((out / PLAN).read_text())
        if raw["workload"]["name"] == "custom" and "--trust-plan" not in args:
            # Targets are instantiated only from the user's own config, never from a file in a
            # results folder, unless the user says the plan is theirs.
            raise ConfigError("workload", "a custom plan names code to run; add --trust-plan")
        run = run_config(raw)
        info = rank_info(run)
        run = replace(run, topology=placed(run.topology))
        local_rank = int(os.environ.get("LOCAL_RANK", info.rank % info.ranks_per_node))
        info = replace(info, device=init_rank(run.topology, info.rank, local_rank))
    except (ConfigError, OSError) as exc:
        print(f"harness.torchrun_worker: error: {exc}", file=sys.stderr)
        sys.exit(2)
    dist.init_process_group(
        run.topology.backend,
        init_method="env://",
        timeout=timedelta(seconds=run.topology.collective_timeout_s),
    )
    campaign = Campaign(run, out) if info.rank == 0 else None
    count = [len(campaign.pending) if campaign else None]
    dist.broadcast_object_list(count, src=0)
    for i in range(count[0]):
        # Rank 0 prepares each trial once the golden runs before it have saved their snapshots.
        spec = [campaign.prepared(campaign.pending[i]) if campaign else None]
        dist.broadcast_object_list(spec, src=0)
        outcome = _run(run, spec[0], info, out)
        twin = [campaign.observe_twin(campaign.pending[i]) if campaign else None]
        dist.broadcast_object_list(twin, src=0)
        if twin[0] is not None:
            twin = [campaign.prepared(twin[0]) if campaign else None]
            dist.broadcast_object_list(twin, src=0)
            twin_outcome = _run(run, twin[0], info, out)
        if campaign:
            campaign.record(spec[0], outcome, twin_outcome if twin[0] is not None else None)
    if campaign:
        campaign.finish()
        df = report.load_trials([out])
        print(report.summary(df))
        print(f"report: {report.write_report(df, out)}")
    shutdown()


if __name__ == "__main__":
    main()
