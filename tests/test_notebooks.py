"""The notebooks run top to bottom against a small committed sweep folder (tests/fixtures/sweep:
three jobs of a replay interval sweep, 1, 5 and 20 steps, float32 and bfloat16 bit flips, and a
finite reduction fault that no check sees), so that they cannot rot."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "sweep"


def execute(name: str, cwd: Path) -> nbformat.NotebookNode:
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    # A failing cell raises CellExecutionError with the cell and its traceback.
    NotebookClient(notebook, timeout=120, resources={"metadata": {"path": str(cwd)}}).execute()
    return notebook


def outputs(notebook: nbformat.NotebookNode, mime: str) -> list[str]:
    return [
        o["data"][mime]
        for cell in notebook.cells
        for o in cell.get("outputs", [])
        if mime in o.get("data", {})
    ]


@pytest.fixture(autouse=True)
def results_dir(monkeypatch):
    # Relative, and the kernel starts elsewhere: the notebooks take it from the repository root.
    monkeypatch.setenv("SDC_RESULTS", str(FIXTURE.relative_to(ROOT)))


@pytest.mark.parametrize("name", ["overhead_vs_audit_frequency.ipynb", "coverage.ipynb"])
def test_committed_notebooks_have_no_outputs(name):
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    for cell in notebook.cells:
        assert not cell.get("outputs") and cell.get("execution_count") is None


def test_overhead_notebook_plots_every_interval_with_its_floor(tmp_path):
    notebook = execute("overhead_vs_audit_frequency.ipynb", tmp_path)
    assert len(outputs(notebook, "image/png")) == 2  # overhead and catch; the plan
    texts = outputs(notebook, "text/plain")
    table, planned = texts[0], next(t for t in texts if "checks" in t)
    for interval, overhead, floor in (
        ("1", "41.5", "38.0"),
        ("5", "9.1", "7.6"),
        ("20", "2.4", "1.9"),
    ):
        assert f"replay {interval:>9} {overhead:>13} {floor:>10}" in table
    # nan_inf runs every step: no interval, so not on this axis.
    assert "nan_inf" not in table
    # The plan at the default job figures: at the Llama 3 rate, replay's overhead on this tiny
    # model (2-42% of a step) costs more than the faults it would catch.
    assert planned.splitlines()[1].split()[:4] == ["0", "1", "no", "checks"]
    assert "replay" in planned


def test_coverage_notebook_draws_a_heatmap_per_dtype_and_finds_the_blind_spot(tmp_path):
    notebook = execute("coverage.ipynb", tmp_path)
    assert len(outputs(notebook, "image/png")) == 2  # float32 and bfloat16
    blind = outputs(notebook, "text/plain")
    assert any("allreduce" in text and "**yes**" in text for text in blind)


def test_overhead_notebook_keeps_a_sweeps_workloads_apart(tmp_path, monkeypatch):
    """The fixture with its third job relabelled gpt: each workload's catch rates meet its own
    overheads, and each gets its own plan (a plan over both would price one job's checks on
    another's step)."""
    sweep = tmp_path / "sweep"
    shutil.copytree(FIXTURE, sweep)
    trials = sweep / "2" / "trials.csv"
    table = list(csv.DictReader(trials.open(newline="")))
    for row in table:
        row["workload"] = "gpt"
    with trials.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    monkeypatch.setenv("SDC_RESULTS", str(sweep))
    notebook = execute("overhead_vs_audit_frequency.ipynb", tmp_path)
    texts = outputs(notebook, "text/plain")
    shown = texts[0].splitlines()
    assert shown[0].split()[:3] == ["workload", "dtype", "detector"]
    assert any(line.split()[1:4] == ["gpt", "bfloat16", "replay"] for line in shown[1:])
    printed = "".join(o.get("text", "") for c in notebook.cells for o in c.get("outputs", []))
    assert printed.count("gpt: ") == 1 and printed.count("mlp: ") == 1
