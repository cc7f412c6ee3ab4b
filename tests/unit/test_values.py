"""harness/core/values.py: which values each check accepts, and the ConfigError (dotted key and
message) a bad one raises."""

from __future__ import annotations

import pytest

from harness.core.values import (
    above,
    choice,
    flag,
    fraction,
    int_list,
    integer,
    known_keys,
    positive,
)
from harness.errors import ConfigError


def _error(call, *args) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        call(*args)
    return info.value


def test_config_error_is_a_value_error_printed_as_key_colon_message():
    error = ConfigError("a.b", "what is allowed")
    assert isinstance(error, ValueError)
    assert (error.key, error.message, str(error)) == (
        "a.b",
        "what is allowed",
        "a.b: what is allowed",
    )


# choice


def test_choice_returns_an_allowed_value():
    assert choice("k", "act", ("observe", "act")) == "act"


def test_choice_names_the_value_and_every_allowed_one_in_order():
    error = _error(choice, "detectors.replay.compare", "fuzzy", ["tolerant", "exact"])
    assert error.key == "detectors.replay.compare"
    assert error.message == "'fuzzy' is not allowed; allowed: tolerant, exact"


def test_choice_is_case_sensitive():
    with pytest.raises(ConfigError):
        choice("k", "Act", ("observe", "act"))


# integer


@pytest.mark.parametrize("value", [0, -3, 2**40])
def test_integer_without_bounds_accepts_any_int(value):
    assert integer("k", value) == value


@pytest.mark.parametrize("value", [True, False])
def test_integer_rejects_a_bool_although_bool_subclasses_int(value):
    error = _error(integer, "k", value)
    assert (error.key, error.message) == ("k", f"'{value}' is not an integer")


@pytest.mark.parametrize("value", [1.0, 2.5, "3", None])
def test_integer_rejects_non_int(value):
    assert _error(integer, "k", value).message == f"'{value}' is not an integer"


def test_integer_bounds_are_inclusive():
    assert integer("k", 1, 1, 3) == 1
    assert integer("k", 3, 1, 3) == 3


def test_integer_out_of_range_names_both_bounds():
    assert _error(integer, "k", 4, 1, 3).message == "4 is out of range; allowed: 1..3"
    assert _error(integer, "k", 0, 1, 3).message == "0 is out of range; allowed: 1..3"


def test_integer_open_bounds_read_as_infinities():
    assert _error(integer, "k", 0, 1).message == "0 is out of range; allowed: 1..inf"
    assert _error(integer, "k", 9, None, 8).message == "9 is out of range; allowed: -inf..8"


def test_integer_low_bound_of_zero_is_a_bound():
    # 0 is falsy: a bound check written `if low and ...` would let -1 through.
    assert _error(integer, "k", -1, 0).message == "-1 is out of range; allowed: 0..inf"


# positive


@pytest.mark.parametrize(("value", "expected"), [(3, 3.0), (0.25, 0.25), (1e-300, 1e-300)])
def test_positive_returns_a_float(value, expected):
    result = positive("k", value)
    assert result == expected and type(result) is float


@pytest.mark.parametrize("value", [0, -1, -0.5, True, "2", None, float("nan")])
def test_positive_rejects_zero_negatives_bools_text_and_nan(value):
    error = _error(positive, "fault.factor", value)
    assert (error.key, error.message) == ("fault.factor", f"'{value}' must be a positive number")


# int_list


def test_int_list_takes_a_single_int_as_a_list_of_one():
    assert int_list("k", 7, 0, 10) == (7,)


def test_int_list_sorts_and_removes_duplicates():
    assert int_list("k", [5, 1, 5, 3], 0, 10) == (1, 3, 5)


def test_int_list_expands_a_to_b_as_a_half_open_range():
    assert int_list("k", "2:6", 0, 10) == (2, 3, 4, 5)


def test_int_list_expands_a_to_b_by_s():
    assert int_list("k", "0:20:5", 0, 100) == (0, 5, 10, 15)


def test_int_list_mixes_ranges_and_ints():
    assert int_list("k", ["8:10", 1, "0:3"], 0, 10) == (0, 1, 2, 8, 9)


@pytest.mark.parametrize("value", [[], (), None, {"a": 1}, 1.5])
def test_int_list_rejects_what_is_not_a_non_empty_list(value):
    error = _error(int_list, "fault.steps", value, 0, 9)
    assert error.key == "fault.steps"
    assert error.message == f"'{value}' must be a non-empty list of integers in 0..9"


@pytest.mark.parametrize("item", ["a", "1:x", "1:2:3:4", "0:10:0", ""])
def test_int_list_names_the_item_that_is_not_a_range(item):
    error = _error(int_list, "fault.steps", [1, item], 0, 9)
    assert error.key == "fault.steps[1]"
    assert error.message == f"'{item}' is not a range A:B or A:B:S"


def test_int_list_checks_each_item_as_an_integer_in_range():
    error = _error(int_list, "fault.ranks", [0, 12], 0, 7)
    assert (error.key, error.message) == ("fault.ranks[1]", "12 is out of range; allowed: 0..7")


def test_int_list_rejects_a_bool_item():
    assert _error(int_list, "k", [1, True], 0, 9).message == "'True' is not an integer"


def test_int_list_range_must_fit_the_bounds():
    with pytest.raises(ConfigError, match="out of range"):
        int_list("k", "5:12", 0, 10)


def test_int_list_rejects_a_range_that_is_empty():
    with pytest.raises(ConfigError):
        int_list("fault.steps", "5:1", 0, 10)


def test_int_list_refuses_a_string_that_is_not_a_range():
    """A quoted "5" is neither step 5 nor range(5): the key names it as no range."""
    error = _error(int_list, "fault.steps", "5", 0, 10)
    assert (error.key, error.message) == ("fault.steps[0]", "'5' is not a range A:B or A:B:S")


def test_int_list_error_index_names_the_users_item_after_a_range():
    error = _error(int_list, "k", ["0:3", 99], 0, 10)
    assert error.key == "k[1]"


# known_keys


def test_known_keys_accepts_a_subset():
    assert known_keys("workload.", {"steps": 3}, ["steps", "seed"]) is None
    assert known_keys("workload.", {}, ["steps", "seed"]) is None


def test_known_keys_names_the_prefixed_key_and_lists_the_allowed():
    error = _error(known_keys, "workload.", {"steps": 3, "sped": 1}, ["steps", "seed"])
    assert error.key == "workload.sped"
    assert error.message == "unknown key; allowed: steps, seed"


# flag


@pytest.mark.parametrize("value", [True, False])
def test_flag_accepts_bools(value):
    assert flag("k", value) is value


@pytest.mark.parametrize("value", [0, 1, "true", "yes", None])
def test_flag_rejects_ints_and_text(value):
    error = _error(flag, "detectors.weight_consensus.optimizer_state", value)
    assert error.key == "detectors.weight_consensus.optimizer_state"
    assert error.message == f"'{value}' is not allowed; allowed: true, false"


# fraction


@pytest.mark.parametrize("value", [1e-9, 0.5, 0.999])
def test_fraction_accepts_the_open_unit_interval(value):
    assert fraction("k", value) == value


def test_fraction_returns_a_float():
    assert type(fraction("k", 0.5)) is float


@pytest.mark.parametrize("value", [0, 1, 0.0, 1.0, -0.1, 2, True, "0.5", None])
def test_fraction_rejects_the_ends_outside_bools_and_text(value):
    assert _error(fraction, "k", value).message == f"'{value}' must be in (0, 1)"


def test_fraction_appends_what_to_its_message():
    error = _error(fraction, "detectors.replay.rtol", 1.5, ", or null for the dtype's default")
    assert error.message == "'1.5' must be in (0, 1), or null for the dtype's default"


# above


def test_above_is_strict():
    assert above("k", 1.0001, 1) == 1.0001
    assert _error(above, "k", 1, 1).message == "'1' must be a number > 1"


def test_above_returns_a_float_for_an_int():
    result = above("k", 8, 1)
    assert result == 8.0 and type(result) is float


@pytest.mark.parametrize("value", [True, "9", None, float("nan")])
def test_above_rejects_bools_text_and_nan(value):
    with pytest.raises(ConfigError):
        above("k", value, 1)


def test_above_formats_the_bound_compactly():
    assert _error(above, "k", 0.1, 0.5).message == "'0.1' must be a number > 0.5"
