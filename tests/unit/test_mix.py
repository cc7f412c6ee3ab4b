"""A weighed fault mix (harness/config/mix.py, harness/analysis/mix.py): the scenario keys, the
shares the report prints, and the plan's weighed counts, on hand-built rows whose figures are
worked out here by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.analysis import mix, plan_report, report
from harness.analysis.plan import Job, PlanError, load, plan
from harness.analysis.tables import wilson
from harness.campaign import overhead
from harness.errors import ConfigError
from harness.results import schema
from tests.conftest import compose_run
from tests.rows import frame, write

ON = "nan_inf;replay"


def fired(n: int, fault_class: str, weight: float, caught: bool, harmful: bool) -> dict:
    return dict(trial_id=f"{fault_class}-{n}", seed=n, fired=True, inject_step=3,
                effect="harmful" if harmful else "benign", detected=caught, detectors=ON,
                detected_by="replay" if caught else "", detect_steps="replay=3" if caught else "",
                first_detector="replay" if caught else "", ttd_steps=0 if caught else "",
                check_intervals="replay=5", fault_class=fault_class, weight=weight,
                persistence="transient", fault_steps=3, factor=n)  # fmt: skip


# Class a (weight 0.9): 2 fired trials, 1 caught, both harmful. Class b (weight 0.1): 2 fired,
# both caught, neither harmful; and one trial of b that never fired, which carries no weight.
ROWS = [
    fired(0, "a", 0.9, caught=True, harmful=True),
    fired(1, "a", 0.9, caught=False, harmful=True),
    fired(2, "b", 0.1, caught=True, harmful=False),
    fired(3, "b", 0.1, caught=True, harmful=False),
    dict(trial_id="b-unfired", fault_class="b", weight=0.1, detectors=ON),
]


def test_shares_weigh_each_class_by_its_weight_not_its_trials():
    df = frame(*ROWS)
    (replay,) = [r for r in mix.shares(df) if r["checks"] == "replay"]
    # Each trial of a stands for 0.45, of b for 0.05: caught (0.45 + 0.1) / 1 = 55%; Kish n =
    # 1 / (2 x 0.45^2 + 2 x 0.05^2) = 2.44; a halved: 0.325/0.55 = 59.1%, doubled 1/1.9 = 52.6%.
    low, high = wilson(0.55 * 1 / 0.41, 1 / 0.41)
    assert replay["expected share caught under the field mix"] == (
        f"55.0% [{low:.1%}, {high:.1%}]")  # fmt: skip
    assert replay["sensitivity (one weight x0.5, x2)"] == "52.6% to 59.1%"
    # Damaging: only a's two trials, one caught: 50% whatever the weights.
    assert replay["expected share of damaging faults caught"].startswith("50.0% [")
    assert replay["sensitivity (damaging)"] == "50.0% to 50.0%"
    classes = {r["fault class"]: r for r in mix.classes(df)}
    assert classes["b"] == {"fault class": "b", "weight (share)": "0.1 (10.0%)",
                            "trials": 3, "fired trials": 2, "damaging": 0}  # fmt: skip


def _run(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir()
    write(folder / "trials.csv", rows)
    measured = [
        {"detector": "replay", "interval": "5", "overhead_pct": 1.0, "floor_pct": 0.0},
        {"detector": "nan_inf", "interval": "", "overhead_pct": 0.5, "floor_pct": 0.0},
    ]
    overhead.write(folder / schema.OVERHEAD_FILE, measured)
    return folder


def test_the_plan_weighs_faults_as_the_report_does_and_equal_weights_counts_each_once(
    tmp_path, capsys
):
    folder = _run(tmp_path / "run", ROWS)
    result = plan(*load([folder]), Job())
    assert result.weighed
    (replay,) = [o for o, _ in result.ranked if o.name == "replay"]
    k, n = replay.caught
    assert k / n == pytest.approx(0.55) and n == pytest.approx(1 / 0.41)
    k, n = replay.escaped  # a's uncaught harmful trial: 0.45 of 1
    assert k / n == pytest.approx(0.45)
    plan_report.main([str(folder), "--out", str(tmp_path), "--equal-weights"])
    printed = capsys.readouterr().out
    assert "Each fired fault counts once." in printed
    assert "| replay | 5 | 1.00% | 3/4 = 75%" in printed


def test_runs_weighed_and_not_are_not_planned_together(tmp_path):
    weighed = _run(tmp_path / "w", ROWS)
    plain = _run(tmp_path / "p", [{**r, "weight": "", "fault_class": ""} for r in ROWS[:2]])
    with pytest.raises(PlanError, match="some runs weigh their faults"):
        plan(*load([weighed, plain]), Job())


SCENARIO = "{site:grad,model:scale,factor:10.0,ranks:[1],steps:[3]"


@pytest.mark.parametrize(
    ("scenarios", "key", "says"),
    [
        ([SCENARIO + ",fault_class:x,weight:1}", SCENARIO + "}"], "[1].weight",
         "weighs its other faults"),
        ([SCENARIO + ",fault_class:x,weight:1}", SCENARIO + ",fault_class:x,weight:2}"],
         "[1].weight", "class 'x' has weight 1"),
        ([SCENARIO + ",weight:1}"], "[0].fault_class", "together"),
        ([SCENARIO + ",fault_class:x,weight:0}"], "[0].weight", "> 0"),
        (["{site:none,fault_class:x,weight:1}"], "[0].weight", "no fault to weigh"),
    ],
)  # fmt: skip
def test_a_mix_that_cannot_weigh_every_fault_is_refused(scenarios, key, says):
    with pytest.raises(ConfigError) as error:
        compose_run(f"campaign.scenarios=[{','.join(scenarios)}]")
    assert error.value.key == f"campaign.scenarios{key}" and says in str(error.value)


def test_the_field_mix_weighs_every_fault_and_its_trials_carry_their_class():
    run = compose_run("campaign=field_mix", "workload=llama", "campaign.seeds=1")
    weights = {t.mix.name: t.mix.weight for t in run.trials if t.mix is not None}
    assert sum(weights.values()) == pytest.approx(1.0, abs=1e-3)
    assert all(t.mix is not None for t in run.trials if not t.fault.clean)
    units = [t for t in run.trials if t.fault.model == "defective_unit"]
    assert units and {t.mix.name for t in units} == {"defective_unit"}


def test_the_report_and_sdc_report_print_the_mix(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    write(folder / "trials.csv", ROWS)
    report.main([str(folder)])
    printed = capsys.readouterr().out
    assert "Under the campaign's fault mix:" in printed and "| replay | 55.0% [" in printed
    text = (folder / "report.md").read_text()
    section = text.split("## Under the field mix")[1].split("\n## ")[0]
    assert "| b | 0.1 (10.0%) | 3 | 2 | 0 |" in section and "| replay | 55.0% [" in section


def test_a_class_counts_its_weight_over_the_trials_a_check_set_ran_in():
    """Two more trials of class a ran without replay: replay's share is still 55%, its weight
    spread over the two trials of a that it ran in, not thinned by the two it did not."""
    others = [{**fired(n, "a", 0.9, caught=False, harmful=True), "detectors": "nan_inf"}
              for n in (4, 5)]  # fmt: skip
    (replay,) = [r for r in mix.shares(frame(*ROWS, *others)) if r["checks"] == "replay"]
    assert replay["expected share caught under the field mix"].startswith("55.0% [")
    assert replay["mix covered"] == "100.0%"


def test_a_class_that_never_fired_is_named_as_uncovered(tmp_path, capsys):
    never = dict(trial_id="c-0", fault_class="c", weight=9.0, detectors=ON)
    (replay,) = [r for r in mix.shares(frame(*ROWS, never)) if r["checks"] == "replay"]
    assert replay["mix covered"] == "10.0%"
    folder = _run(tmp_path / "run", [*ROWS, never])
    plan_report.main([str(folder), "--out", str(tmp_path)])
    assert (
        "Classes with no fired trial, 90.0% of the mix's weight, count" in capsys.readouterr().out
    )


def test_runs_of_different_mixes_are_not_weighed_together(tmp_path):
    other = [{**r, "weight": 0.5} if r.get("fault_class") == "a" else r for r in ROWS]
    df = frame(*ROWS, *[{**r, "trial_id": r["trial_id"] + "-2"} for r in other])
    section = report.mix_section(df)
    assert "more than one weight: a (0.5, 0.9)" in section and "| replay |" not in section
    with pytest.raises(PlanError, match="more than one weight: a"):
        plan(*load([_run(tmp_path / "one", ROWS), _run(tmp_path / "two", other)]), Job())
