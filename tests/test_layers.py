"""The dependency rules between harness's layers (pyproject.toml, [tool.importlinter]) hold on the
code as it is, and break, naming the chain, on a copy with one violation planted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("harness", "detectors", "injectors")


def lint(tree: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run(
        [str(LINT), "--no-cache", "--no-logo", str(tree / "pyproject.toml")],
        cwd=tree, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def copy_of_the_code(tmp_path: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_code_keeps_every_rule():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout
    assert "6 kept, 0 broken" in proc.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        # A rank reaching up to the campaign.
        ("harness/runtime/trainer.py", "from harness.campaign import recovery", "layers"),
        # The report importing torch, through a module that imports it.
        ("harness/analysis/figures.py", "from harness.runtime import workloads", "analysis"),
        # A detector that could read the fault plan.
        ("detectors/nan_inf.py", "from injectors import bits", "never import each other"),
        # A check reaching into the rank's runtime instead of the contract in harness.core.
        ("detectors/replay.py", "from harness.runtime import trainer", "between a rank's runtime"),
    ],
)
def test_a_planted_violation_fails_and_names_its_chain(tmp_path, module, line, broken):
    tree = copy_of_the_code(tmp_path)
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}  # planted\n")
    proc = lint(tree)
    assert proc.returncode == 1, proc.stdout
    report = proc.stdout.split("Broken contracts")[1]
    assert broken in report and module.removesuffix(".py").replace("/", ".") in report
