"""`sdc-plan --gpu --params --tokens-per-step`: each check's cost estimated from the formula its
docstring states (harness/analysis/estimates.py). The docstrings are the source: this file reads
the formulas from them and recomputes the plan's printed figures with its own rates, so neither
a formula nor the arithmetic can change on one side alone."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import detectors
from harness.analysis import plan_report
from harness.analysis.estimates import FORMULAS, docstring_line

SWEEP = Path(__file__).resolve().parents[1] / "fixtures" / "sweep"
# The job of the example, on an H100 SXM: 3.35 TB/s, 989 TFLOP/s dense BF16.
N, T, REPLICAS, MFU = 70e9, 4e6, 128, 0.4
BANDWIDTH, PEAK, HOST = 3.35e12, 989e12, 1e9


def stated(name: str) -> dict[str, str]:
    """The terms of the check's docstring line `Cost per step (sdc-plan): term = expr, ...`."""
    doc = " ".join(importlib.import_module(f"detectors.{name}").__doc__.split())
    line = re.search(r"Cost per step \(sdc-plan\): (.*?): ", doc)
    assert line, f"{name}'s docstring states no cost"
    return dict(term.split(" = ") for term in line.group(1).split(", "))


def recomputed(name: str, k: int = 1) -> float:
    """The check's overhead in percent of a step, from its docstring alone."""
    t = T / REPLICAS
    d = (128 * N / 12) ** (1 / 3)
    symbols = {"N": N, "t": t, "d": d, "k": k, "B": 4, "A": 2, "m": 1, "r": 1}
    rate = {"bytes": BANDWIDTH, "flops": PEAK, "host": HOST, "train": PEAK * MFU}
    seconds = sum(eval(e, {}, symbols) / rate[term] for term, e in stated(name).items())
    return 100 * seconds / (6 * N * t / (PEAK * MFU))


def test_every_shipped_check_has_a_formula():
    """The ten checks this repository ships (a check dropped in later is refused by name by
    `--gpu` until it states one; test_a_check_without_a_formula_is_refused_by_name)."""
    assert set(FORMULAS) <= set(detectors.built_in()) and len(FORMULAS) == 10


@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_every_check_states_the_formula_the_plan_uses(name):
    assert stated(name) == FORMULAS[name]
    assert docstring_line(name) in " ".join(
        importlib.import_module(f"detectors.{name}").__doc__.split()
    )


def test_the_plan_prints_the_docstrings_figures_and_says_they_are_estimated(tmp_path, capsys):
    plan_report.main([str(SWEEP), "--out", str(tmp_path), "--gpu", "h100", "--params", "70e9",
                      "--tokens-per-step", "4e6"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "overheads **estimated**, not measured" in printed and "H100 SXM" in printed
    listed = re.search(r"at an interval of 1: (.*?); the harness's hook", printed).group(1)
    figures = {n: float(p.rstrip("%")) for n, p in (e.split(" ") for e in listed.split(", "))}
    assert figures
    for name, pct in figures.items():
        want = recomputed(name)
        assert pct == pytest.approx(want, rel=5e-3, abs=1e-9), name
    # By hand: nan_inf reads 8 bytes per parameter against 6 t FLOPs per parameter at 40% of
    # the peak: 8 x 989e12 x 0.4 / (6 x 31,250 x 3.35e12) = 0.504%.
    assert figures["nan_inf"] == pytest.approx(0.504, abs=5e-4)
    # The step itself: 6 N T over 16,384 GPUs at 40% of the peak.
    step = 6 * N * T / (16384 * PEAK * MFU)
    assert f"`--step-seconds {step:g}`" in printed
    # A periodic check at the interval the trials ran it: its per-step cost over k.
    assert recomputed("replay", 5) == pytest.approx(recomputed("replay") / 5)


def test_a_check_without_a_formula_is_refused_by_name(tmp_path, capsys):
    text = (SWEEP / "0" / "trials.csv").read_text()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trials.csv").write_text(text.replace("nan_inf", "sdc_mine"))
    with pytest.raises(SystemExit) as stop:
        plan_report.main([str(tmp_path / "run"), "--gpu", "b200", "--params", "8e9",
                          "--tokens-per-step", "1e6"])  # fmt: skip
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no cost formula for 'sdc_mine'" in err and "--costs" in err
