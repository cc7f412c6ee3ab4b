"""A periodic check looks at the interval it is set to: that is what trials.csv's
`check_intervals`, the report's interval table, overhead.csv and sdc-plan credit its catches to.
Consensus also looks before every checkpoint, so a checkpoint off its own looks is refused."""

from __future__ import annotations

import pytest

import detectors
from detectors.weight_consensus import WeightConsensus
from harness.errors import ConfigError
from tests.conftest import compose_run


def _composed(consensus: int, checkpoint: int, steps: int):
    return compose_run(
        "detectors=[weight_consensus,replay]", "detectors.replay.interval=3",
        f"detectors.weight_consensus.interval={consensus}", f"checkpoint.interval={checkpoint}",
        f"workload.steps={steps}",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("consensus", "checkpoint", "steps", "looks_every"),
    [
        (50, 5, 30, 5),  # a checkpoint every 5 steps: consensus every 5, never at 50
        (4, 2, 12, 2),  # every other checkpoint falls between two of its own looks
        (20, 15, 60, 15),  # looks after steps 14, 19, 29, 39, 44, 59: at most 15 apart
        (100, 60, 60, 60),  # its one look is the checkpoint's, after step 59
    ],
)
def test_checkpoints_off_consensus_looks_are_refused(consensus, checkpoint, steps, looks_every):
    with pytest.raises(ConfigError) as refused:
        _composed(consensus, checkpoint, steps)
    assert refused.value.key == "detectors.weight_consensus.interval"
    assert f"looks every {looks_every} steps of this {steps}-step run" in str(refused.value)


@pytest.mark.parametrize(
    ("consensus", "checkpoint", "steps"),
    [
        (10, 10, 30),  # the published setting: the checkpoints' looks are its own
        (5, 20, 30),  # a multiple of its interval
        (50, 60, 60),  # audit_frequency: the look after step 59 leaves 50 the longest stretch
        (10, 15, 30),  # looks after 9, 14, 19, 29: never more than 10 apart
    ],
)
def test_checkpoints_that_leave_its_interval_are_accepted(consensus, checkpoint, steps):
    run = _composed(consensus, checkpoint, steps)
    assert run.detectors["weight_consensus"].every == consensus


def test_a_scenarios_interval_is_held_to_the_same():
    scenario = (
        "{site:weight,model:scale,factor:10.0,ranks:[1],steps:[2],"
        "checks:{weight_consensus:{interval:20}}}"
    )
    with pytest.raises(ConfigError) as refused:
        compose_run(
            "detectors=[weight_consensus]", "checkpoint.interval=10", "workload.steps=30",
            f"campaign.scenarios=[{scenario}]",
        )  # fmt: skip
    assert refused.value.key == "campaign.scenarios[0].checks.weight_consensus.interval"


def test_a_resumed_run_counts_its_stretches_from_where_it_began():
    """The guard of a job resumed at step 100 measures from there: its first look after 101."""
    config = WeightConsensus.Config(interval=4)
    after = {101, 103, 105, 107}.__contains__
    assert WeightConsensus.ran_every(config, range(100, 108), after) == 2
    assert WeightConsensus.ran_every(config, range(0, 8), {1, 3, 5, 7}.__contains__) == 2
    assert WeightConsensus.ran_every(config, range(0, 3), lambda s: False) == 4, "no look: 4"
    # Resumed at 105 with consensus every 20: from its own look after 99 to the next after 119.
    every_20 = WeightConsensus.Config(interval=20)
    assert WeightConsensus.ran_every(every_20, range(105, 125), lambda s: False) == 20


def test_a_scenario_may_give_replay_listed_steps_in_place_of_the_runs_interval():
    """The run's replay looks every 5 steps; a scenario that lists its steps replaces the
    interval (it was refused: the run's normalised interval came along with them), and the
    other way round."""
    fault = "site:grad,model:scale,factor:10.0,ranks:[1],steps:[2]"
    listed = f"{{{fault},checks:{{replay:{{steps:[3]}}}}}}"
    run = compose_run("detectors=[replay]", f"campaign.scenarios=[{listed}]")
    assert {(t.checks["replay"].steps, t.checks["replay"].every) for t in run.trials} == {
        ((3,), None)
    }
    every = f"{{{fault},checks:{{replay:{{interval:2}}}}}}"
    run = compose_run(
        "detectors=[replay]", "detectors.replay.interval=null", "detectors.replay.steps=[4]",
        f"campaign.scenarios=[{every}]",
    )  # fmt: skip
    assert {(t.checks["replay"].steps, t.checks["replay"].every) for t in run.trials} == {(None, 2)}
    both = listed.replace("{steps:[3]}", "{interval:2,steps:[3]}")
    with pytest.raises(ConfigError, match="give one of interval and steps"):
        compose_run("detectors=[replay]", f"campaign.scenarios=[{both}]")


def test_a_scenario_that_compares_exactly_leaves_the_runs_tolerance_behind():
    """The run's rtol is read only by a tolerant comparison: a scenario that compares exactly
    was refused for the tolerance it inherited; one that sets its own keeps it."""
    fault = "site:grad,model:scale,factor:10.0,ranks:[1],steps:[2]"
    exact = f"{{{fault},checks:{{replay:{{compare:exact}}}}}}"
    tolerant = f"{{{fault},checks:{{replay:{{compare:tolerant,rtol:0.01}}}}}}"
    run = compose_run(
        "detectors=[replay]",
        "detectors.replay.rtol=0.001",
        f"campaign.scenarios=[{exact},{tolerant}]",
    )
    settings = {(t.checks["replay"].compare, t.checks["replay"].rtol) for t in run.trials}
    assert settings == {("exact", None), ("tolerant", 0.01)}


# What each check vouches for when it alarms at step 10 (docs/guard.md, recovery): a checkpoint
# at step s holds the weights of step s's update and the optimizer moments after it, and every
# checkpoint from the bound on is suspect. A NaN in rank 0's weights from step 9's update shows
# in step 10's gradients, in its moments after step 8 at step 10 too: a value check must not
# vouch for step 8's checkpoint.
BOUNDS = [
    ("nan_inf", {}, 8),  # the weights 9's update left, the moments 8's did
    ("grad_stats", {}, 8),
    ("spiky_loss", {}, 8),
    ("allreduce_sketch", {}, 8),  # a NaN contribution alarms it too
    ("titan_replay", {"num_steps": -1}, 8),  # a NaN loss mismatches itself
    ("matmul_checksum", {}, 8),  # earlier state that overflows its check alarms it too
    ("matmul_checksum", {"interval": 2}, 0),  # a unit striking at a rate may have hit a skip
    ("matmul_checksum", {"fraction": 0.5}, 0),
    ("replay", {"interval": 5}, 4),  # its audit of 5 saw the weights 5 began with, not 4's moments
    # Looks after steps 4 and 9: the weights after 9's update agreed, not 9's moments.
    ("weight_consensus", {"interval": 5}, 9),
    ("weight_consensus", {"interval": 5, "optimizer_state": True}, 10),
    ("megatron_hash", {"interval": 5}, 9),
    ("gather_consensus", {"interval": 5}, 4),  # the forward of 5 saw 4's update, not 4's moments
]


@pytest.mark.parametrize(
    ("name", "settings", "bound"), BOUNDS, ids=[f"{b[0]}{b[1]}" for b in BOUNDS]
)
def test_each_check_vouches_only_for_the_state_it_saw(name, settings, bound):
    check = detectors.detector_class(name)
    config = check.Config.parse(f"detectors.{name}", settings)
    assert check.first_suspect_step(config, 10, lambda step: False) == bound
