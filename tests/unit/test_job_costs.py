"""What the guard writes of a job's costs (harness/results/costs.py): the world's figures from
each rank's, percentages against the step without the guard, and the file sdc-plan reads."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from harness.results.costs import CheckCost, JobCosts, combined, priced


def rank_costs(step: float, nan_inf: float, replay: float, hook: float) -> JobCosts:
    return JobCosts(
        step_time_s=step, steps=10, warmup=3, device="cpu", parallel="fsdp", world_size=2,
        checks={"nan_inf": CheckCost(nan_inf, math.nan), "replay": CheckCost(replay, math.nan, 5)},
        hook=CheckCost(hook, math.nan),
    )  # fmt: skip


def test_each_part_is_priced_against_the_step_without_the_guards_work():
    costs = priced(rank_costs(step=1.0, nan_inf=0.1, replay=0.2, hook=0.2))
    # Without the guard the step is 1.0 - 0.5 = 0.5 s.
    assert costs.checks["nan_inf"].overhead_pct == pytest.approx(20.0)
    assert costs.checks["replay"].overhead_pct == pytest.approx(40.0)
    assert costs.hook.overhead_pct == pytest.approx(40.0)
    assert costs.checks["replay"].interval == 5


def test_the_world_takes_each_parts_mean_so_the_parts_never_exceed_the_step():
    """One rank spent its step in replay waiting on the other, which spent it in nan_inf: the
    largest of each would add up to more than any rank's step; the means do not."""
    world = combined([rank_costs(1.0, 0.7, 0.1, 0.1), rank_costs(1.0, 0.1, 0.7, 0.1)])
    assert world.checks["nan_inf"].seconds_per_step == pytest.approx(0.4)
    assert world.checks["replay"].seconds_per_step == pytest.approx(0.4)
    assert world.spent < world.step_time_s
    assert all(math.isfinite(c.overhead_pct) for c in world.checks.values())


def test_the_file_reads_back_what_was_written_and_a_bad_one_is_named(tmp_path):
    costs = priced(rank_costs(step=1.0, nan_inf=0.1, replay=0.2, hook=0.2))
    costs.write(tmp_path / "costs.json")
    assert JobCosts.read(tmp_path / "costs.json") == costs
    irregular = CheckCost(0.05, math.nan, interval=2, looks=3)  # consensus, checkpoints between
    with_looks = priced(replace(costs, checks={**costs.checks, "weight_consensus": irregular}))
    with_looks.write(tmp_path / "looks.json")
    assert JobCosts.read(tmp_path / "looks.json").checks["weight_consensus"].looks == 3
    assert combined([with_looks, with_looks]).checks["weight_consensus"].looks == 3
    (tmp_path / "bad.json").write_text('{"checks": {}}')
    with pytest.raises(ValueError, match="bad.json: not a costs file from guard.write_costs"):
        JobCosts.read(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="missing.json: cannot read it"):
        JobCosts.read(tmp_path / "missing.json")
    replace(costs, hook=CheckCost(0.2, math.nan)).write(tmp_path / "unpriced.json")
    with pytest.raises(ValueError, match="unpriced.json: .*not a number"):
        JobCosts.read(tmp_path / "unpriced.json")


@pytest.mark.parametrize(
    ("edit", "refusal"),
    [
        ({"checks": {"nan_inf": {"overhead_pct": -50}}}, "checks.nan_inf.overhead_pct: -50"),
        ({"hook": {"overhead_pct": -1}}, "hook.overhead_pct: -1"),
        (
            {"checks": {"replay": {"seconds_per_step": -0.1}}},
            "checks.replay.seconds_per_step: -0.1",
        ),
        ({"checks": {"replay": {"looks": -3}}}, "checks.replay.looks: -3"),
        ({"checks": {"replay": {"looks": 100}}}, "checks.replay.looks: 100, .* 10 steps"),
        ({"checks": {"replay": {"interval": 0}}}, "checks.replay.interval: 0"),
        ({"world_size": 0}, "world_size: 0"),
        ({"steps": 0}, "steps: 0"),
        ({"steps": 17.9}, "steps: 17.9"),
        ({"warmup": -1}, "warmup: -1"),
        ({"step_time_s": 0}, "step_time_s: 0"),
        ({"step_time_s": -0.05}, "step_time_s: -0.05"),
    ],
)
def test_a_figure_no_guard_writes_is_refused_naming_its_key(tmp_path, edit, refusal):
    """A costs file edited by hand, or damaged: sdc-plan planned on a negative overhead (a check
    recommended at -45% of the step), on more looks than steps measured, or on a fraction of a
    step (17.9 read as 17), and exited 0."""
    path = tmp_path / "costs.json"
    priced(rank_costs(step=1.0, nan_inf=0.1, replay=0.2, hook=0.2)).write(path)
    data = json.loads(path.read_text())
    for key, value in edit.items():
        if isinstance(value, dict):
            for name, fields in value.items():
                target = data[key][name] if key == "checks" else data[key]
                target.update(fields if key == "checks" else {name: fields})
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"costs.json: {refusal}"):
        JobCosts.read(path)
