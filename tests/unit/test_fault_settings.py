"""`FaultConfig.settings_text`, trials.csv's `fault_settings`: the settings that tell two
scenarios of one site, model and bit class apart where no column of their own does, written
exactly."""

from __future__ import annotations

from harness.config.schema import FaultConfig

GRAD = {"site": "grad", "model": "bitflip"}


def test_defaults_and_clean_trials_have_none():
    assert FaultConfig(**GRAD).settings_text() == ""
    assert FaultConfig(tensor="fc1.weight").settings_text() == ""  # clean: no fault at all


def test_numbers_keep_their_exact_shortest_form():
    """Two probabilities that %g prints alike are two scenarios."""
    texts = {
        FaultConfig(**GRAD, persistence="intermittent", probability=p).settings_text()
        for p in (0.1234567, 0.1234568)
    }
    assert texts == {"probability=0.1234567", "probability=0.1234568"}
    assert FaultConfig(**GRAD, ber=1e-07).settings_text() == "ber=1e-07"


def test_a_setting_the_fault_reads_is_written():
    """A campaign's faults hold no setting they would ignore (tests/test_config_errors.py):
    each that differs from its default tells a scenario apart."""
    several = FaultConfig(**GRAD, nbits=2, adjacent=False)
    assert several.settings_text() == "nbits=2 adjacent=False"
    stuck = FaultConfig(site="grad", model="stuck", stuck_at=1, bit=7)
    assert stuck.settings_text() == "stuck_at=1"


def test_settings_follow_one_order_and_a_models_own_come_last():
    fault = FaultConfig(**GRAD, nbits=2, tensor="fc1.weight", select="largest", elements=4)
    assert fault.settings_text() == "tensor=fc1.weight elements=4 select=largest nbits=2"


def test_two_schedules_are_two_scenarios():
    """A scheduled fault's steps are its entries', not `steps`: its entries tell it apart."""
    first = ({"step": 3, "tensor": "fc1.weight", "index": 4, "bit": 30},)
    second = ({"step": 3, "tensor": "fc1.weight", "index": 5, "bit": 30},)
    texts = [FaultConfig(**GRAD, schedule=s).settings_text() for s in (first, second, first)]
    assert texts[0] != texts[1] and texts[0] == texts[2]
    assert texts[0].startswith("schedule=1@")
