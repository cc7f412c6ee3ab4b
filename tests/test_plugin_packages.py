"""A detector and a fault model from outside the repository: a package of their own,
pip-installed from a folder, registers them under the `sdc_bench.detectors` and `sdc_bench.faults`
entry points; they run beside the built-in ones in a campaign, each with its settings (the
fault model's own keys among them) validated by its own `Config`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import BIN, events, rows

PACKAGE = Path(__file__).parent / "fixtures" / "detector_package"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """The environment of a shell where the package is installed (into a folder of its own on
    PYTHONPATH, so the test leaves the project's environment as it was)."""
    tmp = tmp_path_factory.mktemp("plugin")
    source, site = tmp / "source", tmp / "site"
    shutil.copytree(PACKAGE, source)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--no-build-isolation", "--no-deps", "--target", str(site), str(source)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return {**os.environ, "PYTHONPATH": str(site)}


def _sdc_bench(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "sdc-bench"), *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


# One campaign for both: the installed fault model's fault among built-in ones, every check
# (the installed one among them) looking at every trial.
SCENARIOS = [
    "{site:none}",
    # NaN in rank 3's local gradient at step 5: its norm is not a number, in that step.
    "{site:grad,model:value,value:nan,ranks:[3],steps:[5]}",
    # The reduction wrong on every receiver: only allreduce_sketch sees it.
    "{site:allreduce,model:scale,factor:1000.0,scope:reduction,ranks:[0],steps:[5]}",
    # The installed fault model, with its own key.
    "{site:grad,model:offset,delta:1e6,ranks:[1],steps:[2]}",
]


@pytest.fixture(scope="module")
def campaign(installed, tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("campaign")
    out = cwd / "run"
    proc = _sdc_bench(installed, cwd, "campaign=smoke", "workload.steps=6",
                      f"campaign.scenarios=[{','.join(SCENARIOS)}]",
                      "detectors=[nan_inf,allreduce_sketch,grad_stats,grad_norm_limit]",
                      f"out={out}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_an_installed_detector_runs_in_a_campaign_beside_the_built_in_ones(campaign):
    table = {(r["site"], r["model"]): r for r in rows(campaign)}
    assert len(table) == 4
    assert all("grad_norm_limit" in r["detectors"].split(";") for r in table.values())
    clean = table["none", "none"]
    assert clean["alerts"] == "0", clean
    nan = table["grad", "value"]
    assert "grad_norm_limit=5" in nan["detect_steps"].split(";"), nan
    assert "nan_inf=5" in nan["detect_steps"].split(";"), nan
    assert nan["suspect_ranks"] == "3", nan
    # The built-in checks are as they are without it.
    assert "allreduce_sketch=5" in table["allreduce", "scale"]["detect_steps"], table
    assert "grad_norm_limit" in (campaign / "report.md").read_text()


def test_an_installed_fault_model_strikes_with_its_own_key(campaign):
    (trial,) = [r for r in rows(campaign) if r["model"] == "offset"]
    assert trial["trial_id"] == "003-grad-offset-delta1e+06-s0", trial
    assert (trial["fired"], trial["injected_ranks"]) == ("True", "1")
    (inject,) = [
        e for e in events(campaign)
        if e["kind"] == "inject" and e["fired"] and e["trial_id"] == trial["trial_id"]
    ]  # fmt: skip
    assert inject["new"] - inject["old"] == pytest.approx(1e6, rel=1e-6)
    assert "grad_stats=2" in trial["detect_steps"].split(";"), trial


def test_an_installed_detectors_settings_are_validated_by_its_own_config(installed, tmp_path):
    proc = _sdc_bench(installed, tmp_path, "campaign=smoke", "detectors=[nan_inf,grad_norm_limit]",
                      "detectors.grad_norm_limit.limit=-1", f"out={tmp_path / 'run'}")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == "sdc-bench: error: detectors.grad_norm_limit.limit: '-1' must be a number > 0"
    assert not (tmp_path / "run").exists()


def test_without_the_package_the_name_is_refused_with_the_choices(tmp_path):
    proc = _sdc_bench(dict(os.environ), tmp_path, "detectors=[nan_inf,grad_norm_limit]")
    assert proc.returncode == 2
    assert "detectors: 'grad_norm_limit' is not allowed; allowed: allreduce_sketch" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fault.model=offset", "fault.delta=0"],
         "fault.delta: 0 changes nothing: the fault could never strike"),
        (["fault.model=scale", "fault.factor=2", "fault.delta=3"],
         "fault.delta: unknown key; allowed: site, model, bit,"),
    ],
)  # fmt: skip
def test_a_fault_models_own_key_is_validated_by_its_config(installed, tmp_path, args, message):
    out = tmp_path / "run"
    proc = _sdc_bench(installed, tmp_path, "fault.site=grad", *args, f"out={out}")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"sdc-bench: error: {message}"), line
    assert not out.exists()
