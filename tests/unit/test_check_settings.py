"""Each detector's settings (its nested `Config`, harness/core/checks.py's `CheckConfig`):
defaults, the keys it knows, the dotted key a bad value is reported under, `in_mode` and
`every`."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
from pathlib import Path

import pytest
import yaml

from harness.core.checks import MODES, CheckConfig
from harness.errors import ConfigError

NAMES = (
    "allreduce_sketch",
    "grad_stats",
    "megatron_hash",
    "nan_inf",
    "replay",
    "spiky_loss",
    "titan_replay",
    "weight_consensus",
)
SHIPPED = Path(__file__).resolve().parents[2] / "experiments" / "detectors"


def config_class(name: str) -> type[CheckConfig]:
    return importlib.import_module(f"detectors.{name}").DETECTOR.Config


def parse(name: str, **params) -> CheckConfig:
    return config_class(name).parse(f"detectors.{name}", params)


def parse_error(name: str, **params) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(name, **params)
    return info.value


# What every check shares


@pytest.mark.parametrize("name", NAMES)
def test_every_config_is_a_check_config_with_mode_first(name):
    cls = config_class(name)
    assert issubclass(cls, CheckConfig)
    assert [f.name for f in dataclasses.fields(cls)][0] == "mode"


@pytest.mark.parametrize("name", NAMES)
def test_empty_params_give_the_defaults_observing(name):
    config = parse(name)
    assert config == config_class(name)()
    assert config.mode == "observe" and not config.acts


@pytest.mark.parametrize("name", NAMES)
def test_defaults_match_the_shipped_detector_config(name):
    """experiments/detectors/NAME.yaml writes out every setting; parsed, it is the defaults."""
    shipped = yaml.safe_load((SHIPPED / f"{name}.yaml").read_text())[name]
    assert parse(name, **shipped) == config_class(name)()
    assert set(shipped) == {f.name for f in dataclasses.fields(config_class(name))}


@pytest.mark.parametrize("name", NAMES)
def test_unknown_key_is_named_under_the_check_and_lists_the_allowed_keys(name):
    error = parse_error(name, intervall=3)
    allowed = ", ".join(f.name for f in dataclasses.fields(config_class(name)))
    assert error.key == f"detectors.{name}.intervall"
    assert error.message == f"unknown key; allowed: {allowed}"


@pytest.mark.parametrize("name", NAMES)
def test_bad_mode_is_named_under_the_check(name):
    error = parse_error(name, mode="enforce")
    assert error.key == f"detectors.{name}.mode"
    assert error.message == f"'enforce' is not allowed; allowed: {', '.join(MODES)}"


@pytest.mark.parametrize("name", NAMES)
def test_in_mode_changes_only_the_mode(name):
    observing = parse(name)
    acting = observing.in_mode("act")
    assert acting.acts and not observing.acts
    assert {**acting.params(), "mode": "observe"} == observing.params()
    assert acting.in_mode("observe") == observing


@pytest.mark.parametrize("name", NAMES)
def test_in_mode_validates_the_mode(name):
    with pytest.raises(ConfigError):
        parse(name).in_mode("stop")


@pytest.mark.parametrize("name", NAMES)
def test_settings_are_frozen(name):
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse(name).mode = "act"


@pytest.mark.parametrize("name", NAMES)
def test_params_parse_back_to_the_same_settings_and_pickle(name):
    config = parse(name, mode="act")
    assert config_class(name).parse(f"detectors.{name}", config.params()) == config
    assert pickle.loads(pickle.dumps(config)) == config


def test_the_error_key_nests_under_any_given_key():
    with pytest.raises(ConfigError) as info:
        config_class("replay").parse("scenario.checks.replay", {"interval": 0})
    assert info.value.key == "scenario.checks.replay.interval"


# every: the audit interval


@pytest.mark.parametrize("name", ["allreduce_sketch", "grad_stats", "nan_inf", "spiky_loss",
                                  "titan_replay"])  # fmt: skip
def test_checks_without_an_interval_have_no_every(name):
    assert parse(name).every is None


@pytest.mark.parametrize("name", ["replay", "weight_consensus", "megatron_hash"])
def test_periodic_checks_report_their_interval(name):
    assert parse(name, interval=7).every == 7


def test_replay_at_listed_steps_has_no_every_and_every_5_by_default():
    assert parse("replay", steps=[3, 9]).every is None
    assert parse("replay").every == 5


def test_replay_refuses_an_interval_beside_listed_steps():
    """One of the two would be obeyed and the other silently ignored."""
    error = parse_error("replay", interval=7, steps=[3, 9])
    assert error.key == "detectors.replay.steps" and "one of interval and steps" in error.message


# replay


def test_replay_steps_take_ranges_and_are_stored_sorted_as_a_tuple():
    config = parse("replay", steps=["10:13", 2])
    assert config.steps == (2, 10, 11, 12)
    assert hash(config) == hash(parse("replay", steps=(2, 10, 11, 12)))


@pytest.mark.parametrize(
    ("params", "key", "message"),
    [
        ({"interval": 0}, "interval", "0 is out of range; allowed: 1..inf"),
        ({"interval": True}, "interval", "'True' is not an integer"),
        ({"interval": 2.0}, "interval", "'2.0' is not an integer"),
        ({"steps": [-1]}, "steps[0]", "-1 is out of range; allowed: 0..2147483647"),
        ({"steps": "a:b"}, "steps[0]", "'a:b' is not a range A:B or A:B:S"),
        ({"compare": "close"}, "compare", "'close' is not allowed; allowed: tolerant, exact"),
        ({"rtol": 0}, "rtol", "'0' must be in (0, 1), or null for the dtype's default"),
        ({"rtol": 1.0}, "rtol", "'1.0' must be in (0, 1), or null for the dtype's default"),
        ({"verdict": "vote"}, "verdict", "'vote' is not allowed; allowed: majority, megatron"),
    ],
)
def test_replay_bad_values_are_named_under_detectors_replay(params, key, message):
    error = parse_error("replay", **params)
    assert (error.key, error.message) == (f"detectors.replay.{key}", message)


def test_replay_accepts_a_tolerance_and_the_other_verdict():
    config = parse("replay", rtol=1e-3, verdict="megatron")
    assert (config.rtol, config.compare, config.verdict) == (1e-3, "tolerant", "megatron")
    config = parse("replay", compare="exact", verdict="megatron")
    assert (config.rtol, config.compare, config.verdict) == (None, "exact", "megatron")


def test_replay_refuses_a_tolerance_that_an_exact_comparison_never_reads():
    error = parse_error("replay", rtol=1e-3, compare="exact")
    assert error.key == "detectors.replay.rtol" and "only compare=tolerant" in str(error)


# the other checks' own settings


@pytest.mark.parametrize("field", ["threshold", "min_ratio", "spike"])
@pytest.mark.parametrize("value", [1, 0.5, True, "9"])
def test_grad_stats_ratios_must_be_numbers_above_one(field, value):
    error = parse_error("grad_stats", **{field: value})
    assert error.key == f"detectors.grad_stats.{field}"
    assert error.message == f"'{value}' must be a number > 1"


def test_grad_stats_stores_an_int_ratio_as_given():
    # The field is validated, not normalised: 3 stays the int the user wrote.
    assert parse("grad_stats", threshold=3).threshold == 3


@pytest.mark.parametrize(("params", "key"), [({"threshold": 1.0}, "threshold"),
                                             ({"samples": 0}, "samples")])  # fmt: skip
def test_spiky_loss_bad_values(params, key):
    assert parse_error("spiky_loss", **params).key == f"detectors.spiky_loss.{key}"


def test_titan_replay_every_step_is_minus_one():
    assert parse("titan_replay", num_steps=-1).num_steps == -1


@pytest.mark.parametrize(("params", "key"), [({"num_steps": 0}, "num_steps"),
                                             ({"num_steps": -2}, "num_steps"),
                                             ({"num_replays": 0}, "num_replays")])  # fmt: skip
def test_titan_replay_bad_values(params, key):
    assert parse_error("titan_replay", **params).key == f"detectors.titan_replay.{key}"


@pytest.mark.parametrize("value", [0, "yes", None])
def test_weight_consensus_optimizer_state_is_a_flag(value):
    error = parse_error("weight_consensus", optimizer_state=value)
    assert error.key == "detectors.weight_consensus.optimizer_state"
    assert error.message == f"'{value}' is not allowed; allowed: true, false"


@pytest.mark.parametrize("name", ["weight_consensus", "megatron_hash"])
def test_consensus_intervals_start_at_one(name):
    assert parse_error(name, interval=0).key == f"detectors.{name}.interval"


def test_allreduce_sketch_tolerance_is_a_fraction_or_null():
    assert parse("allreduce_sketch", rtol=1e-4).rtol == 1e-4
    assert parse_error("allreduce_sketch", rtol=2).key == "detectors.allreduce_sketch.rtol"
