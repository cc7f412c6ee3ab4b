"""scripts/slurm_torchrun.sbatch under stand-ins for Slurm's scontrol and srun: the line it hands
srun starts one torchrun agent per node, the plan's command with c10d rendezvous on the
allocation's first node (tests/test_multihost.py runs such agents on three hosts)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from harness.runtime import environment
from tests.conftest import BIN, sdc_bench

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "slurm_torchrun.sbatch"


def fake_slurm(folder: Path) -> Path:
    """scontrol lists three nodes; srun writes its arguments to srun.args."""
    folder.mkdir()
    (folder / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a17\\ngpu-a18\\ngpu-b02\\n'\n")
    (folder / "srun").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {folder}/srun.args\n')
    for name in ("scontrol", "srun"):
        (folder / name).chmod(0o755)
    return folder


def sbatch(
    tmp_path: Path, out: Path | None, nodes: int | str, **variables: str
) -> subprocess.CompletedProcess:
    """The script as Slurm runs it, `variables` set over (or, where empty, unset from) its
    environment."""
    fake = tmp_path / "slurm"
    env = dict(
        os.environ,
        PATH=f"{fake}:{os.environ['PATH']}",
        SLURM_JOB_NUM_NODES=str(nodes),
        SLURM_JOB_NODELIST="gpu-a[17-18],gpu-b02",
        SLURM_JOB_ID="4711",
        SDC_MAX_RESTARTS="2",
        SDC_PYTHON=sys.executable,
    )
    env.update(variables)
    env = {k: v for k, v in env.items() if v}
    return subprocess.run(
        ["bash", str(SCRIPT), *([] if out is None else [str(out)])],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_sbatch_script_starts_one_torchrun_agent_per_node_on_the_first_nodes_rendezvous(
    tmp_path,
):
    fake = fake_slurm(tmp_path / "slurm")
    out = tmp_path / "sdc out"  # a space: the command quotes it (it was split into two words)
    args = ["fault=grad_nan", "topology.nodes=3", "topology.ranks_per_node=2"]
    planned = sdc_bench(*args, "launcher=torchrun", f"out={out}", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr[-2000:]
    done = sbatch(tmp_path, out, 3)
    assert done.returncode == 0, done.stderr[-2000:]
    srun = (fake / "srun.args").read_text().splitlines()
    assert srun[:4] == ["--nodes=3", "--ntasks-per-node=1", "bash", "-c"]
    words = shlex.split(srun[4])
    pins = [f"{k}={v}" for k, v in environment.pins("avx2").items()]
    assert words == [
        "exec", "env", *pins, str(BIN / "torchrun"), "--rdzv-id=4711", "--max-restarts=2",
        "--nnodes=3",
        "--rdzv-backend=c10d", "--rdzv-endpoint=gpu-a17:29500", "--nproc-per-node=2",
        "-m", "harness.torchrun_worker", str(out),
    ]  # fmt: skip

    wrong = sbatch(tmp_path, out, 4)
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == (
        f"slurm_torchrun.sbatch: error: the plan in {out} wants 3 nodes; the job has 4 "
        "(sbatch --nodes=3)"
    )
    # No plan written there: a traceback, before.
    unplanned = sbatch(tmp_path, tmp_path / "no plan", 3)
    assert unplanned.returncode == 2
    assert (
        unplanned.stderr.strip().startswith(
            f"slurm_torchrun.sbatch: error: no usable plan in {tmp_path / 'no plan'} ("
        )
        and len(unplanned.stderr.strip().splitlines()) == 1
    )


def test_bad_input_to_the_sbatch_script_exits_2_with_one_line_before_srun(tmp_path):
    """A port or a restart count torchrun cannot take went into the srun line (exit 0), to
    fail on every node; a missing variable or OUT ended with bash's own message, exit 1, and
    an empty node count with Python's traceback."""
    fake = fake_slurm(tmp_path / "slurm")
    out = tmp_path / "out"
    for variables, line in [
        ({"SDC_RDZV_PORT": "abc"}, "SDC_RDZV_PORT: 'abc' is not allowed; allowed: a port"),
        ({"SDC_RDZV_PORT": "70000"}, "SDC_RDZV_PORT: '70000' is not allowed"),
        ({"SDC_MAX_RESTARTS": "-3"}, "SDC_MAX_RESTARTS: '-3' is not allowed; allowed: a whole"),
        ({"SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST is not set: run it with sbatch"),
        ({"SLURM_JOB_NUM_NODES": "x"}, "SLURM_JOB_NUM_NODES: 'x' is not allowed"),
    ]:
        done = sbatch(tmp_path, out, 3, **variables)
        assert done.returncode == 2, (variables, done.stderr)
        assert done.stderr.startswith(f"slurm_torchrun.sbatch: error: {line}"), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    usage = sbatch(tmp_path, None, 3)
    assert (usage.returncode, usage.stderr.strip()) == (
        2, "slurm_torchrun.sbatch: error: usage: sbatch --nodes=N scripts/slurm_torchrun.sbatch OUT"
    )  # fmt: skip
    assert not (fake / "srun.args").exists()
