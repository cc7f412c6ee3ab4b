"""Helpers shared by the tests: run the real commands and read what they wrote."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness import cli
from harness.cli import CONFIG_DIR
from harness.config.load import run_config
from harness.config.schema import RunConfig
from harness.launch import rank_server

BIN = Path(sys.executable).parent


def pytest_configure(config: pytest.Config) -> None:
    """Every test process computes on one thread, as each rank does (`topology.threads_per_rank`):
    the other worker's rank processes hold the cores, and torch's OpenMP threads spinning
    against them made an in-process test 2.5x slower than on one thread.

    One golden store for the whole test run, never the repository's results/cache nor the
    user's own: the main process makes it before xdist starts its workers, which inherit it,
    and every sdc-bench a test starts inherits it in turn. Reuse is exact (rows identical, by
    tests/test_golden_store.py), so tests that share a golden compute it once."""
    torch.set_num_threads(1)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    config.golden_store = tempfile.mkdtemp(prefix="sdc-bench-goldens-")
    os.environ["SDC_BENCH_CACHE"] = config.golden_store


# The test files that take longest, longest first (seconds in one run on 2 cores under three
# workers, 2026-12-07: 141, 93, 92, 88, 70, 67, 58, 51, 48, 44, 43, 37, 36, 34, 34, 31, 30, 28,
# 28, 26, 25, 23, 22, 21, 17, then 16 to 11). scripts/test.sh hands out files in this order
# (--dist=loadfile --no-loadscope-reorder) and a worker takes the next file when it runs low, so
# the long files start first and the many short ones even out the end, instead of a long file
# starting last while the other worker idles.
LONGEST_FIRST = (
    "test_robustness.py",
    "test_parallel.py",
    "test_multihost.py",
    "test_campaigns.py",
    "test_recovery.py",
    "test_config_errors.py",
    "test_matmul_checksum.py",
    "test_injectors.py",
    "test_guarded_example.py",
    "test_benchmarks_quick.py",
    "test_plugin_packages.py",
    "test_hf_trainer.py",
    "test_lightning.py",
    "test_recipes.py",
    "test_sweep.py",
    "test_detectors.py",
    "test_replica_groups.py",
    "test_sharding.py",
    "test_verdicts.py",
    "test_golden_store.py",
    "test_user_models.py",
    "test_custom.py",
    "test_guard_loops.py",
    "test_environment.py",
    "test_defective_unit.py",
    "test_guard.py",
    "test_config.py",
    "test_slurm_script.py",
    "test_campaign.py",
    "test_rank_server.py",
    "test_devices.py",
    "test_regress.py",
    "test_overhead.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config, "golden_store", None):
        shutil.rmtree(config.golden_store, ignore_errors=True)


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


FORKED_RANKS = Path(__file__).parent / "loops" / "forked_ranks.py"


def example_refusal(script: Path, monkeypatch, *args: str) -> int:
    """An example's `main()` run in this process with `args` (and an unused --out), before any
    process group: the code it exits with. In a folder of its own: an example that does not
    refuse trains and writes there, not into the working tree."""
    example = runpy.run_path(str(script), run_name="example")
    monkeypatch.chdir(tempfile.mkdtemp(prefix="sdc-refusal-"))
    monkeypatch.setattr(sys, "argv", [str(script), "--out", "unused", *args])
    with pytest.raises(SystemExit) as exited:
        example["main"]()
    return exited.value.code


def example_ranks(
    script: Path, nproc: int, *args: str, env: dict[str, str] | None = None
) -> tuple[list[int], subprocess.CompletedProcess]:
    """An example's ranks as torchrun starts them, forked from one parent that imported it once
    (tests/loops/forked_ranks.py): every rank's exit code in rank order, and the parent's run."""
    proc = subprocess.run(
        [sys.executable, str(FORKED_RANKS), str(nproc), str(script), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), proc


def rows(out: Path) -> list[dict[str, str]]:
    with open(out / "trials.csv", newline="") as f:
        return list(csv.DictReader(f))


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def without_timing(table: list[dict[str, str]]) -> list[dict[str, str]]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in table]


def forked_ranks(folder: Path) -> BaseContext:
    """A multiprocessing context for a test's own ranks: they fork from the rank server that a
    campaign's ranks come from (harness/launch/rank_server.py), torch already imported, under the
    default CPU kernel pin. A spawned rank imports torch afresh, 3 s of CPU on 2 cores each."""
    return rank_server.context(compose_run().topology.cpu_kernels, folder)


def one_forked_rank(folder: Path, target: Callable[..., None], *args: Any) -> Any:
    """What `target(port, *args, results)` puts on `results`, run as one rank forked
    (`forked_ranks`), with a free loopback port for its process group's rendezvous."""
    ctx = forked_ranks(folder)
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = ctx.Process(target=target, args=(port, *args, results))
    proc.start()
    found = results.get(timeout=120)
    proc.join(timeout=30)
    return found


def run_here(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run sdc-bench's own entry point in this process, in `cwd`, its output captured, and fail
    with that output when it does not exit 0. The worker's imports and rank server serve every
    run: about 4 s less per campaign than the installed command, which `sdc_bench` runs where the
    command itself is under test (exit codes, its environment, signals, resource limits)."""
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        patch.setattr(sys, "argv", ["sdc-bench", *args])
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                cli.main()
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    out, err = stdout.getvalue(), stderr.getvalue()
    assert code == 0, out[-3000:] + err[-3000:]
    return subprocess.CompletedProcess(["sdc-bench", *args], code, out, err)


@pytest.fixture
def run_ok():
    """`run_here`, for the tests that take it as a fixture (module-scoped fixtures call it)."""
    return run_here


def compose_run(*overrides: str) -> RunConfig:
    """The validated RunConfig that `sdc-bench OVERRIDES` would run, via Hydra's compose API."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return run_config(OmegaConf.to_container(cfg, resolve=True))
