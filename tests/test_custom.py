"""Bring your own model: workload=custom through the public command."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import BIN, rows
from tests.fixtures_custom import CountedConvNet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = ("campaign.scenarios=[{site:none},{site:grad,model:value,value:nan,ranks:[1],"
             "steps:[3]},{site:activation,model:scale,factor:100,ranks:[2],steps:[5],"
             "tensor:conv1}]")  # fmt: skip


def test_a_custom_conv_net_runs_campaigns_detectors_and_reports_unchanged(tmp_path, run_ok):
    out = tmp_path / "run"
    run_ok("workload=custom", "workload.steps=8", "campaign.seeds=2", "campaign.noise_seeds=2",
           SCENARIOS, "detectors=[nan_inf,replay,allreduce_sketch,weight_consensus,grad_stats]",
           "detectors.weight_consensus.interval=4",  # it looks after steps 3 and 7
           f"out={out}", cwd=tmp_path)  # fmt: skip
    table = rows(out)
    assert [r["workload"] for r in table] == ["custom"] * 6
    clean, nan, activation = table[0:2], table[2:4], table[4:6]
    assert all(r["golden_match"] == "True" and r["alerts"] == "0" for r in clean)
    assert all(r["first_detector"] == "nan_inf" and r["effect"] == "harmful" for r in nan)
    # An activation fault at step 5 (an audit step) that changed rank 2's gradient is named by
    # replay; one that a ReLU or a max-pool swallowed left the weights bit-identical.
    for row in activation:
        if row["effect"] == "masked":
            assert row["golden_match"] == "True" and row["detected"] == "False"
        else:
            assert "replay" in row["detected_by"] and row["suspect_ranks"] == "2"
    assert any(r["effect"] != "masked" for r in activation)
    assert (out / "report.html").exists()


def test_the_command_builds_the_users_model_once(tmp_path, monkeypatch, run_ok):
    """Validation's dry step, the fault checks' names and shapes, the forward trace an activation
    fault is checked against, and campaign.json's count of the products all use one model in
    the command's process (the ranks build their own)."""
    monkeypatch.setattr(CountedConvNet, "built", 0)
    run_ok("workload=custom", "workload.model._target_=tests.fixtures_custom.CountedConvNet",
           "workload.steps=4", "campaign.seeds=1", "campaign.noise_seeds=2",
           "fault.site=activation", "fault.model=scale", "fault.factor=10", "fault.ranks=[1]",
           "fault.steps=[2]", "fault.tensor=conv1", "detectors=[nan_inf]",
           f"out={tmp_path / 'run'}", cwd=tmp_path)  # fmt: skip
    assert CountedConvNet.built == 1
    assert rows(tmp_path / "run")[0]["fired"] == "True"


@pytest.mark.parametrize(
    ("override", "key", "message"),
    [
        ("workload.model._target_=mypackage.NoSuchNet", "workload.model._target_",
         "'mypackage.NoSuchNet' does not import"),
        ("workload.data._target_=tests.fixtures_custom.unseeded_digits", "workload.data",
         "is not deterministic"),
    ],
)  # fmt: skip
def test_custom_targets_are_validated_before_anything_runs(tmp_path, override, key, message):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([str(BIN / "sdc-bench"), "workload=custom", override,
                           f"out={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0] and message in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()
