"""Sweeps through the public command: `sdc-bench -m` runs one job per folder, and at its end a
merged report of every job sits at the top of the sweep folder (harness/analysis/sweep.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from harness.analysis import report
from harness.analysis import sweep as sweep_report
from tests.conftest import rows, sdc_bench

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


def sweep(*args: str, cwd, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return sdc_bench("-m", *TINY, *args, cwd=cwd, env=env)


@pytest.mark.slow  # the default run's sweep is the one below; this is its error path
def test_a_failed_job_ends_the_sweep_but_not_the_merged_report(tmp_path):
    # Job 1's model raises as it trains: its golden run crashes, the campaign fails (exit 1),
    # which ends the sweep before job 2, which sweep.md names as not started.
    nets = ["tests.fixtures_custom.FrozenNet", "tests.fixtures_custom.BreaksWhileTraining"]
    importable = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = sweep("workload=custom", f"workload.model._target_={nets[0]},{nets[1]},{nets[0]}",
                 cwd=tmp_path, env=importable)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "a bug that shows at the third forward" in proc.stderr
    assert "jobs without trials.csv: 1" in proc.stderr
    assert "jobs not started after the failed one: 1" in proc.stderr
    top = tmp_path / "sweep"
    assert "Runs: sweep/0" in (top / "report.md").read_text()
    assert not (top / "2").exists()
    jobs = (top / "sweep.md").read_text()
    assert "1 trials from 1 of 3 jobs" in jobs
    assert f"| 1 | `workload.model._target_={nets[1]}` | 0 | **no trials.csv** |" in jobs
    assert f"| - | `workload.model._target_={nets[0]}` | 0 | **not started** |" in jobs
    # Another sweep into the same folder is refused before Hydra rewrites its multirun.yaml:
    # job 0's folder holds the first sweep's campaign.
    before = (top / "multirun.yaml").read_bytes()
    again = sweep("workload=custom", f"workload.model._target_={nets[0]}", "workload.lr=0.5,1",
                  cwd=tmp_path, env=importable)  # fmt: skip
    assert again.returncode == 2
    assert "holds a different campaign's trials" in again.stderr and "(sweep job 0:" in again.stderr
    assert (top / "multirun.yaml").read_bytes() == before


def test_a_sweep_writes_a_merged_report_that_sdc_report_rebuilds(tmp_path, monkeypatch):
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
    # Job 1 as an interrupt before its trial left it: sweep.md said "ok", with 0 trials.
    held = (top / "1" / "trials.csv").read_text()
    (top / "1" / "trials.csv").write_text(held.splitlines(keepends=True)[0])
    sweep_report.write_merged_report(top)
    assert (
        "| 1 | `fault.bit=30` | 0 | **incomplete** (0 of 1 planned trials) |"
        in (top / "sweep.md").read_text()
    )
    (top / "1" / "trials.csv").write_text(held)

    # The command's own entry point, in this process (tests/test_robustness.py runs the
    # installed command).
    (top / "report.md").unlink()
    monkeypatch.chdir(tmp_path)
    report.main(["sweep"])
    assert (top / "report.md").read_text() == merged


@pytest.mark.parametrize(
    ("swept", "jobs", "seeds"),
    [
        (["campaign.seeds=1,2"], ("campaign.seeds=1", "campaign.seeds=2"), "seed 0"),
        (
            ["campaign.seeds=2", "campaign.fast_forward=true,false"],
            ("campaign.fast_forward=True", "campaign.fast_forward=False"),
            "seeds 0-1",
        ),
    ],
)
def test_a_sweep_whose_jobs_share_seeds_is_refused_before_any_job_runs(
    swept, jobs, seeds, tmp_path, monkeypatch, capsys
):
    """`-m campaign.seeds=1,2` ran seed 0's trials in both jobs (and so did a swept
    fast_forward, which changes no row): the merged report counted them twice."""
    from harness import cli

    monkeypatch.chdir(tmp_path)
    argv = cli.implied_campaign(["-m", "fault=grad_bitflip", "fault.bit=3", *swept])
    with pytest.raises(SystemExit) as exited:
        cli.preflight(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert (
        err.startswith("sdc-bench: error: sweep: jobs 0 (") and f"run the trials of {seeds} " in err
    )
    assert all(job in err for job in jobs), err
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "results").exists()
