"""The planner (harness/analysis/plan.py, `sdc-plan`) on small tables written here: no world is
spawned.

Most cases use a job whose arithmetic is done by hand: 1 GPU, one-hour steps, a checkpoint every
2 steps (after each odd step), a one-hour restart, one SDC event a day and 20 hours for a
harmful fault no check caught:

    loss = 24 x overhead + P(caught) x (steps trained again + 1) + P(harmful, not caught) x 20

A fault that a check of each step's values (or replay every step) catches in its step is trained
again from the newest checkpoint before the two steps it puts in doubt (harness/analysis/
rollbacks.py): 3 steps back after an even step, 4 after an odd one, 3.5 on average.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest

import detectors
from harness.analysis import plan_report, report, tables
from harness.analysis.estimates import JobShape
from harness.analysis.plan import (
    LLAMA3_RATE,
    Job,
    Overheads,
    amortized,
    estimated_overheads,
    job_overheads,
    load,
    over_dtypes,
    overheads,
    plan,
)
from harness.campaign import overhead
from harness.guard import selection
from harness.results import schema
from harness.results.costs import CheckCost, JobCosts, priced
from tests.conftest import compose_run
from tests.rows import frame
from tests.rows import write as write_cells

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "sweep"
HAND = Job(
    gpus=1,
    step_seconds=3600,
    checkpoint_every=2,
    restart_minutes=60,
    sdc_rate=1 / 24,
    escape_hours=20,
)
IN_STEP = 3.5 + 1  # a value check's catch in its step: the steps trained again and the restart


def trial(step: int, seed: int, harmful: bool, on: str, every: str = "", found: str = "") -> dict:
    """A fired transient gradient fault at `step`; `found` is `check=step;...` (detect_steps)."""
    row: dict = {}
    caught = ";".join(sorted(p.split("=")[0] for p in found.split(";") if p))
    row.update(
        trial_id=f"t{step}-s{seed}-{every}",
        seed=seed,
        workload="mlp",
        dtype="float32",
        nodes=4,
        ranks_per_node=1,
        site="grad",
        model="scale",
        factor=1000.0,
        persistence="transient",
        fired=True,
        inject_step=step,
        effect="harmful" if harmful else "benign",
        detected=bool(found),
        fault_steps=step,
        detectors=on,
        detected_by=caught,
        alert_detectors=caught,
        check_intervals=every,
        detect_steps=found,
    )
    return row


def write_run(
    folder: Path, trials: list[dict], costs: list[tuple], hook_vs_ddp: float | None = None
) -> Path:
    """trials.csv and overhead.csv; `hook_vs_ddp`: the hook's row against plain DDP (None: a
    table measured before plain DDP was)."""
    folder.mkdir(parents=True)
    write_cells(folder / "trials.csv", trials)
    measured = ["detector", "interval", "overhead_pct", "floor_pct"]  # other columns blank
    rows = [dict(zip(measured, c, strict=True)) for c in costs]
    if hook_vs_ddp is not None:
        rows.insert(0, {"detector": "hook", "overhead_vs_ddp_pct": hook_vs_ddp})
        for row in rows[1:]:
            both = (1 + row["overhead_pct"] / 100) * (1 + hook_vs_ddp / 100)
            row["overhead_vs_ddp_pct"] = round(100 * (both - 1), 3)
    overhead.write(folder / schema.OVERHEAD_FILE, rows)
    return folder


def ranked(folder: Path, job: Job) -> dict[tuple[str, str], float]:
    """(checks, interval) -> expected loss, in the plan's order."""
    result = plan(*load([folder]), job)
    return {(o.name, o.interval): found.expected for o, found in result.ranked}


def every_step_run(folder: Path, seeds: int = 1) -> Path:
    """Four harmful faults: the sketch (5% a step) catches each in its step, nan_inf (1%)
    none."""
    on = "allreduce_sketch;nan_inf"
    trials = [
        trial(20 + i, s, True, on, found=f"allreduce_sketch={20 + i}")
        for i in range(4)
        for s in range(seeds)
    ]
    return write_run(folder, trials, [("nan_inf", "", 1.0, ""), ("allreduce_sketch", "", 5.0, "")])


def test_a_check_the_trials_ran_without_a_measured_cost_is_named_as_left_out(tmp_path, capsys):
    """overhead.csv timed nan_inf alone (a run merged with one that timed nothing): the sketch,
    which caught every fault, was in no option, and nothing said so."""
    on = "allreduce_sketch;nan_inf;replay"
    trials = [trial(20 + i, 0, True, on, every="replay=5", found=f"allreduce_sketch={20 + i}")
              for i in range(4)]  # fmt: skip
    result = plan(*load([write_run(tmp_path / "run", trials, [("nan_inf", "", 1.0, "")])]), HAND)
    assert {o.name for o, _ in result.ranked} == {"no checks", "nan_inf"}
    assert result.untimed == ("allreduce_sketch", "replay every 5")
    text = plan_report.markdown(result, "plan.png")
    assert (
        "Left out of every option, for want of a measured cost: allreduce_sketch, replay " in text
    )
    plan_report.main([str(tmp_path / "run"), "--out", str(tmp_path / "plan")])
    assert "Left out of every option" in capsys.readouterr().out


def test_the_cheapest_check_is_not_the_best(tmp_path):
    found = ranked(every_step_run(tmp_path / "run"), HAND)
    assert found == pytest.approx(
        {
            ("allreduce_sketch", "-"): 24 * 0.05 + 1 * IN_STEP,  # 5.7
            ("allreduce_sketch + nan_inf", "-"): 24 * 0.06 + IN_STEP,  # 5.94
            ("no checks", "-"): 1 * 20,
            ("nan_inf", "-"): 24 * 0.01 + 20,  # 20.24: cheapest check, and worse than none
        }
    )
    assert list(found)[0] == ("allreduce_sketch", "-")


def replay_run(folder: Path, seeds: int = 1) -> Path:
    """Four faults at steps 20-23, the first two harmful. Replay every step (40% overhead)
    catches all four in their step; every 10 steps (4%) only the one at step 20, at step 25:
    from the step before its audit 5 steps earlier, an odd step, the checkpoint before it is 8
    steps back (TENTH)."""
    trials = []
    for s in range(seeds):
        for i in range(4):
            found = f"replay={20 + i}"
            trials.append(trial(20 + i, s, i < 2, "replay", "replay=1", found))
            trials.append(trial(20 + i, s, i < 2, "replay", "replay=10", "replay=25" * (i == 0)))
    costs = [("replay", 1, 40.0, 38.0), ("replay", 10, 4.0, 3.8)]
    return write_run(folder, trials, costs)


TENTH = 8 + 1


def test_auditing_more_often_costs_more_than_it_saves(tmp_path):
    folder = replay_run(tmp_path / "run")
    found = ranked(folder, HAND)
    every_step = 24 * 0.40 + 1 * IN_STEP  # 14.1: everything caught at once
    every_tenth = 24 * 0.04 + 1 / 4 * TENTH + 1 / 4 * 20  # 8.21: one harmful fault escapes
    nothing = 2 / 4 * 20  # 10
    assert found == pytest.approx(
        {("replay", "10"): every_tenth, ("no checks", "-"): nothing, ("replay", "1"): every_step}
    )
    assert list(found) == [("replay", "10"), ("no checks", "-"), ("replay", "1")]
    best = plan(*load([folder]), HAND).best[0]
    assert best.overrides() == "detectors=[replay] detectors.replay.interval=10"


def test_the_plan_weighs_checks_by_their_cost_against_plain_ddp_hook_included(tmp_path):
    """The same trials, with the hook costing 10% of a step against plain DDP: against the hook
    alone, replay every 10 steps is the best plan; against plain DDP, the job that pays the hook
    too is better off with no checks, which need no hook. A check's share is of the hook's
    step, 1.1 plain DDP steps: 4% of it is 4.4% of plain DDP's (the two were added)."""
    against_hook = replay_run(tmp_path / "hook")
    trials = pd.read_csv(against_hook / "trials.csv", dtype=str, keep_default_na=False)
    costs = [("replay", 1, 40.0, 38.0), ("replay", 10, 4.0, 3.8)]
    against_ddp = write_run(tmp_path / "ddp", trials.to_dict("records"), costs, hook_vs_ddp=10.0)
    assert list(ranked(against_hook, HAND))[0] == ("replay", "10")
    found = ranked(against_ddp, HAND)
    every_tenth = 24 * (0.10 + 0.04 * 1.1) + 1 / 4 * TENTH + 1 / 4 * 20  # 10.706
    assert found == pytest.approx(
        {
            ("no checks", "-"): 2 / 4 * 20,  # 10: no hook, no checks
            ("replay", "10"): every_tenth,
            ("replay", "1"): 24 * (0.10 + 0.40 * 1.1) + 1 * IN_STEP,
        }
    )
    assert list(found)[0] == ("no checks", "-")
    text = plan_report.header(HAND, plan(*load([against_ddp]), HAND).overheads)
    assert "the harness's hook costs 10% of a step, once for any set of checks" in text


def test_an_overhead_below_its_floor_counts_as_the_floor_and_is_named(tmp_path):
    trials = [
        trial(20, 0, True, "replay;weight_consensus", "replay=10;weight_consensus=10", "replay=20")
    ]
    costs = [("replay", 10, 1.0, 3.8), ("weight_consensus", 10, -2.5, "")]
    result = plan(*load([write_run(tmp_path / "run", trials, costs)]), HAND)
    cost = {o.name: o.overhead_pct for o, _ in result.ranked}
    assert cost == {
        "no checks": 0.0,
        "replay": 3.8,
        "weight_consensus": 0.0,
        "replay + weight_consensus": 3.8,
    }
    assert result.overheads.noise == ["replay@10 1.00%", "weight_consensus@10 -2.50%"]
    assert "Timing noise: 2 overhead measurements" in plan_report.recommendation(result)


def test_a_consensus_option_is_set_with_checkpoints_at_its_interval(tmp_path):
    """Consensus also looks before every checkpoint, and sdc-bench refuses checkpoints that
    would make it look more often than its interval: the overrides the plan prints for consensus
    every 50 (sdc-bench checkpoints every 10 by default) exited 2 as printed."""
    trials = [trial(20, 0, True, "weight_consensus", "weight_consensus=50", "weight_consensus=49")]
    folder = write_run(tmp_path / "run", trials, [("weight_consensus", 50, 0.5, "")])
    option = next(o for o, _ in plan(*load([folder]), HAND).ranked if o.checks)
    printed = option.overrides()
    assert printed == (
        "detectors=[weight_consensus] detectors.weight_consensus.interval=50 checkpoint.interval=50"
    )
    run = compose_run(*printed.split(), "workload.steps=50")  # at least the interval, as said
    assert (run.detectors["weight_consensus"].every, run.checkpoint.interval) == (50, 50)
    # For a job checkpointing every 500 steps, at which its loss is priced, its own checkpoints
    # (they printed 50: ten times the checkpoints, none of them priced); the least multiple of
    # the interval above where the interval does not divide the job's, and said.
    assert option.overrides(500).endswith("checkpoint.interval=500")
    assert option.overrides(520).endswith("checkpoint.interval=550")
    # The guard takes a mapping, not Hydra's overrides: printed as one, it selects the option.
    guarded = option.guard_detectors()
    assert guarded == '{"weight_consensus": {"interval": 50}}'
    topology = replace(compose_run().topology, nodes=3, ranks_per_node=1)
    job = selection.Job(topology, "act", None, None)
    assert selection.select(json.loads(guarded), job).checks["weight_consensus"].interval == 50
    caught = [trial(20 + i, 0, True, "weight_consensus", "weight_consensus=50",
                    "weight_consensus=49") for i in range(4)]  # fmt: skip
    often = write_run(tmp_path / "often", caught, [("weight_consensus", 50, 0.5, "")])
    result = plan(*load([often]), replace(HAND, step_seconds=1, checkpoint_every=520))
    assert result.best[0].checks == ("weight_consensus",)
    assert "it checkpoints every 550 steps, the least multiple" in plan_report.recommendation(
        result
    )
    # Its rollbacks priced at 550-step checkpoints (each fault injected at 20..23, found at
    # 49): back to the newest checkpoint before its last look, 50 steps before the alarm. A
    # checkpoint follows every 11th look: after the look that follows one, 550 steps further
    # back, else 50 to 500. (550 + 50 + 100 + ... + 500) / 11 = 350 steps on average.
    (option, found), job = result.best, result.job
    rolled = 350 * job.step_seconds / 3600 + job.restart_minutes / 60
    assert found.expected == pytest.approx(0.5 / 100 * 24 + job.events_per_day * job.gpus * rolled)


def test_a_check_timed_at_several_intervals_costs_its_fitted_run_over_k():
    # Least squares of y = c / k: c = sum(y / k) / sum(1 / k^2).
    assert amortized([1, 5, 20], [41.5, 9.1, 2.4]) == pytest.approx(
        (41.5 + 9.1 / 5 + 2.4 / 20) / (1 + 1 / 25 + 1 / 400)
    )
    # Noise that drives the fit below zero: the check costs nothing, not less.
    assert amortized([1, 2, 10], [2.0, -8.0, -30.0]) == 0.0
    table = pd.DataFrame(
        {
            "detector": ["replay"] * 3 + ["nan_inf"],
            "interval": ["1", "5", "20", ""],
            "overhead_pct": [40.0, 30.0, -1.0, -3.0],
            "floor_pct": [10.0, 2.0, 0.5, float("nan")],
            "overhead_low_pct": [30.0, 20.0, -5.0, float("nan")],
            "overhead_high_pct": [50.0, 40.0, 3.0, float("nan")],
            "steps": [1.0, 5.0, 20.0, float("nan")],
        }
    )
    weights = 1 + 1 / 25 + 1 / 400
    c = (40 + 30 / 5 - 1 / 20) / weights
    low, high = (30 + 20 / 5 - 5 / 20) / weights, (50 + 40 / 5 + 3 / 20) / weights
    found = overheads(table)
    assert found.per_run == pytest.approx({"replay": c})
    assert found.at == pytest.approx(
        {("replay", "1"): c, ("replay", "5"): c / 5, ("replay", "20"): c / 20, ("nan_inf", ""): 0}
    )
    assert found.noise == ["nan_inf@- -3.00%", "replay@20 -1.00%"]
    # Its lowest and highest rounds fitted alike, never below its floor; none for nan_inf,
    # whose row holds no rounds.
    expected = {("replay", "1"): (low, high), ("replay", "5"): (low / 5, high / 5),
                ("replay", "20"): (max(0.5, low / 20), high / 20)}  # fmt: skip
    assert found.rounds.keys() == expected.keys()
    for key, spread in expected.items():
        assert found.rounds[key] == pytest.approx(spread)


def test_the_range_is_the_wilson_bounds_carried_through(tmp_path):
    result = plan(*load([every_step_run(tmp_path / "run")]), HAND)
    option, found = result.best
    caught_lo, caught_hi = tables.wilson(4, 4)
    _, escaped_hi = tables.wilson(0, 4)
    assert found.low == pytest.approx(24 * 0.05 + caught_lo * IN_STEP)
    assert found.high == pytest.approx(24 * 0.05 + caught_hi * IN_STEP + escaped_hi * 20)
    assert found.low < found.expected < found.high


def test_the_range_carries_each_checks_lowest_and_highest_round(tmp_path):
    """overhead.csv's rounds (overhead_low_pct, overhead_high_pct), the hook's against plain
    DDP: the range puts each overhead at its extremes as it puts each rate at its bounds. On a
    2-core machine a check's rounds spread over tens of points: a plan that read the median
    alone called options apart that the timings could not tell apart."""
    folder = every_step_run(tmp_path / "run")
    timed = [
        {"detector": "hook", "overhead_vs_ddp_pct": 1.0, "overhead_low_pct": -0.5,
         "overhead_high_pct": 1.5},
        {"detector": "nan_inf", "overhead_pct": 1.0, "overhead_low_pct": 0.5,
         "overhead_high_pct": 2.0},
        {"detector": "allreduce_sketch", "overhead_pct": 5.0, "overhead_low_pct": 3.0,
         "overhead_high_pct": 9.0},
    ]  # fmt: skip
    overhead.write(folder / schema.OVERHEAD_FILE, timed)
    result = plan(*load([folder]), HAND)
    assert result.overheads.hook_rounds == (0.0, 1.5), "never below nothing"
    option, found = result.best
    assert option.name == "allreduce_sketch"
    # The check's share is of the hook's step: times 1.01 against plain DDP's; at the range's
    # ends, times the hook's own lowest (0%) and highest (1.5%) round.
    assert option.overhead_pct == pytest.approx(1.0 + 5.0 * 1.01)
    assert option.overhead_range == pytest.approx((0.0 + 3.0 * 1.0, 1.5 + 9.0 * 1.015))
    table = {row["checks"]: row["overhead"] for row in plan_report.rows(result)}
    assert table["allreduce_sketch"] == "6.05% [3.00%, 10.63%]"
    assert table["no checks"] == "0.00%"
    caught_lo, caught_hi = tables.wilson(4, 4)
    _, escaped_hi = tables.wilson(0, 4)
    assert found.expected == pytest.approx(24 * 0.0605 + IN_STEP)
    assert found.low == pytest.approx(24 * 0.03 + caught_lo * IN_STEP)
    assert found.high == pytest.approx(24 * 0.10635 + caught_hi * IN_STEP + escaped_hi * 20)
    # No checks costs nothing and catches nothing at either extreme: its escapes alone (the
    # upper end charged detections at the 0 of 4's upper bound, 49%, that no check can make).
    nothing = next(f for o, f in result.ranked if o.name == "no checks")
    assert (nothing.low, nothing.high) == pytest.approx((tables.wilson(4, 4)[0] * 20, 20))


def test_no_checks_in_a_job_is_no_guard_attached(tmp_path):
    """Given to the guard as printed (`detectors=[]`), 'no checks' still attached its hook, a
    few percent the option never priced."""
    folder = every_step_run(tmp_path / "run")
    overhead.write(folder / schema.OVERHEAD_FILE, [{"detector": "nan_inf", "overhead_pct": 50.0}])
    result = plan(*load([folder]), replace(HAND, sdc_rate=1e-12))
    assert result.best[0].name == "no checks" and result.best[0].guard_detectors() == ""
    assert "In a job: attach no guard" in plan_report.recommendation(result)


def test_the_rounds_of_overheads_pooled_over_dtypes_are_left_out():
    """One run's rounds span its own noise, not the median over another dtype's run too."""
    table = pd.DataFrame(
        {
            "detector": ["nan_inf", "nan_inf", "replay"], "interval": ["", "", "5"],
            "overhead_pct": [1.0, 3.0, 8.0], "floor_pct": [float("nan")] * 3,
            "overhead_vs_ddp_pct": [float("nan")] * 3, "overhead_low_pct": [0.5, 2.0, 6.0],
            "overhead_high_pct": [2.0, 4.0, 9.0], "steps": [float("nan"), float("nan"), 5.0],
        }
    )  # fmt: skip
    found = overheads(over_dtypes(table))
    assert found.at == {("nan_inf", ""): 2.0, ("replay", "5"): 8.0}
    assert found.rounds == {("replay", "5"): (6.0, 9.0)}


def test_the_range_widens_with_fewer_seeds(tmp_path):
    for run in (every_step_run, replay_run):
        few = plan(*load([run(tmp_path / f"{run.__name__}-2", seeds=2)]), HAND)
        many = plan(*load([run(tmp_path / f"{run.__name__}-8", seeds=8)]), HAND)
        assert [o.name for o, _ in few.ranked] == [o.name for o, _ in many.ranked]
        for (_, a), (_, b) in zip(few.ranked, many.ranked, strict=True):
            assert a.expected == pytest.approx(b.expected)  # the same shares, 4x the trials
            assert a.high - a.low > b.high - b.low


def periodic_run(folder: Path) -> Path:
    """Ten harmful transient faults at steps 20-29; replay at interval k audits the steps that
    are multiples of k (10, 5, 2, 1, 1 of them for k = 1, 2, 5, 10, 20), at 40/k % a step."""
    trials, costs = [], []
    for k in (1, 2, 5, 10, 20):
        for step in range(20, 30):
            found = f"replay={step}" if step % k == 0 else ""
            trials.append(trial(step, 0, True, "replay", f"replay={k}", found))
        costs.append(("replay", k, 40.0 / k, ""))
    return write_run(folder, trials, costs)


def test_a_higher_sdc_rate_audits_more_often(tmp_path):
    """With 6-minute steps, at half an event a day the model's loss is 9.6/k + 0.5 x (catch x
    (steps trained again / 10 + 1) + (1 - catch) x 20): interval 20 is best, 0.48 + 0.5 x (0.1
    x 3.3 + 0.9 x 20) = 9.645 (its one catch, at step 20, trained again from step 20 - 21's
    checkpoint before: 23 steps); a hundred times the rate pays for auditing every step, a
    hundredth of it for none."""
    folder = periodic_run(tmp_path / "run")
    tables = load([folder])
    six_minutes = replace(HAND, step_seconds=360)
    half = replace(six_minutes, sdc_rate=0.5 / 24)
    every_twentieth = next(f for o, f in plan(*tables, half).ranked if o.interval == "20")
    assert every_twentieth.expected == pytest.approx(0.48 + 0.5 * (0.1 * 3.3 + 0.9 * 20))

    def best(rate: float) -> str:
        job = replace(six_minutes, sdc_rate=rate)
        return plan(*tables, job).best[0].interval

    base = 0.5 / 24
    assert best(base) == "20"
    assert best(base * 100) == "1"
    assert best(base / 100) == "-"  # no checks


def test_defaults_are_the_llama3_rate_and_stated():
    assert pytest.approx(6) == LLAMA3_RATE * 16384 * 24 * 54
    text = plan_report.header(Job(), Overheads({}, {}, []))
    assert "--sdc-rate 2.8257e-07" in text and "Llama 3" in text and "54 days" in text
    assert text.count("(default") == 7
    assert "`--gpus 8`: GPUs in the job (given)" in plan_report.header(
        Job(gpus=8), Overheads({}, {}, [])
    )


def test_sdc_plan_on_the_notebook_fixture_writes_its_plan_and_figure(tmp_path, capsys):
    plan_report.main([str(FIXTURE), "--out", str(tmp_path), "--sdc-rate", "1e-4"])
    printed = capsys.readouterr().out
    assert "Recommended: **" in printed
    assert "Set it with (in sdc-bench, with workload.steps of at least 5):" in printed
    # A high rate pays for replay; every 5 steps audits the faults' step 10 as every step does
    # (the same harmful faults caught), for a quarter of the overhead.
    assert "detectors=[replay] detectors.replay.interval=5" in printed
    assert 'the examples\' --detectors):\n\n    {"replay": {"interval": 5}}' in printed
    text = (tmp_path / "plan.md").read_text()
    assert "| 1 | replay | 5 |" in text and "--sdc-rate 0.0001" in text
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_merged_plan_goes_beside_the_merged_report_and_keeps_each_runs_plan(tmp_path, capsys):
    """`sdc-plan A B` wrote its plan over A's own plan.md and plan.png: "the first folder" was
    the default, as sdc-report's was."""
    a, b, c = (tmp_path / name for name in "ABC")
    for job, run in zip("012", (a, b, c), strict=True):
        shutil.copytree(FIXTURE / job, run)
    plan_report.main([str(a), "--sdc-rate", "1e-4"])
    own = (a / "plan.md").read_text(), (a / "plan.png").read_bytes()
    assert own[0].splitlines()[2] == f"Runs: {a}  "
    report.main([str(a), str(b)])
    for others, folder in (([b], "merged"), ([c], "merged-2"), ([b], "merged")):
        plan_report.main([str(a), *map(str, others), "--sdc-rate", "1e-4"])
        assert capsys.readouterr().out.endswith(
            f"plan: {a / folder / 'plan.md'}\nfigure: {a / folder / 'plan.png'}\n"
        )
        runs = (a / folder / "plan.md").read_text().splitlines()[2]
        assert runs == f"Runs: {', '.join(sorted(map(str, [a, *others])))}  "
    assert ((a / "plan.md").read_text(), (a / "plan.png").read_bytes()) == own
    assert (a / "merged" / "report.md").exists() and not (a / "merged-2" / "report.md").exists()
    assert {p.name for p in a.iterdir() if p.is_dir()} == {"merged", "merged-2"}


def test_the_report_of_a_run_with_several_intervals_has_the_plan(tmp_path):
    df = tables.load_trials([FIXTURE])
    text = report.write_report(df, tmp_path, [FIXTURE]).read_text()
    section = text.split("## How often to audit")[1].split("\n## ")[0]
    assert "Recommended:" in section and "(figures/plan.png)" in section
    assert (tmp_path / "figures" / "plan.png").exists()


# A job to estimate the checks' costs for: a 70B model on H100s, 4M tokens a step.
ESTIMATE = ["--gpu", "h100", "--params", "7e10", "--tokens-per-step", "4e6"]


@pytest.mark.parametrize(
    "args, says",
    [
        (["{missing}"], "not a folder"),
        (["{empty}"], "no trials.csv"),
        (["{trials_only}"], "no overhead.csv"),
        (["{clean_only}"], "no fault struck in"),
        (["{crash_only}"], "no fault but crashes struck in"),
        (["{fixture}", "--sdc-rate", "-1"], "--sdc-rate: must be a number >= 0"),
        (["{fixture}", "--job-days", "0"], "--job-days: must be > 0, got 0"),
        (["{fixture}", "--gpus", "many"], "--gpus: must be a whole number, got 'many'"),
        (["{fixture}", "--mfu", "half"], "--mfu: must be a number, got 'half'"),
        (["{fixture}", "--gpu", "h100"], "--params: an estimate needs --gpu, --params"),
        (
            ["{fixture}", *ESTIMATE[:1], "a100", *ESTIMATE[2:]],
            "--gpu: 'a100' is not allowed; allowed: h100, h200, b200",
        ),
        (["{fixture}", *ESTIMATE, "--costs", "{fixture}/costs.json"], "take precedence"),
        (["{fixture}", *ESTIMATE, "--gpus", "64"], "--replicas: 128 replicas need as many --gpus"),
        (["{fixture}", "--replicas", "64"], "--replicas: only an estimate reads it"),
        (["{fixture}", "--equal-weights"], "--equal-weights: the runs weigh no fault by a mix"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, args, says):
    (tmp_path / "empty").mkdir()
    trials_only = tmp_path / "trials_only"
    trials_only.mkdir()
    (trials_only / "trials.csv").write_text((FIXTURE / "0" / "trials.csv").read_text())
    # A campaign of clean trials alone, with its overheads: nothing to weigh (it raised KeyError).
    clean_only = tmp_path / "clean_only"
    clean_only.mkdir()
    write_cells(clean_only / "trials.csv", [{"site": "none", "detectors": "nan_inf"}] * 3)
    (clean_only / "overhead.csv").write_text((FIXTURE / "0" / "overhead.csv").read_text())
    # Every fault that struck took a process down: no silent one to weigh (it raised KeyError).
    crash_only = tmp_path / "crash_only"
    crash_only.mkdir()
    crashed = {"model": "crash", "fired": "True", "effect": "crash", "detectors": "nan_inf"}
    write_cells(crash_only / "trials.csv", [crashed] * 3)
    (crash_only / "overhead.csv").write_text((FIXTURE / "0" / "overhead.csv").read_text())
    where = {
        "clean_only": clean_only,
        "crash_only": crash_only,
        "missing": tmp_path / "nowhere",
        "empty": tmp_path / "empty",
        "trials_only": trials_only,
        "fixture": FIXTURE,
    }
    with pytest.raises(SystemExit) as stop:
        plan_report.main([a.format(**where) for a in args])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sdc-plan: ") and says in err
    assert not (trials_only / "plan.md").exists()


def test_the_console_script_exits_2_without_a_traceback(tmp_path):
    script = Path(sys.executable).parent / "sdc-plan"
    proc = subprocess.run([str(script), str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"sdc-plan: {tmp_path / 'nowhere'}: not a folder\n"


def test_faults_that_differ_only_in_their_models_settings_count_apart(tmp_path):
    """Two defective units alike but for their rate have the same columns; the trial id's label
    (with the model's settings) keeps them two faults, not one run at two intervals."""
    on = "nan_inf"
    first = trial(20, 0, True, on, found="nan_inf=20")
    second = {**trial(20, 0, True, on), "trial_id": "001-matmul-defective_unit-rate0.1-s0"}
    first["trial_id"] = "000-matmul-defective_unit-rate0.01-s0"
    folder = write_run(tmp_path / "run", [first, second], [("nan_inf", "", 1.0, "")])
    result = plan(*load([folder]), HAND)
    (option,) = [o for o, _ in result.ranked if o.name == "nan_inf"]
    assert option.caught == (1, 2)


def test_two_faults_alike_in_their_columns_and_label_count_apart(tmp_path):
    """campaign=peers corrupts the reduction of the gradient (scenario 012) and that of the
    riders (022): the rows and labels are alike, the tensor is not in them. Run at the same
    intervals, they are two faults; the same fault at another interval of a check outside the
    set still counts once."""
    on = "allreduce_sketch;replay"
    label = "allreduce-scale-x1000-reduction-s0"
    rows = [
        {**trial(12, 0, True, on, "replay=5", "allreduce_sketch=12"), "trial_id": f"012-{label}"},
        {**trial(12, 0, False, on, "replay=5"), "trial_id": f"022-{label}"},
        {**trial(12, 0, True, on, "replay=10", "allreduce_sketch=12"), "trial_id": f"112-{label}"},
        {**trial(12, 0, False, on, "replay=10"), "trial_id": f"122-{label}"},
    ]
    costs = [("allreduce_sketch", "", 1.0, ""), ("replay", "5", 8.0, ""), ("replay", "10", 4.0, "")]
    result = plan(*load([write_run(tmp_path / "run", rows, costs)]), HAND)
    (sketch,) = [o for o, _ in result.ranked if o.name == "allreduce_sketch"]
    assert sketch.caught == (1, 2)
    nothing = [o for o, _ in result.ranked if o.name == "no checks"]
    assert [o.escaped for o in nothing] == [(1, 2)]


def test_the_figure_draws_a_set_whose_checks_run_at_several_intervals_at_the_longest(tmp_path):
    """Replay every 5 catches two faults, consensus every 10 the other two: together the best
    option, with 6-minute steps (at an hour a step, consensus's rollback of 20 steps, to the
    checkpoint before its last look, costs as much as the fault). The figure drew no point of
    it (its interval is no number), and put the recommended star at the first interval of all,
    5."""
    trials = [
        trial(20 + i, 0, True, "replay;weight_consensus", "replay=5;weight_consensus=10",
              f"replay={20 + i}" if i < 2 else "weight_consensus=29")
        for i in range(4)
    ]  # fmt: skip
    costs = [("replay", 5, 1.0, ""), ("weight_consensus", 10, 0.5, "")]
    six_minutes = replace(HAND, step_seconds=360)
    result = plan(*load([write_run(tmp_path / "run", trials, costs)]), six_minutes)
    assert result.best[0].name == "replay + weight_consensus"
    fig, ax = plt.subplots()
    plan_report.draw(ax, result)
    lines = {line.get_label(): line for line in ax.get_lines()}
    both = lines["replay + weight_consensus"]
    assert list(both.get_xdata()) == [10]
    assert list(lines["recommended"].get_xdata()) == [10]
    assert list(lines["recommended"].get_ydata()) == [result.best[1].expected]
    plt.close(fig)


def test_an_interval_the_overheads_lack_is_priced_by_the_checks_fit(tmp_path):
    """Trials ran replay every 20 steps, which overhead.csv did not time (a merged run's grid):
    the option vanished from the table while the header printed the fit that prices it."""
    folder = replay_run(tmp_path / "run")
    rows = pd.read_csv(folder / "trials.csv", dtype=str, keep_default_na=False)
    extra = rows[rows["check_intervals"] == "replay=10"].assign(check_intervals="replay=20")
    write_cells(folder / "trials.csv", pd.concat([rows, extra]).to_dict("records"))
    result = plan(*load([folder]), HAND)
    fit = result.overheads.per_run["replay"]
    priced = {o.interval: o.overhead_pct for o, _ in result.ranked if o.checks}
    assert priced["20"] == pytest.approx(fit / 20)


def test_the_jobs_costs_give_the_step_its_time_unless_given(tmp_path, capsys):
    """The header printed the default job's 6 s step above "20 steps of 0.25 s", and priced
    detection and rollback at 6 s."""
    folder = every_step_run(tmp_path / "run")
    measured = CheckCost(0.0025, math.nan)
    costs = priced(
        JobCosts(step_time_s=0.25, steps=20, warmup=3, device="cpu", parallel="ddp",
                 world_size=4, checks={"nan_inf": measured, "allreduce_sketch": measured},
                 hook=CheckCost(0.001, math.nan))
    )  # fmt: skip
    costs.write(tmp_path / "costs.json")
    plan_report.main([str(folder), "--costs", str(tmp_path / "costs.json"), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert (
        f"`--step-seconds 0.25`: {plan_report.FLAGS['step_seconds'][1]} (measured in the job" in out
    )
    plan_report.main([str(folder), "--costs", str(tmp_path / "costs.json"), "--step-seconds", "2",
                      "--out", str(tmp_path)])  # fmt: skip
    assert "`--step-seconds 2`:" in capsys.readouterr().out


def test_a_fitted_price_is_never_below_the_checks_floor():
    """Timings below the floor of one more forward and backward (38% of a step at every step,
    3.8% every 10): the fit of 10%/k priced replay at 20 at 0.5%, where its own row would have
    been floored at 1.9%."""
    table = pd.DataFrame(
        {
            "detector": ["replay"] * 2,
            "interval": ["1", "10"],
            "overhead_pct": [10.0, 1.0],
            "floor_pct": [38.0, 3.8],
            "overhead_low_pct": [float("nan")] * 2,
            "overhead_high_pct": [float("nan")] * 2,
            "steps": [1.0, 10.0],
        }
    )
    found = overheads(table)
    assert found.price(("replay", "20")) == pytest.approx(38.0 / 20)
    assert found.at[("replay", "10")] == pytest.approx(3.8)


def _consensus_run(folder: Path, optimizer_state: bool) -> Path:
    """A fault at step 20 that consensus every 10 finds at its look after step 29, its settings
    as the run's campaign.json records them for the trial."""
    row = trial(20, 0, True, "weight_consensus", "weight_consensus=10", "weight_consensus=29")
    run = write_run(folder, [row], [("weight_consensus", 10, 0.5, "")])
    settings = {"interval": 10, "mode": "observe", "optimizer_state": optimizer_state}
    record = {"detectors": {"weight_consensus": settings},
              "trials": [{"trial_id": row["trial_id"], "checks": None}]}  # fmt: skip
    (run / "campaign.json").write_text(json.dumps(record))
    return run


def test_a_rollback_goes_back_before_what_the_alarming_checks_do_not_vouch_for(tmp_path):
    """Recovery restores the newest checkpoint before the checks' first suspect step
    (harness/analysis/rollbacks.py). Consensus every 10 (the job's checkpoints every 2 become
    every 10, after its looks): on the weights alone its last look does not vouch for the
    moments, so the checkpoint that look made is passed over, 20 steps back; with the moments
    compared (campaign.json's settings), that checkpoint, 10 back. The plan priced both at
    half an interval and the 9 steps to detection."""
    for optimizer_state, back in ((False, 20), (True, 10)):
        folder = _consensus_run(tmp_path / f"run-{optimizer_state}", optimizer_state)
        result = plan(*load([folder]), HAND)
        found = next(f for o, f in result.ranked if o.checks)
        assert found.expected == pytest.approx(24 * 0.005 + back + 1)


def test_a_check_that_vouches_for_no_earlier_step_rolls_back_to_the_start(tmp_path):
    """matmul_checksum every other step may have missed a defective unit's strike on a step it
    skipped: recovery restarts from the initial weights, the job's age, half of --job-days on
    average (54 days of one-hour steps: 648 steps)."""
    row = trial(20, 0, True, "matmul_checksum", "matmul_checksum=2", "matmul_checksum=20")
    folder = write_run(tmp_path / "run", [row], [("matmul_checksum", 2, 1.0, "")])
    result = plan(*load([folder]), HAND)
    found = next(f for o, f in result.ranked if o.checks)
    assert found.expected == pytest.approx(24 * 0.01 + 54 * 24 / 2 + 1)
    shorter = plan(*load([folder]), replace(HAND, job_days=2))
    assert next(f for o, f in shorter.ranked if o.checks).expected == pytest.approx(
        24 * 0.01 + 24 + 1
    )


def test_a_crash_fault_is_no_sdc_event(tmp_path):
    """campaign=recovery's crash scenarios take a process down: no silent corruption, never
    caught by a check nor damaging in the row. Counted as SDC events they shrank both shares,
    and the losses of every set of checks with them, while the overheads stayed: a plan that
    favoured cheaper sets."""
    harmful = trial(20, 0, True, "nan_inf", found="")
    crash = {**trial(21, 0, False, "nan_inf"), "model": "crash", "effect": "crash"}
    folder = write_run(tmp_path / "run", [harmful, crash], [("nan_inf", "", 1.0, "")])
    result = plan(*load([folder]), HAND)
    assert {o.name: o.escaped for o, _ in result.ranked} == {"nan_inf": (1, 1), "no checks": (1, 1)}


def test_an_estimated_cost_reads_the_checks_settings(tmp_path):
    """`--gpu`'s formulas read the interval alone: consensus fingerprinting Adam's two moments
    with the weights (`optimizer_state`, as campaign.json records it) reads three times the
    bytes, and was priced as the weights alone."""
    shape = JobShape("h100", 70e9, 4e6)
    priced = {}
    for optimizer_state in (False, True):
        trials, _ = load([_consensus_run(tmp_path / f"run-{optimizer_state}", optimizer_state)])
        priced[optimizer_state] = estimated_overheads(shape, trials).at[("weight_consensus", "10")]
    assert priced[True] == pytest.approx(3 * priced[False])
    assert priced[False] == pytest.approx(shape.overhead_pct("weight_consensus", 10))


def test_the_jobs_replay_is_priced_per_audit_it_ran():
    """Measured over steps 3..29 at every 5 it audited 5 times, not 27 / 5 = 5.4: priced by its
    interval, each audit came out 7% cheap."""
    measured = range(3, 30)
    looks = detectors.detector_class("replay").looks(
        compose_run("detectors=[replay]").detectors["replay"], measured, lambda _: False
    )
    assert looks == 5
    replay = CheckCost(0.01, math.nan, interval=5, looks=looks)
    costs = priced(
        JobCosts(step_time_s=0.1, steps=len(measured), warmup=3, device="cpu", parallel="ddp",
                 world_size=4, checks={"replay": replay}, hook=CheckCost(0.0, math.nan))
    )  # fmt: skip
    trials = frame(trial(10, 0, True, "replay", "replay=5", "replay=10"))
    found = job_overheads(costs, "costs.json", trials)
    per_audit = costs.checks["replay"].overhead_pct * len(measured) / 5
    assert found.per_run["replay"] == pytest.approx(per_audit)
