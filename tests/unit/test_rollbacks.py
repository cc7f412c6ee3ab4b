"""sdc-plan's rollbacks (harness/analysis/rollbacks.py): each check's bound as data, held to the
detector's own `first_suspect_step` (what recovery and the guard restore before), and the steps a
job trains again, by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest

import detectors
from harness.analysis.rollbacks import RULES, Bound, bound, steps_lost
from harness.campaign import recovery
from harness.config.schema import CheckpointConfig
from harness.core.events import Alert
from harness.core.plugins import Detector
from harness.runtime import checkpoint

# Settings each check is tried at, besides its defaults.
SETTINGS = {
    "replay": [{"interval": 1}, {"interval": 3}, {"interval": 10}, {"steps": (2, 7, 11)}],
    "weight_consensus": [
        {"interval": k, "optimizer_state": state} for k in (1, 4, 10) for state in (False, True)
    ],
    "megatron_hash": [{"interval": 1}, {"interval": 3}],
    "gather_consensus": [{"interval": 3}, {"interval": 10}],
    "matmul_checksum": [{"interval": 3}, {"fraction": 0.5}, {"interval": 2, "fraction": 0.5}],
}
ALSO = {name: SETTINGS.get(name, []) for name in detectors.built_in()}
CASES = [(name, params) for name, tried in ALSO.items() for params in [{}, *tried]]


@pytest.mark.parametrize(("name", "params"), CASES)
def test_each_checks_bound_is_its_detectors_own(name, params):
    """At every alarm step of a 60-step run and every checkpoint interval tried, as campaign.json
    records the check's settings (every field): the start (None) is step 0 there."""
    check = detectors.detector_class(name)
    config = check.Config(**params)
    recorded = dataclasses.asdict(config)
    for every in (1, 2, 5, 10, 12):
        after = CheckpointConfig(every, keep=False).after
        for t in range(60):
            ours = bound(name, recorded).first_suspect(t, every)
            assert (ours or 0) == check.first_suspect_step(config, t, after), (every, t)


def test_every_check_with_a_bound_of_its_own_has_a_rule():
    """A check whose detector overrides first_suspect_step (its default: two steps back) would
    otherwise be priced as a check of each step's values."""
    own = {
        name
        for name in detectors.built_in()
        if detectors.detector_class(name).first_suspect_step.__func__
        is not Detector.first_suspect_step.__func__
    }
    assert own == set(RULES)


# A check, its settings, and where it alarms: the steps t with t % interval == phase, its looks.
RECOVERIES = [
    ("nan_inf", {}, 0),
    ("replay", {"interval": 5}, 0),
    ("weight_consensus", {"interval": 5}, 4),
    ("weight_consensus", {"interval": 5, "optimizer_state": True}, 4),
    ("megatron_hash", {"interval": 4}, 3),
    ("gather_consensus", {"interval": 3}, 0),
    ("matmul_checksum", {}, 0),
]


@pytest.mark.parametrize(("name", "params", "phase"), RECOVERIES)
@pytest.mark.parametrize("every", [2, 5, 10])
def test_the_steps_trained_again_are_recoverys(tmp_path, name, params, phase, every):
    """Over a period of alarms far from the start, the mean of what recovery's own functions
    restore (recovery.earliest_suspect over the alarm, recovery.restore_point among the
    checkpoints a trial checkpointing every `every` steps saved) and the alarm."""
    check = detectors.detector_class(name)
    config = check.Config(**params)
    checkpointing = CheckpointConfig(every, keep=False)
    for s in range(120):
        if checkpointing.after(s):
            checkpoint.save(checkpoint.step_path(tmp_path, s), {})
    k = config.every or 1
    alarms = [t for t in range(60, 60 + math.lcm(every, k)) if t % k == phase]
    lost = []
    for t in alarms:
        alert = Alert(step=t, detector=name, phase="post_allreduce", suspect_ranks=[0],
                      suspect_nodes=[0], evidence={})  # fmt: skip
        first = recovery.earliest_suspect([alert], {name: config}, checkpointing.after)
        restore, _ = recovery.restore_point(tmp_path, first, [])
        lost.append(t - restore)
    priced = steps_lost((bound(name, dataclasses.asdict(config)),), alarms[0], 0, every, 1e9)
    assert priced == pytest.approx(sum(lost) / len(lost))


def test_the_steps_trained_again_by_hand():
    """A job checkpointing every 500 steps (after steps 499, 999, ...), a fault caught 0 steps
    after it (a value check) or at the next look after it."""
    job = 10_000_000.0
    # Two steps before the alarm: (t - 2) mod 500 + 3, 249.5 + 3 on average.
    assert steps_lost((Bound(),), 7, 0, 500, job) == pytest.approx(252.5)
    # Replay every 50 (audits at multiples of 50): back to the step before its last audit, 51
    # steps; a checkpoint 500 back where that step is 499 (mod 500) or 549: (501 + 551 + 101 +
    # 151 + ... + 451) / 10.
    replay = Bound(every=50, offset=-1)
    assert steps_lost((replay,), 50, 3, 500, job) == pytest.approx(326)
    # Consensus every 50 on the weights alone (looks after steps 49, 99, ...): back before its
    # last look, so never to the checkpoint that look made; with the moments compared too, to it.
    weights = Bound(every=50, shift=1, at_checkpoints=True)
    assert steps_lost((weights,), 49, 20, 500, job) == pytest.approx((550 + 2700) / 10)
    moments = Bound(every=50, shift=1, offset=1, at_checkpoints=True)
    assert steps_lost((moments,), 49, 20, 500, job) == pytest.approx((500 + 2700 - 450) / 10)
    # Its own step: from the newest checkpoint before the alarm, (t mod 500) + 1.
    assert steps_lost((Bound(back=0),), 7, 0, 500, job) == pytest.approx(250.5)
    # A threshold check that caught a slow corruption 40 steps on: before the fault, not its
    # two steps.
    assert steps_lost((Bound(),), 7, 40, 500, job) == pytest.approx(249.5 + 41)
    # Several alarming together: the earliest bound of them.
    assert steps_lost((Bound(), replay), 50, 0, 500, job) == pytest.approx(326)
    # A check that vouches for no earlier step: the start, half the job.
    assert steps_lost((Bound(start=True), Bound()), 7, 0, 500, job) == job / 2


def test_a_check_at_listed_steps_keeps_its_distance_back_from_the_alarm():
    """Replay at steps 400 and 450 alarming at 450 suspects from 399, 51 back: a job has no
    such steps, so the alarm keeps that distance wherever it falls between checkpoints (51 +
    250.5 at 500-step checkpoints). Held to the listed steps themselves while the alarm moved,
    most alarms fell where no audit was, 700.5."""
    listed = Bound(offset=-1, steps=(400, 450))
    assert steps_lost((listed,), 450, 0, 500, 1e7) == pytest.approx(51 + 250.5)
    # No audit before the alarm: from the start.
    assert steps_lost((Bound(offset=-1, steps=(450,)),), 450, 0, 500, 1e7) == 1e7 / 2
