"""Helpers shared by the tests: run the real commands and read what they wrote."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness.cli import CONFIG_DIR
from harness.config.load import run_config
from harness.config.schema import RunConfig

BIN = Path(sys.executable).parent
# Columns that measure wall time: the only ones allowed to differ between identical runs.
TIMING = {"step_time_s", "ttd_seconds"}
# Small but real: 4 simulated nodes, 12 steps.
FAST = ["workload.steps=12", "campaign.noise_seeds=2"]


def sdc_bench(
    *args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "sdc-bench"), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rows(out: Path) -> list[dict[str, str]]:
    with open(out / "trials.csv", newline="") as f:
        return list(csv.DictReader(f))


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def without_timing(table: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in table]


@pytest.fixture
def run_ok():
    """Run sdc-bench and fail with its output when it does not exit 0."""

    def run(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
        proc = sdc_bench(*args, cwd=cwd, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    return run


def compose_run(*overrides: str) -> RunConfig:
    """The validated RunConfig that `sdc-bench OVERRIDES` would run, via Hydra's compose API."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return run_config(OmegaConf.to_container(cfg, resolve=True))
