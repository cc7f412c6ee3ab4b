"""The audit interval a trial's row records for each periodic check (`check_intervals`): the
most steps between two of its looks as the trial ran them, not only as configured. Consensus
also looks before every checkpoint, so checkpoints closer than its interval shorten it."""

from __future__ import annotations

import pytest

from harness.campaign.recovery import check_intervals
from tests.conftest import compose_run


def _recorded(*overrides: str) -> dict[str, int]:
    run = compose_run("detectors=[weight_consensus,replay]", *overrides)
    return check_intervals(run, run.detectors)


@pytest.mark.parametrize(
    ("consensus", "checkpoint", "steps", "recorded"),
    [
        (50, 5, 30, 5),  # a checkpoint every 5 steps: consensus every 5, never at 50
        (4, 2, 12, 2),  # every checkpoint falls between two of its own looks
        (10, 10, 30, 10),  # the published setting: its looks are the checkpoints'
        (50, 60, 60, 50),  # audit_frequency: the checkpoint at 59 comes after the look at 49
        (10, 15, 30, 10),  # looks at 9, 14, 19, 29: 10 steps from 19 to 29
        (20, 15, 60, 15),  # looks at 14, 19, 29, 39, 44, 59: at most 15 apart
    ],
)
def test_consensus_is_recorded_at_the_most_steps_between_its_looks(
    consensus, checkpoint, steps, recorded
):
    got = _recorded(
        f"detectors.weight_consensus.interval={consensus}",
        f"checkpoint.interval={checkpoint}",
        f"workload.steps={steps}",
        "detectors.replay.interval=5",
    )
    assert got == {"weight_consensus": recorded, "replay": 5}, "replay never looks off its own"


def test_a_check_that_looks_every_step_has_no_interval_recorded():
    run = compose_run("detectors=[nan_inf,matmul_checksum]", "checkpoint.interval=3")
    assert check_intervals(run, run.detectors) == {}
