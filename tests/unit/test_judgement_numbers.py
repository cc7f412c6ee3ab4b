"""harness/results/judgement.py's verdicts on numbers (docs/design.md, section 5): the harm
threshold from golden losses, the worst replica's loss, damage, the effect, the step time.
Nothing here reads events."""

from __future__ import annotations

import math

import pytest

from harness.config.schema import FaultConfig
from harness.results.judgement import (
    Golden,
    classify,
    damage,
    divergent_ranks,
    matches_golden,
    noise_band,
    step_time,
    worst_loss,
)
from harness.results.schema import RankResult

FAULT = FaultConfig(site="grad", model="bitflip")
CLEAN = FaultConfig()
GOLDEN = Golden(seed=0, final_loss=2.0, weights_digest="gold")
BAND = 0.1


def rank(r: int, loss: float = 2.0, digest: str = "gold", **fields) -> RankResult:
    return RankResult(trial_id="t", rank=r, final_loss=loss, weights_digest=digest, **fields)


def world(*ranks: RankResult) -> list[RankResult]:
    return list(ranks) or [rank(r) for r in range(4)]


# the harm threshold


def test_noise_band_is_max_minus_min_of_the_golden_losses():
    goldens = [Golden(s, loss, "d") for s, loss in enumerate([2.31, 2.25, 2.40, 2.28])]
    assert noise_band(goldens) == pytest.approx(2.40 - 2.25)


def test_noise_band_does_not_depend_on_the_order_of_the_seeds():
    goldens = [Golden(s, loss, "d") for s, loss in enumerate([1.0, 3.0, 2.0])]
    assert noise_band(goldens) == noise_band(goldens[::-1]) == 2.0


def test_noise_band_of_one_seed_is_zero():
    assert noise_band([Golden(0, 1.7, "d")]) == 0.0


# the worst replica


def test_worst_loss_is_the_highest_final_loss():
    assert worst_loss(world(rank(0, 2.0), rank(1, 2.5), rank(2, 1.0))) == 2.5


def test_worst_loss_is_nan_when_any_replica_is_nan_or_the_trial_crashed():
    assert math.isnan(worst_loss(world(rank(0, 2.0), rank(1, math.nan))))
    assert math.isnan(worst_loss(None))


def test_worst_loss_keeps_an_infinity():
    assert worst_loss(world(rank(0, 2.0), rank(1, math.inf))) == math.inf


def test_matches_golden_needs_every_replica_bit_identical():
    assert matches_golden(world(), GOLDEN)
    assert not matches_golden(world(rank(0), rank(1, digest="other")), GOLDEN)
    assert not matches_golden(None, GOLDEN)


# damage and divergence


def test_no_damage_in_equal_finite_replicas():
    assert damage(world()) == [] and damage(None) == [] and damage([]) == []


def test_damage_names_each_broken_invariant():
    parts = world(rank(0, digest="a", optimizer_nonfinite=3),
                  rank(1, digest="b", weights_finite=False, optimizer_nonfinite=7))  # fmt: skip
    assert damage(parts) == [
        "replicas diverged",
        "non-finite weights",
        "non-finite optimizer state (7 elements)",
    ]


def test_divergent_ranks_are_those_off_the_most_common_replica():
    parts = world(rank(0, digest="a"), rank(1, digest="b"), rank(2, digest="a"),
                  rank(3, digest="a"))  # fmt: skip
    assert divergent_ranks(parts, GOLDEN) == [1]
    assert divergent_ranks(world(), GOLDEN) == []
    assert divergent_ranks(None, GOLDEN) == []


@pytest.mark.parametrize("struck", [(0, 1), (2, 3)])
def test_with_no_majority_the_divergent_ranks_are_those_off_the_golden_run(struck):
    """Two replica groups of an HSDP world split 2 against 2 (or two DDP ranks 1 against 1):
    the most common digest was whichever came first, rank 0's, so the healthy group was named
    whenever rank 0's was struck. The golden run (same seed) tells them apart; where neither
    side holds it, no side can be called the healthy one."""
    parts = [rank(r, digest="wrong" if r in struck else "gold") for r in range(4)]
    assert divergent_ranks(parts, GOLDEN) == list(struck)
    both = [rank(r, digest="a" if r < 2 else "b") for r in range(4)]
    assert divergent_ranks(both, GOLDEN) == [0, 1, 2, 3]
    three = [rank(0, digest="a"), rank(1, digest="b"), rank(2, digest="gold")]
    assert divergent_ranks(three, GOLDEN) == [0, 1]


# the effect


def test_a_crash_is_a_crash_whatever_else():
    assert classify(FAULT, world(), "rank 1 hung", GOLDEN, BAND) == "crash"
    assert classify(CLEAN, None, None, GOLDEN, BAND) == "crash"


def test_a_clean_trial_has_no_effect():
    assert classify(CLEAN, world(rank(0, 9.0, "x")), None, GOLDEN, BAND) == "none"


def test_a_fault_that_never_struck_is_not_masked_but_has_no_effect():
    untouched = world(rank(0, 5.0))
    assert classify(FAULT, untouched, None, GOLDEN, BAND, fired=False) == "none"
    assert classify(FAULT, untouched, None, GOLDEN, BAND, fired=True) == "masked"
    # A run that left its golden run is judged whatever the injector recorded.
    assert classify(FAULT, world(rank(0, 9.0, "x")), None, GOLDEN, BAND, fired=False) == "harmful"


def test_bit_identical_weights_are_masked_even_if_the_loss_differs():
    assert classify(FAULT, world(rank(0, 5.0)), None, GOLDEN, BAND) == "masked"


def test_bit_identical_weights_beside_a_non_finite_moment_are_latent():
    """A NaN written into a moment at the last step: no update spread it to the weights yet,
    and the row read masked beside its damage, "non-finite optimizer state"."""
    parts = world(rank(0, 2.0, optimizer_nonfinite=1), rank(1, 2.0))
    assert classify(FAULT, parts, None, GOLDEN, BAND) == "latent"


@pytest.mark.parametrize("loss", [2.0 + 0.1001, 2.0 - 0.1001, 50.0, math.inf, math.nan])
def test_a_loss_outside_the_band_or_not_finite_is_harmful(loss):
    assert classify(FAULT, world(rank(0, loss, "x")), None, GOLDEN, BAND) == "harmful"


@pytest.mark.parametrize("loss", [2.0, 2.05, 1.95, 2.0999])
def test_a_loss_within_the_band_on_healthy_replicas_is_benign(loss):
    assert classify(FAULT, world(rank(0, loss, "x"), rank(1, 2.0, "x")), None, GOLDEN,
                    BAND) == "benign"  # fmt: skip


def test_the_worst_replica_decides():
    parts = world(rank(0, 2.0, "x"), rank(1, 2.3, "x"))
    assert classify(FAULT, parts, None, GOLDEN, BAND) == "harmful"


@pytest.mark.parametrize("fields", [{"weights_finite": False}, {"optimizer_nonfinite": 1}])
def test_a_loss_within_the_band_on_damaged_state_is_latent(fields):
    parts = world(rank(0, 2.01, "x", **fields), rank(1, 2.01, "x"))
    assert classify(FAULT, parts, None, GOLDEN, BAND) == "latent"


def test_diverged_replicas_within_the_band_are_latent():
    parts = world(rank(0, 2.01, "x"), rank(1, 2.01, "y"))
    assert classify(FAULT, parts, None, GOLDEN, BAND) == "latent"


def test_with_a_zero_band_any_change_of_the_loss_is_harmful():
    assert classify(FAULT, world(rank(0, 2.0 + 1e-9, "x")), None, GOLDEN, 0.0) == "harmful"
    assert classify(FAULT, world(rank(0, 2.0, "x")), None, GOLDEN, 0.0) == "benign"


# step time


def test_step_time_is_the_median_over_steps_of_the_slowest_rank():
    parts = world(rank(0, step_times=[1.0, 5.0, 2.0]), rank(1, step_times=[3.0, 1.0, 2.5]))
    # slowest per step: 3.0, 5.0, 2.5 -> median 3.0
    assert step_time(parts) == 3.0


def test_step_time_is_blank_without_steps():
    assert step_time(world(rank(0), rank(1))) is None
    assert step_time(None) is None
