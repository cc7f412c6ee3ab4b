"""harness/analysis/tables.py and intervals.py: Wilson intervals against the textbook formula,
the markdown the report writes, and catch rates, false positives and audit-interval outcomes
counted by hand on small tables of trials.csv's rows (harness/results/trial_row.py)."""

from __future__ import annotations

import math
from statistics import NormalDist

import pandas as pd
import pytest

from harness.analysis import report
from harness.analysis.intervals import (
    INTERVAL_COLUMNS,
    audit_intervals,
    interval_outcomes,
    pairs,
)
from harness.analysis.regress import cell_drops, new_blind_spots, uncompared_cells
from harness.analysis.tables import (
    ANY,
    TRIAL_SETS,
    Z95,
    bit_class,
    blind_spot,
    by_parallel,
    catch_counts,
    catch_rates,
    cell_stats,
    cells,
    detection_times,
    false_positive_counts,
    false_positives,
    markdown_table,
    own_attributions,
    per_trial,
    rate_text,
    sees_and_misses,
    wilson,
)
from harness.core.formats import classify_bit
from harness.results.schema import recovery_kinds
from tests.rows import frame


def textbook_wilson(k: int, n: int) -> tuple[float, float]:
    """(2np + z^2 -+ z sqrt(z^2 + 4np(1 - p))) / (2(n + z^2)), z the normal's 97.5% quantile."""
    z = NormalDist().inv_cdf(0.975)
    p = k / n
    root = z * math.sqrt(z * z + 4 * n * p * (1 - p))
    return ((2 * n * p + z * z - root) / (2 * (n + z * z)),
            (2 * n * p + z * z + root) / (2 * (n + z * z)))  # fmt: skip


# wilson


def test_z95_is_the_normals_two_sided_95_percent_quantile():
    assert NormalDist().inv_cdf(0.975) == pytest.approx(Z95, rel=1e-12)


@pytest.mark.parametrize(("k", "n"), [(0, 1), (1, 1), (0, 10), (5, 10), (10, 10), (3, 7),
                                      (1, 100), (99, 100), (250, 1000)])  # fmt: skip
def test_wilson_matches_the_textbook_formula(k, n):
    lo, hi = wilson(k, n)
    ref_lo, ref_hi = textbook_wilson(k, n)
    assert lo == pytest.approx(max(ref_lo, 0.0), abs=1e-12)
    assert hi == pytest.approx(min(ref_hi, 1.0), abs=1e-12)


def test_wilson_of_published_examples():
    """0/10: [0, 0.2775]; 5/10: [0.2366, 0.7634] (Wilson 1927; e.g. Newcombe 1998, table I)."""
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)


def test_wilson_mirrors_successes_and_failures():
    for k in range(8):
        lo, hi = wilson(k, 7)
        mirror_lo, mirror_hi = wilson(7 - k, 7)
        assert (lo, hi) == pytest.approx((1 - mirror_hi, 1 - mirror_lo), abs=1e-12)


def test_wilson_contains_the_rate_and_narrows_with_more_trials():
    widths = []
    for n in (10, 100, 1000):
        lo, hi = wilson(n // 5, n)
        assert lo < 0.2 < hi
        widths.append(hi - lo)
    assert widths == sorted(widths, reverse=True)


def test_wilson_stays_in_the_unit_interval_around_the_rate():
    for n in (1, 2, 5, 50):
        for k in range(n + 1):
            lo, hi = wilson(k, n)
            assert lo >= 0.0 and hi <= 1.0
            assert lo - 1e-15 <= k / n <= hi + 1e-15


@pytest.mark.parametrize(("k", "n"), [(0, 50), (10, 10)])
def test_wilson_of_all_or_nothing_reaches_zero_or_one_exactly(k, n):
    lo, hi = wilson(k, n)
    assert lo <= k / n <= hi


def test_wilson_of_no_trials_is_undefined():
    assert all(math.isnan(x) for x in wilson(0, 0))


# rate_text, markdown_table


def test_rate_text_shows_count_rate_and_interval_in_percent():
    lo, hi = textbook_wilson(3, 10)
    assert rate_text(3, 10) == f"3/10 = 30% [{round(lo * 100)}%, {round(hi * 100)}%]"
    assert rate_text(0, 10) == "0/10 = 0% [0%, 28%]"
    assert rate_text(10, 10) == "10/10 = 100% [72%, 100%]"
    # A bound that whole percent would print as 0% or 100% is neither: the digits it needs.
    assert rate_text(0, 1920) == "0/1920 = 0% [0%, 0.2%]"
    assert rate_text(1919, 1920) == "1919/1920 = 99.9% [99.7%, 99.99%]"


def test_rate_text_of_no_trials():
    assert rate_text(0, 0) == "n=0"


def test_markdown_table_has_a_header_a_rule_and_a_line_per_row_in_the_first_rows_order():
    table = markdown_table([{"detector": "replay", "n": 3}, {"n": 4, "detector": "nan_inf"}])
    assert table == ("| detector | n |\n|---|---|\n| replay | 3 |\n| nan_inf | 4 |\n")


def test_markdown_table_of_no_rows():
    assert markdown_table([]) == "_none_\n"


# blind_spot: harmful trials whose catch rate's 95% upper bound is below 50%


def test_no_harmful_trials_is_no_blind_spot():
    assert not blind_spot((0, 0))


def test_three_uncaught_harmful_trials_are_too_few_to_call_a_blind_spot():
    """0/3's upper bound is 56% (textbook formula); 0/4's is 49%."""
    assert textbook_wilson(0, 3)[1] > 0.5 > textbook_wilson(0, 4)[1]
    assert not blind_spot((0, 3))
    assert blind_spot((0, 4))


@pytest.mark.parametrize(("k", "n"), [(1, 10), (2, 10), (3, 10), (5, 10), (10, 10), (8, 40)])
def test_blind_spot_is_an_upper_bound_below_half(k, n):
    assert blind_spot((k, n)) == (textbook_wilson(k, n)[1] < 0.5)


# bit classes of the `bit` column


@pytest.mark.parametrize(("dtype", "bit", "expected"), [
    ("float32", 31, "sign"), ("float32", 30, "exponent_msb"), ("float32", 23, "exponent"),
    ("float32", 22, "mantissa"), ("float32", "30", "exponent_msb"), ("float32", 29.0, "exponent"),
    ("bfloat16", 15, "sign"), ("bfloat16", 7, "exponent"), ("bfloat16", 6, "mantissa"),
    ("float16", 14, "exponent_msb"), ("float16", 10, "exponent"), ("float16", 9, "mantissa"),
    ("float64", 62, "exponent_msb"), ("float64", 52, "exponent"),
    ("float32", "mantissa", "mantissa"), ("float32", "", ""), ("float32", None, ""),
    ("float32", math.nan, ""),
])  # fmt: skip
def test_bit_class_of_a_configured_bit(dtype, bit, expected):
    """A bit read back from trials.csv may be an int, its text, or a float (a column with blanks);
    a class stays itself; a blank stays blank."""
    assert bit_class(dtype, bit) == expected


def test_a_bit_outside_the_format_has_no_class():
    with pytest.raises(ValueError):
        classify_bit("float16", 16)


def test_recovery_kinds_lists_each_recovery_and_skips_a_failure():
    verdict = "retry at step 3; rollback to step 2 (quarantine none); gave up at step 9"
    assert recovery_kinds(verdict) == ["retry", "rollback"]
    assert recovery_kinds("rollback+quarantine at step 4") == ["rollback+quarantine"]
    assert recovery_kinds("") == []


# catch rates and false positives on a hand-built table


def trials(*rows: dict) -> pd.DataFrame:
    """Rows of trials.csv as load_trials leaves them (the cells not given: a trial that did not
    fire, at site grad)."""
    return frame(*rows)


BOTH = "nan_inf;replay"
TABLE = trials(
    # 1-2: harmful; replay catches one, the other escapes
    {"fired": True, "effect": "harmful", "detected": True, "detectors": BOTH,
     "detected_by": "replay"},
    {"fired": True, "effect": "harmful", "detected": False, "detectors": BOTH},
    # 3: benign, caught by nan_inf
    {"fired": True, "effect": "benign", "detected": True, "detectors": BOTH,
     "detected_by": "nan_inf"},
    # 4: masked, missed
    {"fired": True, "effect": "masked", "detected": False, "detectors": BOTH},
    # 5: harmful, caught by nan_inf in a run where replay was off
    {"fired": True, "effect": "harmful", "detected": True, "detectors": "nan_inf",
     "detected_by": "nan_inf"},
    # 6: an injection that never fired: in no trial set, whatever it says
    {"fired": False, "effect": "masked", "detected": True, "detectors": BOTH,
     "detected_by": "replay"},
    # 7-8: clean trials; replay alerts in one, nan_inf in none
    {"site": "none", "detectors": BOTH, "alerts": 1, "alert_detectors": "replay",
     "alert_counts": "replay=1"},
    {"site": "none", "detectors": "nan_inf"},
)  # fmt: skip


def test_catch_counts_per_trial_set_and_detector():
    assert catch_counts(TABLE) == {
        "all fired": {ANY: (3, 5), "nan_inf": (2, 5), "replay": (1, 4)},
        "non-masked": {ANY: (3, 4), "nan_inf": (2, 4), "replay": (1, 3)},
        "harmful": {ANY: (2, 3), "nan_inf": (1, 3), "replay": (1, 2)},
    }


def test_catch_rates_are_the_counts_as_rate_text():
    rows = catch_rates(TABLE)
    assert [r["trials"] for r in rows] == list(TRIAL_SETS)
    harmful = rows[2]
    assert harmful == {"trials": "harmful", ANY: rate_text(2, 3), "nan_inf": rate_text(1, 3),
                       "replay": rate_text(1, 2)}  # fmt: skip


def test_a_detector_name_inside_another_is_not_credited():
    table = trials({"fired": True, "effect": "harmful", "detected": True,
                    "detectors": "replay;titan_replay", "detected_by": "titan_replay"})  # fmt: skip
    counts = catch_counts(table)["harmful"]
    assert counts == {ANY: (1, 1), "replay": (0, 1), "titan_replay": (1, 1)}


def test_false_positives_count_clean_trials_where_each_detector_ran():
    assert false_positive_counts(TABLE) == {"nan_inf": (0, 2), "replay": (1, 1)}
    assert false_positives(TABLE) == [
        {"detector": "nan_inf", "clean trials with an alert": rate_text(0, 2),
         "alerts per clean trial": "0/2 = 0"},
        {"detector": "replay", "clean trials with an alert": rate_text(1, 1),
         "alerts per clean trial": "1/1 = 1"},
    ]  # fmt: skip


def test_false_positives_count_clean_trials_with_an_alert_and_the_total_reads_as_alerts():
    """A clean trial is one Bernoulli outcome, so five alerts in one trial count once in k/n;
    the total over all detectors is a count of alerts, printed as one, not as k/n."""
    noisy = {"site": "none", "detectors": "nan_inf", "alerts": 5, "alert_detectors": "nan_inf"}
    quiet = [{"site": "none", "detectors": "nan_inf"}] * 9
    table = trials(noisy, *quiet)
    assert false_positive_counts(table) == {"nan_inf": (1, 10)}
    assert per_trial(table) == "5 alerts in 10 clean trials"
    assert per_trial(trials(noisy)) == "5 alerts in 1 clean trial"
    assert per_trial(TABLE) == "1 alert in 2 clean trials"


def test_false_positive_rate_is_each_detectors_alerts_over_its_clean_trials():
    """docs/design.md section 5: alerts in clean trials / clean trials, per detector, beside
    the share of clean trials with an alert: five alerts of nan_inf in one of ten clean trials
    are 0.5 per clean trial, where k/n counts that trial once. A table written before the
    per-check counts, whose trial alerted, cannot give it: a dash."""
    noisy = {"site": "none", "detectors": BOTH, "alerts": 6,
             "alert_detectors": BOTH, "alert_counts": "nan_inf=5;replay=1"}  # fmt: skip
    quiet = [{"site": "none", "detectors": BOTH}] * 9
    rows = false_positives(trials(noisy, *quiet))
    assert [r["alerts per clean trial"] for r in rows] == ["5/10 = 0.5", "1/10 = 0.1"]
    assert rows[0]["clean trials with an alert"] == rate_text(1, 10)
    older = {**noisy, "alert_counts": ""}
    assert [r["alerts per clean trial"] for r in false_positives(trials(older, *quiet))] == [
        "-",
        "-",
    ]
    assert false_positives(trials(*quiet))[0]["alerts per clean trial"] == "0/9 = 0"


def test_no_fired_trials_give_empty_counts():
    counts = catch_counts(trials({"site": "none", "detectors": "nan_inf"}))
    assert counts["all fired"] == {ANY: (0, 0), "nan_inf": (0, 0)}
    assert catch_rates(trials({"site": "none", "detectors": "nan_inf"}))[0][ANY] == "n=0"


# intervals: check_intervals and detect_steps


def test_pairs_reads_name_equals_value_lists():
    assert pairs("replay=5;weight_consensus=10") == {"replay": 5, "weight_consensus": 10}
    assert pairs("replay=0") == {"replay": 0}


@pytest.mark.parametrize("blank", ["", math.nan, None])
def test_pairs_of_a_blank_is_empty(blank):
    assert pairs(blank) == {}


def test_interval_outcomes_one_row_per_fired_trial_and_periodic_check():
    table = trials(
        {"fired": True, "inject_step": 3, "persistence": "transient",
         "check_intervals": "replay=5;weight_consensus=10", "detect_steps": "replay=5"},
        {"fired": True, "inject_step": 2, "persistence": "permanent",
         "check_intervals": "replay=2", "detect_steps": "nan_inf=2;replay=4"},
        {"fired": False, "inject_step": "", "check_intervals": "replay=5"},
        {"fired": True, "inject_step": 1, "check_intervals": "", "detect_steps": "nan_inf=1"},
    )  # fmt: skip
    got = interval_outcomes(table)
    assert list(got.columns) == INTERVAL_COLUMNS
    rows = [tuple(r) for r in got.itertuples(index=False)]
    assert {r[:3] for r in rows} == {("mlp", "float32", "")}  # what each trial ran on
    assert rows[0][3:] == ("replay", 5, "transient", True, 2)
    assert rows[1][3:7] == ("weight_consensus", 10, "transient", False)
    assert math.isnan(rows[1][7])
    assert rows[2][3:] == ("replay", 2, "permanent", True, 2)
    assert len(rows) == 3


def test_an_audit_interval_sweep_over_workloads_keeps_each_workloads_rate():
    """replay every 5 steps catches the mlp's faults and none of the gpt's: over both, 2/4
    at each interval would be neither workload's."""
    audited = {"fired": True, "inject_step": 10, "persistence": "transient"}
    table = trials(*(
        dict(audited, workload=workload, check_intervals=f"replay={k}",
             detect_steps="replay=10" if workload == "mlp" else "")
        for workload in ("mlp", "gpt") for k in (5, 10) for _ in range(2)
    ))  # fmt: skip
    rows = audit_intervals(table)
    assert [(r["workload"], r["interval"], r["caught"]) for r in rows] == [
        ("gpt", 5, rate_text(0, 2)),
        ("gpt", 10, rate_text(0, 2)),
        ("mlp", 5, rate_text(2, 2)),
        ("mlp", 10, rate_text(2, 2)),
    ]
    assert list(rows[0])[:2] == ["workload", "check"]
    # One workload's table keeps its shape.
    assert list(audit_intervals(table[table["workload"] == "mlp"])[0])[0] == "check"


def test_markdown_table_escapes_a_bar_inside_a_cell():
    table = markdown_table([{"check": "replay", "overrides": "a|b"}])
    assert table.splitlines()[2] == "| replay | a\\|b |"


# scenario cells across dtypes and workloads


def classed(*rows: dict) -> pd.DataFrame:
    """Rows framed with their bit class, as load_trials adds it."""
    table = trials(*rows)
    configured = zip(table["dtype"], table["bit"], strict=True)
    table["bit_class"] = [bit_class(d, b) for d, b in configured]
    return table


FLIP = {"fired": True, "effect": "harmful", "model": "bitflip", "detectors": "nan_inf"}
# Exponent bits of each dtype: every float32 flip escapes, every bfloat16 flip is caught.
F32_MISSED = [dict(FLIP, dtype="float32", bit=27)] * 5
BF16_CAUGHT = [dict(FLIP, dtype="bfloat16", bit=11, detected=True, detected_by="nan_inf")] * 5
CELL_COLUMNS = ["catch rate (fired)", "catch rate (harmful or latent)", "effects", "blind spot"]


def test_a_dtype_sweep_keeps_each_dtypes_cell_and_its_blind_spot_apart():
    """A bit class names different bits in each dtype: merged, 0/5 and 5/5 read as 5/10 and
    the float32 blind spot disappears."""
    rows = cells(classed(*F32_MISSED, *BF16_CAUGHT))
    assert [list(r)[:4] for r in rows] == [["site", "model", "dtype", "bit class"]] * 2
    by_dtype = {r["dtype"]: r for r in rows}
    assert by_dtype["float32"]["catch rate (harmful or latent)"] == rate_text(0, 5)
    assert by_dtype["float32"]["blind spot"] == "**yes**"
    assert by_dtype["bfloat16"]["blind spot"] == "no"
    names = {c.name for c in cell_stats(classed(*F32_MISSED, *BF16_CAUGHT))}
    assert names == {"grad / bitflip / mlp / float32 / exponent",
                     "grad / bitflip / mlp / bfloat16 / exponent"}  # fmt: skip


def test_a_workload_sweep_keeps_each_workloads_cell_apart():
    table = classed(*F32_MISSED, *(dict(r, workload="llama") for r in F32_MISSED[:2]))
    rows = cells(table)
    assert [(r["workload"], r["catch rate (fired)"]) for r in rows] == [
        ("llama", rate_text(0, 2)),
        ("mlp", rate_text(0, 5)),
    ]
    assert list(rows[0])[:4] == ["site", "model", "workload", "bit class"]


def test_a_single_dtype_campaigns_cells_keep_their_columns():
    rows = cells(classed(*F32_MISSED))
    assert [list(r) for r in rows] == [["site", "model", "bit class", *CELL_COLUMNS]]
    assert rows[0]["blind spot"] == "**yes**"
    assert [c.name for c in cell_stats(classed(*F32_MISSED))] == [
        "grad / bitflip / mlp / float32 / exponent"
    ]


def test_what_each_detector_sees_is_split_by_dtype_only_in_a_dtype_sweep():
    rows = sees_and_misses(classed(*F32_MISSED, *BF16_CAUGHT))
    assert [(r["dtype"], r["nan_inf"]) for r in rows] == [
        ("bfloat16", rate_text(5, 5)),
        ("float32", rate_text(0, 5)),
    ]
    single = sees_and_misses(classed(*F32_MISSED))
    assert [list(r) for r in single] == [
        ["site", "model", "scope", "persistence", "bit class", "nan_inf", "harmful"]
    ]


def test_sdc_regress_finds_a_blind_spot_that_a_dtype_sweep_gained():
    """sdc-regress compares the same cells the report prints."""
    caught = [dict(r, detected=True, detected_by="nan_inf") for r in F32_MISSED]
    before = classed(*caught, *BF16_CAUGHT)
    after = classed(*F32_MISSED, *BF16_CAUGHT)
    found = new_blind_spots(before, after)
    assert [f["where"] for f in found] == [
        "grad / bitflip / mlp / float32 / exponent, harmful or latent trials"
    ]


# scenario cells across a fault's settings

SCALE = {"fired": True, "effect": "harmful", "model": "scale", "detectors": "nan_inf"}
# x10 escapes every time, x1e6 overflows to inf and nan_inf catches it.
X10_MISSED = [dict(SCALE, factor=10.0)] * 5
X1E6_CAUGHT = [dict(SCALE, factor=1e6, detected=True, detected_by="nan_inf")] * 5


def test_scenarios_of_other_factors_keep_their_cells_and_blind_spots_apart():
    """Merged, x10's 0/5 and x1e6's 5/5 read as 5/10 and x10's blind spot disappears (as in
    the default campaign, whose grad scale runs both)."""
    rows = cells(classed(*X10_MISSED, *X1E6_CAUGHT))
    assert [list(r)[:4] for r in rows] == [["site", "model", "factor", "bit class"]] * 2
    by_factor = {r["factor"]: r for r in rows}
    assert set(by_factor) == {"10", "1e+06"}
    assert by_factor["10"]["blind spot"] == "**yes**"
    assert by_factor["1e+06"]["catch rate (harmful or latent)"] == rate_text(5, 5)
    names = {c.name for c in cell_stats(classed(*X10_MISSED, *X1E6_CAUGHT))}
    assert names == {
        "grad / scale / mlp / float32 / x10",
        "grad / scale / mlp / float32 / x1e+06",
    }
    seen = sees_and_misses(classed(*X10_MISSED, *X1E6_CAUGHT))
    assert [(r["factor"], r["nan_inf"]) for r in seen] == [
        ("10", rate_text(0, 5)),
        ("1e+06", rate_text(5, 5)),
    ]


def test_persistences_and_values_each_keep_a_cell():
    nan = dict(FLIP, model="value", bit="", value="nan", detected=True, detected_by="nan_inf")
    table = classed(
        *[dict(nan, persistence="transient")] * 2,
        *[dict(nan, persistence="permanent")] * 3,
        *[dict(FLIP, model="value", bit="", value="random", persistence="transient")] * 4,
    )
    rows = cells(table)
    assert [(r["persistence"], r["value"], r["catch rate (fired)"]) for r in rows] == [
        ("permanent", "nan", rate_text(3, 3)),
        ("transient", "nan", rate_text(2, 2)),
        ("transient", "random", rate_text(0, 4)),
    ]
    # A blank setting is no part of a cell's name: a fault with no value beside ones with one.
    mixed = classed(*F32_MISSED, nan, dict(nan, value="inf"))
    names = {c.name for c in cell_stats(mixed)}
    assert names == {
        "grad / bitflip / mlp / float32 / exponent",
        "grad / value / mlp / float32 / value nan",
        "grad / value / mlp / float32 / value inf",
    }


def test_what_each_detector_sees_keeps_each_bit_class_apart():
    """Nightly's grad bitflip read replay 193/240 over four classes that it catches from 23% to
    100% of the time: each class is a scenario of its own."""
    caught = [dict(FLIP, bit=3, detected=True, detected_by="nan_inf")] * 3
    rows = sees_and_misses(classed(*F32_MISSED, *caught))
    assert [(r["bit class"], r["nan_inf"]) for r in rows] == [
        ("exponent", rate_text(0, 5)),
        ("mantissa", rate_text(3, 3)),
    ]


def test_factors_that_print_alike_keep_their_cells():
    """%g prints x1.000001 and x1.000002 as "1": each keeps its exact shortest form."""
    rows = cells(classed(*[dict(r, factor=1.000001) for r in X10_MISSED],
                         *[dict(r, factor=1.000002) for r in X1E6_CAUGHT]))  # fmt: skip
    assert [(r["factor"], r["blind spot"]) for r in rows] == [
        ("1.000001", "**yes**"),
        ("1.000002", "no"),
    ]


def test_sdc_regress_matches_a_cell_when_the_current_run_adds_a_scenario_beside_it():
    """A cell's key holds every setting, blank or not, whatever else each run varies: a current
    run that adds x10 beside x1e6 still compares its x1e6 cell with the baseline's."""
    before = classed(*X1E6_CAUGHT)
    fell = [dict(r, detected=False, detected_by="") for r in X1E6_CAUGHT]
    after = classed(*fell, *X10_MISSED)
    assert [f["where"] for f in cell_drops(before, after)] == [
        "grad / scale / mlp / float32 / x1e+06, catch rate (fired)",
        "grad / scale / mlp / float32 / x1e+06, catch rate (harmful or latent)",
    ]
    assert uncompared_cells(before, after) == []
    # A run without the baseline's x1e6 compares nothing of it, and says so.
    assert uncompared_cells(before, classed(*X10_MISSED)) == [
        "grad / scale / mlp / float32 / x1e+06"
    ]
    blind = new_blind_spots(before, after)
    assert sorted((f["where"], f["baseline"]) for f in blind) == [
        ("grad / scale / mlp / float32 / x10, harmful or latent trials", "not in baseline"),
        ("grad / scale / mlp / float32 / x1e+06, harmful or latent trials", rate_text(5, 5)),
    ]


def test_a_step_between_audits_and_a_field_mix_class_each_keep_a_cell():
    """nightly's x1000 at step 10 (a replay audit) and at step 12 (between audits) read 68/120
    merged, 60/60 and 8/60 apart; a field mix's classes are its own scenarios too."""
    audited = [dict(r, fault_steps="10") for r in X1E6_CAUGHT]
    between = [dict(r, factor=1e6, fault_steps="12") for r in X10_MISSED]
    rows = cells(classed(*audited, *between))
    assert [(r["fault steps"], r["catch rate (fired)"]) for r in rows] == [
        ("10", rate_text(5, 5)),
        ("12", rate_text(0, 5)),
    ]
    mixed = [dict(r, fault_class="flip1") for r in X1E6_CAUGHT]
    mixed += [dict(r, factor=1e6, fault_class="flip_multi") for r in X10_MISSED]
    rows = cells(classed(*mixed))
    assert [(r["fault class"], r["blind spot"]) for r in rows] == [
        ("flip1", "no"),
        ("flip_multi", "**yes**"),
    ]


def test_the_parallelism_table_keeps_each_scenario_apart():
    """x10 and x1e6 under ddp and fsdp: a row each, as the cells have, not 5/10 under each."""
    table = classed(*X10_MISSED, *X1E6_CAUGHT,
                    *(dict(r, parallel="fsdp") for r in [*X10_MISSED, *X1E6_CAUGHT]))  # fmt: skip
    rows = by_parallel(table)
    assert [(r["factor"], r["ddp"], r["fsdp"]) for r in rows] == [
        ("10", rate_text(0, 5), rate_text(0, 5)),
        ("1e+06", rate_text(5, 5), rate_text(5, 5)),
    ]
    assert list(rows[0])[:5] == ["site", "model", "dtype", "factor", "detector"]
    # A precision sweep (one dtype, float32, for both) keeps each precision's row too.
    plain = [dict(r, precision="32-true", factor=10.0) for r in X10_MISSED]
    mixed = [dict(r, precision="bf16-mixed", factor=10.0) for r in X1E6_CAUGHT]
    both = [*plain, *mixed, *(dict(r, parallel="fsdp") for r in [*plain, *mixed])]
    rows = by_parallel(classed(*both))
    assert [(r["precision"], r["ddp"]) for r in rows] == [
        ("32-true", rate_text(0, 5)),
        ("bf16-mixed", rate_text(5, 5)),
    ]


def test_a_fault_one_parallelism_never_ran_reads_no_trials_not_not_run():
    """`not run`: the check did not run beside that fault there (it does not exist under that
    parallelism, or the run left it out); `no trials`: the runs under it held no such fault. A
    ddp run without the fsdp run's x1e6 fault read `not run`, as if the check did not apply."""
    ddp = [dict(r, detectors="grad_stats;nan_inf") for r in [*X10_MISSED, *X1E6_CAUGHT]]
    rows = by_parallel(classed(*ddp, *(dict(r, parallel="fsdp") for r in X10_MISSED)))
    assert [(r["factor"], r["detector"], r["ddp"], r["fsdp"]) for r in rows] == [
        ("10", "grad_stats", rate_text(0, 5), "not run"),
        ("10", "nan_inf", rate_text(0, 5), rate_text(0, 5)),
        ("1e+06", "grad_stats", rate_text(0, 5), "no trials"),
        ("1e+06", "nan_inf", rate_text(5, 5), "no trials"),
    ]


def test_a_table_without_the_precision_column_beside_one_with_it_is_told_apart():
    """A report merging a job written before `precision` existed with one written after: the
    blank and 32-true cells are two, and the table shows why."""
    rows = cells(classed(*X10_MISSED, *[dict(r, precision="32-true") for r in X10_MISSED]))
    assert [r["precision"] for r in rows] == ["-", "32-true"]


def test_a_precision_sweep_and_a_products_phase_each_keep_a_cell():
    """bf16-mixed keeps float32 weights (the `dtype` column) and computes in bfloat16: a sweep
    over precision is two scenarios, as x2 on a product in forward and in backward are."""
    plain = [dict(r, precision="32-true") for r in X10_MISSED]
    mixed = [dict(r, factor=10.0, precision="bf16-mixed") for r in X1E6_CAUGHT]
    rows = cells(classed(*plain, *mixed))
    assert [(r["precision"], r["blind spot"]) for r in rows] == [
        ("32-true", "**yes**"),
        ("bf16-mixed", "no"),
    ]
    product = {"site": "matmul", "model": "scale", "factor": 2.0}
    forward = [dict(r, **product, fault_phase="forward") for r in X1E6_CAUGHT]
    backward = [dict(r, **product, fault_phase="backward") for r in X10_MISSED]
    rows = cells(classed(*forward, *backward))
    assert [(r["fault phase"], r["catch rate (fired)"]) for r in rows] == [
        ("backward", rate_text(0, 5)),
        ("forward", rate_text(5, 5)),
    ]


def test_a_defective_units_rates_and_a_reductions_riders_each_keep_a_cell():
    """field_mix's defective unit striking 1% and 10% of the products, and blind_spots' x1000
    on a reduction of the gradients and on one of the sketch's riders, differ only in settings
    that no column of their own holds: each pair read as one cell."""
    unit = {"site": "matmul", "model": "defective_unit", "factor": ""}
    rare = [dict(r, **unit) for r in X10_MISSED]
    often = [dict(r, **unit, fault_settings="rate=0.1") for r in X1E6_CAUGHT]
    rows = cells(classed(*rare, *often))
    assert [(r["fault settings"], r["blind spot"]) for r in rows] == [
        ("-", "**yes**"),
        ("rate=0.1", "no"),
    ]
    assert {c.name for c in cell_stats(classed(*rare, *often))} == {
        "matmul / defective_unit / mlp / float32",
        "matmul / defective_unit / mlp / float32 / rate=0.1",
    }


def test_a_setting_that_differs_between_sites_keeps_its_column():
    """nightly's x10 at the loss and x1000 at the gradients: one value per site and model, two
    in the table, whose cells then say which factor each is."""
    loss = [dict(r, site="loss", factor=10.0) for r in X10_MISSED]
    grad = [dict(r, factor=1000.0) for r in X1E6_CAUGHT]
    rows = cells(classed(*loss, *grad))
    assert [(r["site"], r["factor"]) for r in rows] == [("grad", "1000"), ("loss", "10")]


def test_clean_trials_add_no_setting_column():
    """A clean trial has no steps (a blank cell): the default campaign's faults, all at step
    10, keep a table without a `fault steps` column."""
    faults = [dict(r, fault_steps="10") for r in F32_MISSED]
    rows = cells(classed(*faults, {"site": "none", "fault_steps": ""}))
    assert [list(r) for r in rows] == [["site", "model", "bit class", *CELL_COLUMNS]]


def test_the_crash_model_is_left_out_of_every_catch_rate_and_said():
    """A process taken down is no silent corruption: no check can catch or miss it. Two crash
    trials beside five NaN gradients nan_inf caught made its rate 5/7 and a 'grad / crash'
    cell of 0/2; the plan already left them out."""
    nan = dict(site="grad", model="value", value="nan", fired="True", effect="harmful",
               detectors="nan_inf", detected="True", detected_by="nan_inf")  # fmt: skip
    crash = dict(site="grad", model="crash", value="raise", fired="True", effect="crash",
                 detectors="nan_inf")  # fmt: skip
    # A crash a check saw (say, the NaN a dying rank left behind) is still no catch to time.
    seen = dict(crash, detected="True", detected_by="nan_inf", first_detector="nan_inf",
                ttd_steps="9")  # fmt: skip
    caught = dict(nan, first_detector="nan_inf", ttd_steps="0")
    df = frame(*(dict(caught, trial_id=f"n{i}") for i in range(5)),
               *(dict(crash, trial_id=f"c{i}") for i in range(2)),
               dict(seen, trial_id="c2"))  # fmt: skip
    counts = catch_counts(df)
    assert counts["all fired"]["nan_inf"] == (5, 5) and counts["non-masked"][ANY] == (5, 5)
    [times] = detection_times(df)
    assert times["n"] == 5 and times["ttd steps (median / max)"] == "0 / 0"
    assert [c.model for c in cell_stats(df)] == ["value"]
    assert {r["model"] for r in sees_and_misses(df)} == {"value"}
    assert report.effects_line(df) == (
        "crash 3, harmful 5; 3 trials of the crash model left out of the catch rates "
        "(a process taken down, no silent corruption)"
    )


def test_each_checks_own_attribution_is_tabulated_first_or_not():
    """megatron_hash never alerts first in these trials, yet it names healthy ranks in one of
    its two catches: the first detector's table cannot show that; this one does."""
    caught = dict(site="grad", model="scale", fired="True", effect="harmful", detected="True",
                  detectors="nan_inf;megatron_hash", first_detector="nan_inf")  # fmt: skip
    df = frame(
        dict(caught, trial_id="a", detected_by="megatron_hash;nan_inf",
             attributions="megatron_hash=False;nan_inf=True"),
        dict(caught, trial_id="b", detected_by="megatron_hash;nan_inf",
             attributions="megatron_hash=True;nan_inf=True"),
        dict(caught, trial_id="c", detected_by="nan_inf", attributions="nan_inf=True"),
        dict(caught, trial_id="d", detected="False", detected_by="", attributions=""),
    )  # fmt: skip
    assert own_attributions(df) == [
        {"detector": "megatron_hash", "its first alert names the culprits alone": rate_text(1, 2)},
        {"detector": "nan_inf", "its first alert names the culprits alone": rate_text(3, 3)},
    ]
