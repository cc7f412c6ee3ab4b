"""Sweeps through the public command: `sdc-bench -m` runs one job per folder, and at its end a
merged report of every job sits at the top of the sweep folder (harness/analysis/sweep.py)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import BIN, rows, sdc_bench

# Two jobs of one tiny trial each (2 nodes, 4 steps): a low mantissa bit and the exponent MSB.
TINY = [
    "fault=grad_bitflip",
    "fault.steps=[2]",
    "workload.steps=4",
    "campaign.seeds=1",
    "campaign.noise_seeds=2",
    "topology.nodes=2",
    "hydra.sweep.dir=sweep",
]


def sweep(*args: str, cwd) -> subprocess.CompletedProcess:
    return sdc_bench("-m", *TINY, *args, cwd=cwd)


@pytest.mark.slow  # the default run's sweep is the one below; this is its error path
def test_a_failed_job_ends_the_sweep_but_not_the_merged_report(tmp_path):
    # Job 1 asks for bit 99 of a float32: sdc-bench exits 2 in that job, which ends the sweep
    # before job 2, which sweep.md names as not started.
    proc = sweep("fault.bit=30,99,0", cwd=tmp_path)
    assert proc.returncode == 2
    assert "fault.bit: 99 is out of range" in proc.stderr
    assert "jobs without trials.csv: 1" in proc.stderr
    assert "jobs not started after the failed one: 1" in proc.stderr
    top = tmp_path / "sweep"
    assert "Runs: sweep/0" in (top / "report.md").read_text()
    assert not (top / "2").exists()
    jobs = (top / "sweep.md").read_text()
    assert "1 trials from 1 of 3 jobs" in jobs
    assert "| 1 | `fault.bit=99` | 0 | **no trials.csv** |" in jobs
    assert "| - | `fault.bit=0` | 0 | **not started** |" in jobs


def test_a_sweep_writes_a_merged_report_that_sdc_report_rebuilds(tmp_path):
    """Through submitit_local (each job its own process; the Slurm launcher's path), so that
    one sweep covers the launcher and the merged report."""
    proc = sweep("hydra/launcher=submitit_local", "fault.bit=0,30", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    top = tmp_path / "sweep"
    assert "Submitit 'local' sweep output dir" in proc.stderr + proc.stdout
    # Each job's output went to submitit's own log, not to this process.
    assert "trials: " not in proc.stdout
    assert len(list((top / ".submitit").rglob("*_log.out"))) == 2
    assert "merged report: sweep/report.md (2 trials from 2 jobs)" in proc.stdout
    merged = (top / "report.md").read_text()
    assert "Runs: sweep/0, sweep/1" in merged and "Trials: 2;" in merged
    assert {r["bit"] for job in ("0", "1") for r in rows(top / job)} == {"0", "30"}
    assert (top / "report.html").exists() and any((top / "figures").glob("*.png"))
    jobs = (top / "sweep.md").read_text()
    assert "| 0 | `fault.bit=0` | 1 | ok |" in jobs and "| 1 | `fault.bit=30` | 1 | ok |" in jobs

    (top / "report.md").unlink()
    rebuilt = subprocess.run(
        [str(BIN / "sdc-report"), "sweep"], cwd=tmp_path, capture_output=True, text=True
    )
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (top / "report.md").read_text() == merged
