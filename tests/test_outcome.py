"""The definitions of docs/design.md section 5, on hand-built trial results."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from harness.analysis.tables import bit_class, load_trials, wilson
from harness.config.schema import FaultConfig, TrialSpec
from harness.core.events import Alert, Checkpoint, ElementInject
from harness.results.judgement import merge_alerts, noise_band, trial_row
from harness.results.schema import Golden, RankResult
from harness.results.trial_row import write_trials
from tests.conftest import compose_run

GRAD_NAN = FaultConfig(site="grad", model="value", value="nan", ranks=(1,), steps=(3,))
WEIGHT = FaultConfig(site="weight", model="scale", factor=10.0, ranks=(2,), steps=(3,))


def _part(rank, events=(), loss=1.0, digest="g", finite=True):
    return RankResult(
        f"t{rank}", rank, list(events), [loss], [0.01, 0.02, 0.03], loss, digest, finite
    )


def _inject(rank, step, t=10.0, fired=True):
    return ElementInject(
        rank=rank, node=rank, time=t, step=step, site="grad", model="value", tensor="w",
        index=0, bit=None, bits=None, old=1.0, new="nan", old_bits="", new_bits="", fired=fired,
    )  # fmt: skip


def _alert(rank, step, phase, suspects, t=11.0, detector="d"):
    return Alert(
        rank=rank,
        node=rank,
        time=t,
        step=step,
        phase=phase,
        detector=detector,
        suspect_ranks=suspects,
        suspect_nodes=suspects,
        evidence={},
    )


def _row(fault, parts, crash=None, band=0.1):
    spec = TrialSpec("t", 0, fault)
    return trial_row(compose_run(), spec, parts, crash, Golden(0, 1.0, "g"), band)[0]


def test_caught_in_its_step_before_the_optimizer_is_contained_and_attributed():
    parts = [
        _part(0),
        _part(
            1,
            [_inject(1, 3), _alert(1, 3, "pre_allreduce", [1])],
            loss=math.nan,
            digest="x",
            finite=False,
        ),
    ] + [_part(r) for r in (2, 3)]
    row = _row(GRAD_NAN, parts)
    assert (row.fired, row.detected, row.contained, row.attribution_correct) == (
        True,
        True,
        True,
        True,
    )
    assert row.ttd_steps == 0 and row.ttd_seconds == pytest.approx(1.0)
    assert row.effect == "harmful" and row.final_loss is None


def test_a_gradient_fault_caught_a_step_late_is_not_contained():
    parts = [_part(0, [_alert(0, 4, "pre_allreduce", [0])]), _part(1, [_inject(1, 3)], digest="x")]
    row = _row(GRAD_NAN, parts + [_part(2), _part(3)])
    assert row.detected and not row.contained and not row.attribution_correct
    assert row.ttd_steps == 1


def test_a_gather_fault_caught_a_step_late_is_not_contained():
    """A wrong gathered copy is the rank's forward weights: its step's gradient, and the update
    after it, carry the fault, as an activation's does. Caught a step later, it read contained
    wherever no checkpoint came between."""
    gather = FaultConfig(site="gather", model="scale", factor=1000.0, ranks=(1,), steps=(3,))
    late = [_part(0, [_alert(0, 4, "forward", [1])]), _part(1, [_inject(1, 3)], digest="x")]
    assert _row(gather, late + [_part(2), _part(3)]).contained is False
    caught = [_part(0, [_alert(0, 3, "forward", [1])]), _part(1, [_inject(1, 3)], digest="x")]
    assert _row(gather, caught + [_part(2), _part(3)]).contained is True


def test_a_checkpoint_between_injection_and_alert_breaks_containment():
    checkpoint = Checkpoint(rank=0, node=0, step=4, time=12.0, path="step_000004.pt")
    late = [
        _part(0, [checkpoint]),
        _part(1),
        _part(2, [_inject(2, 3), _alert(2, 5, "consensus", [2])], digest="x"),
        _part(3),
    ]
    assert _row(WEIGHT, late).contained is False
    early = [
        _part(0, [checkpoint]),
        _part(1),
        _part(2, [_inject(2, 3), _alert(2, 4, "consensus", [2])], digest="x"),
        _part(3),
    ]
    assert _row(WEIGHT, early).contained is True


def test_alerts_of_recoverys_earlier_segments_stay_apart_and_come_first():
    """Recovery ran the trial again in another world after each stop; an alert of the same
    step, check and phase in two segments was merged into one, its suspects the union of
    ranks that name other machines in each world: the row read one alert and both suspects.
    Each segment's alerts stay its own, the first segment's first."""
    first = replace(_alert(1, 6, "pre_allreduce", [1], t=11.0), segment=0)
    second = replace(_alert(0, 6, "pre_allreduce", [0], t=20.0), segment=1)
    final = _alert(2, 5, "pre_allreduce", [2], t=30.0)  # the last segment's carry none
    parts = [_part(0, [second]), _part(1, [_inject(1, 5), first], digest="x"), _part(2, [final])]
    row = _row(GRAD_NAN, [*parts, _part(3)])
    assert row.alerts == 3 and row.detect_step == 6 and row.suspect_ranks == (1,)
    merged = merge_alerts([e for p in parts for e in p.events])
    assert [(a.segment, a.suspect_ranks) for a in merged] == [(0, [1]), (1, [0]), (None, [2])]


def test_effects():
    struck = [_part(r, [_inject(r, 3)] if r == 3 else []) for r in range(4)]
    assert _row(GRAD_NAN, struck).effect == "masked"
    # The same run with a fault planned that never changed a value: no effect, not masked.
    missed = [_part(r, [_inject(r, 3, fired=False)] if r == 3 else []) for r in range(4)]
    row = _row(GRAD_NAN, missed)
    assert (row.effect, row.fired) == ("none", False)
    near = [_part(r, loss=1.05, digest="x") for r in range(4)]
    assert _row(GRAD_NAN, near, band=0.1).effect == "benign"
    far = [_part(r, loss=1.5, digest="x") for r in range(4)]
    assert _row(GRAD_NAN, far, band=0.1).effect == "harmful"
    crash = _row(GRAD_NAN, None, crash="rank 2 killed by SIGKILL")
    assert crash.effect == "crash" and crash.crash_cause == "rank 2 killed by SIGKILL"
    assert _row(FaultConfig(), [_part(r) for r in range(4)]).effect == "none"


def test_damaged_state_inside_the_band_is_latent_not_benign():
    diverged = [_part(r, loss=1.05, digest="x" if r == 2 else "y") for r in range(4)]
    row = _row(WEIGHT, diverged, band=0.1)
    assert (row.effect, row.damage) == ("latent", ("replicas diverged",))
    frozen = [_part(r, loss=1.05, digest="x") for r in range(4)]
    frozen[1].optimizer_nonfinite = 3  # an Adam moment overflowed: those weights stop moving
    row = _row(GRAD_NAN, frozen, band=0.1)
    assert (row.effect, row.damage) == ("latent", ("non-finite optimizer state (3 elements)",))
    nan_weight = [_part(r, loss=1.05, digest="x", finite=r != 0) for r in range(4)]
    assert _row(GRAD_NAN, nan_weight, band=0.1).effect == "latent"
    # Outside the band the loss decides: harmful, whatever else is damaged.
    far = [_part(r, loss=1.5, digest="x" if r == 2 else "y") for r in range(4)]
    assert _row(WEIGHT, far, band=0.1).effect == "harmful"


def test_an_injection_that_changed_nothing_has_not_fired():
    quiet = _inject(1, 3, fired=False)
    row = _row(GRAD_NAN, [_part(0), _part(1, [quiet]), _part(2), _part(3)])
    assert row.fired is False and row.detected is False and row.contained is None


def test_alerts_before_the_injection_do_not_count_as_detection():
    parts = [_part(0, [_alert(0, 1, "pre_allreduce", [0])]), _part(1, [_inject(1, 3)])]
    row = _row(GRAD_NAN, parts + [_part(2), _part(3)])
    assert row.alerts == 1 and row.detected is False


def test_an_alert_earlier_in_the_injection_step_than_the_fault_is_no_detection():
    """A check's alert in the injection step but in a phase before the fault strikes (a loss
    check before a gradient fault, replay's audit before the update a weight fault corrupts)
    came before the fault and cannot have seen it: it was credited as a catch at ttd 0,
    contained. One in or after the fault's phase is a catch."""
    early = [_part(0, [_alert(0, 3, "loss", [0])]), _part(1, [_inject(1, 3)], digest="x")]
    row = _row(GRAD_NAN, early + [_part(2), _part(3)])
    assert row.alerts == 1 and not row.detected and row.detect_step is None
    assert row.contained is False and row.detect_steps == {}
    same = [_part(0), _part(1, [_inject(1, 3), _alert(1, 3, "pre_allreduce", [1])], digest="x")]
    assert _row(GRAD_NAN, same + [_part(2), _part(3)]).detected
    weight = replace(_inject(2, 3), site="weight", model="scale")

    def struck_and(phase):
        return [_part(0), _part(1), _part(2, [weight, _alert(2, 3, phase, [2])], digest="x"),
                _part(3)]  # fmt: skip

    assert not _row(WEIGHT, struck_and("audit")).detected
    assert _row(WEIGHT, struck_and("consensus")).detected


def test_a_clean_trial_counts_each_detectors_merged_alerts():
    """The false positive rate is alerts in clean trials / clean trials, per detector
    (docs/design.md, section 5): the row keeps each check's count of alerts, merged per step
    and phase as `alerts` counts them, since `alert_detectors` says only which alerted."""
    parts = [
        _part(0, [_alert(0, 1, "pre_allreduce", [0], detector="a"),
                  _alert(0, 2, "pre_allreduce", [0], detector="a"),
                  _alert(0, 2, "consensus", [0], detector="b")]),
        _part(1, [_alert(1, 1, "pre_allreduce", [1], detector="a")]),
    ] + [_part(r) for r in (2, 3)]  # fmt: skip
    row = _row(FaultConfig(), parts)
    assert row.alerts == 3 and row.alert_detectors == ("a", "b")
    assert row.alert_counts == {"a": 2, "b": 1}
    assert _row(FaultConfig(), [_part(r) for r in range(4)]).alert_counts == {}


def test_noise_band_and_wilson():
    assert noise_band([Golden(0, 1.0, "a"), Golden(1, 1.3, "b"), Golden(2, 0.9, "c")]) == (
        pytest.approx(0.4)
    )
    # Reference values (Wilson 1927; as computed by statsmodels' proportion_confint).
    assert wilson(5, 5) == (pytest.approx(0.5655, abs=1e-4), 1.0)
    assert wilson(0, 10)[1] == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson(7, 20)
    assert (lo, hi) == (pytest.approx(0.1812, abs=1e-4), pytest.approx(0.5671, abs=1e-4))


def test_bit_classes():
    assert [bit_class("float32", b) for b in (31, 30, 23, 22)] == [
        "sign",
        "exponent_msb",
        "exponent",
        "mantissa",
    ]
    assert [bit_class("bfloat16", b) for b in (15, 14, 7, 6)] == [
        "sign",
        "exponent_msb",
        "exponent",
        "mantissa",
    ]
    assert bit_class("float32", "") == ""


def test_a_bit_is_classed_in_the_dtype_it_was_flipped_in(tmp_path):
    """Under bf16-mixed the workload's dtype is float32 and a Linear's output bfloat16: the
    exponent's top bit struck there is bit 14, which float32 would class as mantissa."""
    from tests.test_matmul_checksum import Rank

    run = compose_run(
        "campaign=single", "workload=gpt", "workload.precision=bf16-mixed", "topology.nodes=1",
        "fault.site=activation", "fault.model=bitflip", "fault.bit=exponent_msb",
        "fault.tensor=blocks.0.fc", "fault.ranks=[0]", "fault.steps=[1]",
    )  # fmt: skip
    fault = run.scenarios[0]
    rank = Rank(run, fault, seed=0)
    for step in range(2):
        rank.train(step)
    struck = [e for e in rank.log.events if isinstance(e, ElementInject) and e.fired]
    assert [(e.bit, e.dtype) for e in struck] == [(14, "bfloat16")]
    part = RankResult("t", 0, rank.log.events, [1.0], [0.01], 1.0, "x", True)
    row = trial_row(run, TrialSpec("t", 0, fault), [part], None, Golden(0, 1.0, "g"), 0.1)[0]
    assert (row.dtype, row.bit, row.bit_dtype) == ("float32", 14, "bfloat16")
    assert (row.precision, row.fault_phase) == ("bf16-mixed", None)
    assert row.fault_settings == "tensor=blocks.0.fc"  # a setting with no column of its own
    write_trials(tmp_path / "trials.csv", [row])
    assert load_trials([tmp_path])["bit_class"].tolist() == ["exponent_msb"]


@pytest.mark.parametrize(
    ("configured", "flipped", "cell"),
    [("exponent", 30, "exponent"), (None, 30, "exponent_msb"), (23, 23, "exponent")],
)
def test_a_trials_bit_class_is_its_scenarios(tmp_path, configured, flipped, cell):
    """A class draws a bit of it, which may belong to a narrower class too (bit 30 of float32 is
    the exponent's top bit): the trial stays in its scenario's cell, the class configured. Only
    a fault with no bit configured is classed by the bit it flipped."""
    fault = FaultConfig(site="grad", model="bitflip", bit=configured, ranks=(1,), steps=(3,))
    flip = replace(_inject(1, 3), bit=flipped, bits=[flipped], dtype="float32")
    row = _row(fault, [_part(0), _part(1, [flip], digest="x"), _part(2), _part(3)])
    assert (row.bit, row.bit_class) == (flipped, cell)
    write_trials(tmp_path / "trials.csv", [row])
    assert load_trials([tmp_path])["bit_class"].tolist() == [cell]


REDUCTION = FaultConfig(
    site="allreduce", model="scale", factor=1000.0, scope="reduction", ranks=(0,), steps=(3,)
)


@pytest.mark.parametrize(("suspects", "correct"), [([0, 1, 2, 3], False), ([0], True)])
def test_a_broken_reduction_is_attributed_to_the_node_it_names(suspects, correct):
    """Scope reduction models node N's reduction hardware (`fault.ranks=[N]`): every receiver
    gets the wrong sum, so every rank records a strike, but an alert naming every rank has not
    found the broken node."""
    struck = [replace(_inject(r, 3), site="allreduce") for r in range(4)]
    alert = _alert(1, 3, "post_allreduce", suspects)
    parts = [_part(r, [struck[r], *([alert] if r == 1 else [])], digest="x") for r in range(4)]
    row = _row(REDUCTION, parts)
    assert row.injected_ranks == (0, 1, 2, 3) and row.detected
    assert row.attribution_correct is correct


def test_each_checks_own_first_alert_is_judged_for_attribution():
    """The row's attribution is its first alert's: a later check that names healthy ranks (as
    megatron_hash does where rank 0 is wrong) left no trace in the row. `attributions` holds
    each check's own first alert's verdict, as `detect_steps` holds its step."""
    first = _alert(1, 3, "pre_allreduce", [1], detector="nan_inf")
    healthy = _alert(0, 9, "post_update", [0, 2, 3], detector="megatron_hash")
    named_late = _alert(1, 12, "post_update", [1], detector="megatron_hash")
    parts = [_part(0, [healthy]), _part(1, [_inject(1, 3), first, named_late], digest="x")]
    row = _row(GRAD_NAN, parts + [_part(2), _part(3)])
    assert (row.first_detector, row.attribution_correct) == ("nan_inf", True)
    assert row.attributions == {"megatron_hash": False, "nan_inf": True}
    assert row.detect_steps == {"megatron_hash": 9, "nan_inf": 3}
