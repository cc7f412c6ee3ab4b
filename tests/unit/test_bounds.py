"""The tolerances derived from rounding: replay's `derived_rtol` and `agree`, and the allreduce
sketch's `sum_rounding` and `tolerance`; expectations follow the formulas in the docstrings of
detectors/replay.py and detectors/allreduce_sketch.py, computed here from first principles
(the unit roundoff is half the dtype's epsilon: 2^-8 bfloat16, 2^-11 float16, 2^-24 float32)."""

from __future__ import annotations

import math

import pytest
import torch

from detectors.allreduce_sketch import project, step_weights, sum_rounding, tolerance
from detectors.fingerprint import signs
from detectors.replay import agree, derived_rtol, triple

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
# Subnormal spacing: the smallest positive subnormal of each format.
SUBNORMAL = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}

# replay: Z * sqrt(2 * ROUNDINGS / 3) * u, with Z = 6 and 8 roundings


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
def test_derived_rtol_is_six_sigma_of_eight_roundings_on_two_replicas(dtype):
    sigma = math.sqrt(2 * 8) * UNIT_ROUNDOFF[dtype] / math.sqrt(3)  # uniform in [-u, u]: u/sqrt3
    assert derived_rtol(dtype) == pytest.approx(6 * sigma, rel=1e-12, abs=0)


def test_derived_rtol_values_quoted_in_the_docstring():
    assert derived_rtol(torch.bfloat16) == pytest.approx(5.4e-2, abs=5e-4)
    assert derived_rtol(torch.float16) == pytest.approx(6.8e-3, abs=5e-5)


def test_derived_rtol_is_proportional_to_the_unit_roundoff():
    assert derived_rtol(torch.bfloat16) / derived_rtol(torch.float16) == pytest.approx(8)
    assert derived_rtol(torch.float16) / derived_rtol(torch.float32) == pytest.approx(2**13)


def test_derived_rtol_orders_the_dtypes_by_precision():
    ranked = [derived_rtol(d) for d in (torch.float64, torch.float32, torch.float16,
                                        torch.bfloat16)]  # fmt: skip
    assert ranked == sorted(ranked) and len(set(ranked)) == 4


def test_derived_bfloat16_rtol_clears_the_measured_clean_spread():
    """Calibrated clean bfloat16 replays differ by up to 1.1e-2 of the norm (replay.py)."""
    assert derived_rtol(torch.bfloat16) > 1.1e-2


def test_derived_rtol_is_a_fraction_the_config_accepts():
    assert all(0 < derived_rtol(d) < 1 for d in UNIT_ROUNDOFF)


# replay's comparison of (loss, projection, norm)


def test_identical_triples_agree_even_with_zero_tolerance():
    assert agree([2.0, -0.5, 3.0], [2.0, -0.5, 3.0], 0.0)


def test_loss_tolerance_is_relative_to_the_smaller_loss():
    rtol = 1e-3
    assert agree([1.0, 0.0, 1.0], [1.0 + 0.9e-3, 0.0, 1.0], rtol)
    assert not agree([1.0, 0.0, 1.0], [1.0 + 1.1e-3, 0.0, 1.0], rtol)
    assert agree([-4.0, 0.0, 1.0], [-4.0036, 0.0, 1.0], rtol)  # a negative loss uses |loss|


def test_projection_tolerance_scales_with_the_smaller_norm():
    rtol = 1e-2
    assert agree([1.0, 10.0, 100.0], [1.0, 10.9, 100.0], rtol)
    assert not agree([1.0, 10.0, 100.0], [1.0, 11.1, 100.0], rtol)


def test_a_huge_norm_cannot_widen_its_own_tolerance():
    """The corrupted gradient's norm is the larger: the smaller sets the scale."""
    rtol = 1e-2
    clean, corrupted = [1.0, 0.0, 1.0], [1.0, 5.0, 1000.0]
    assert not agree(clean, corrupted, rtol) and not agree(corrupted, clean, rtol)


def test_norm_difference_alone_disagrees():
    assert not agree([1.0, 0.0, 1.0], [1.0, 0.0, 1.05], 1e-2)


def test_agree_is_symmetric():
    a, b = [1.0, 0.3, 2.0], [1.0005, 0.31, 2.01]
    for rtol in (1e-4, 1e-3, 1e-2):
        assert agree(a, b, rtol) == agree(b, a, rtol)


def test_nan_never_agrees():
    assert not agree([math.nan, 0.0, 1.0], [math.nan, 0.0, 1.0], 0.5)


def test_triple_projects_onto_each_names_signs_and_takes_the_l2_norm():
    g1, g2 = torch.tensor([[1.0, -2.0], [0.5, 4.0]]), torch.tensor([3.0, 0.25])
    loss, projection, norm = triple(0.7, [("w", g1), ("b", g2)])
    expected = sum(float((g.reshape(-1).double() * signs(n, g.numel()).double()).sum())
                   for n, g in (("w", g1), ("b", g2)))  # fmt: skip
    assert loss == 0.7
    assert projection == pytest.approx(expected, rel=1e-15, abs=0)
    assert norm == pytest.approx(math.sqrt(1 + 4 + 0.25 + 16 + 9 + 0.0625), rel=1e-15, abs=0)


def test_triple_does_not_depend_on_the_order_the_gradients_come_in():
    grads = [("a", torch.randn(5, generator=torch.Generator().manual_seed(0))),
             ("b", torch.randn(7, generator=torch.Generator().manual_seed(1)))]  # fmt: skip
    assert triple(1.0, grads) == triple(1.0, grads[::-1])


# allreduce_sketch: rho = (W - 1 + k) u, alpha = (W - 1 + W k) s / 2


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
@pytest.mark.parametrize(("world", "per_rank"), [(2, 0), (4, 0), (4, 1), (8, 2)])
def test_sum_rounding_counts_each_rounding_of_the_sum(dtype, world, per_rank):
    rho, alpha = sum_rounding(dtype, world, per_rank)
    u, s = UNIT_ROUNDOFF[dtype], SUBNORMAL[dtype]
    assert rho == pytest.approx((world - 1 + per_rank) * u, rel=1e-12, abs=0)
    assert alpha == pytest.approx((world - 1 + world * per_rank) * s / 2, rel=1e-12, abs=0)


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
def test_a_single_rank_sum_rounds_nothing(dtype):
    assert sum_rounding(dtype, 1, 0) == (0.0, 0.0)


def test_sum_rounding_grows_with_the_world_and_the_hooks_roundings():
    rhos = [sum_rounding(torch.bfloat16, w, 0)[0] for w in (2, 3, 4, 8, 16)]
    assert rhos == sorted(rhos) and len(set(rhos)) == 5
    assert sum_rounding(torch.float32, 4, 1) > sum_rounding(torch.float32, 4, 0)


def test_sum_rounding_is_smaller_for_more_precise_dtypes():
    rho = {d: sum_rounding(d, 4, 0)[0] for d in UNIT_ROUNDOFF}
    assert rho[torch.float32] < rho[torch.float16] < rho[torch.bfloat16]


def bound(dtype, n, norms=1.0, world=4, per_rank=0, rtol=1e-6):
    return tolerance(norms, n, rtol, *sum_rounding(dtype, world, per_rank))


def test_tolerance_is_the_documented_formula():
    n, N, rtol, rho, alpha = 10_000, 3.0, 1e-6, 0.01, 1e-20
    expected = 4 * rtol * math.sqrt(n) * N + 6 * (7 / 3) * (rho * N + alpha * math.sqrt(n))
    assert tolerance(N, n, rtol, rho, alpha) == pytest.approx(expected, rel=1e-12, abs=0)


def test_bfloat16_bound_on_four_ranks_is_a_sixth_of_the_norms():
    """The docstring: 6 (7/3) 3 u = 0.16 of the summed norms in bfloat16 with 4 ranks, plus
    4e-6 sqrt(n) N."""
    n = 1_000_000
    assert bound(torch.bfloat16, n) == pytest.approx(6 * 7 / 3 * 3 / 256 + 4e-6 * 1000, rel=1e-6)
    assert 0.16 < bound(torch.bfloat16, 1) < 0.17


def test_float32_bound_is_ruled_by_the_projections_rounding():
    n = 1_000_000
    projection = 4 * 1e-6 * math.sqrt(n)
    assert bound(torch.float32, n) == pytest.approx(projection, rel=0.01)
    assert bound(torch.float32, n) > projection


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
def test_tolerance_grows_with_the_contributions_size(dtype):
    bounds = [bound(dtype, n) for n in (1, 100, 10_000, 1_000_000, 100_000_000)]
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds)


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
def test_tolerance_is_affine_in_the_summed_norms(dtype):
    at = {N: bound(dtype, 4096, norms=N) for N in (0.0, 1.0, 2.0, 10.0)}
    slope = at[1.0] - at[0.0]
    assert at[2.0] - at[0.0] == pytest.approx(2 * slope, rel=1e-9, abs=0)
    assert at[10.0] - at[0.0] == pytest.approx(10 * slope, rel=1e-9, abs=0)


@pytest.mark.parametrize("dtype", list(UNIT_ROUNDOFF))
def test_zero_norms_leave_only_the_subnormal_term(dtype):
    n = 4096
    alpha = 3 * SUBNORMAL[dtype] / 2  # four ranks, no hook: W - 1 roundings of s / 2
    assert bound(dtype, n, norms=0.0) == pytest.approx(6 * 7 / 3 * alpha * 64, rel=1e-12, abs=0)
    assert bound(dtype, n, norms=0.0) > 0


def test_float32_bound_is_below_float16_below_bfloat16():
    for n in (1, 1000, 10**7):
        b = {d: bound(d, n) for d in UNIT_ROUNDOFF}
        assert b[torch.float32] < b[torch.float16] < b[torch.bfloat16]


def test_tolerance_of_a_tensor_of_norms_is_elementwise():
    norms = torch.tensor([0.0, 1.0, 5.0], dtype=torch.float64)
    got = bound(torch.bfloat16, 512, norms=norms)
    assert isinstance(got, torch.Tensor)
    assert got.tolist() == pytest.approx([bound(torch.bfloat16, 512, norms=float(x))
                                          for x in norms])  # fmt: skip


def test_a_single_element_change_beyond_the_bound_is_larger_than_the_bound():
    """Every weight is at least 1 in magnitude: an element moved by more than the bound moves the
    projection by more than the bound (the docstring's sensitivity claim, with weights 1..2)."""
    n = 10_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    weights = step_weights(3, 0, n)
    limit = float(bound(torch.float32, n, norms=float(x.norm()), world=2))
    moved = x.clone()
    moved[1234] += 1.01 * limit
    assert abs(float(project(moved, weights)) - float(project(x, weights))) > limit


def test_sketch_weights_are_signed_magnitudes_between_one_and_two():
    u, v, z = step_weights(7, 2, 4096 * 3 + 5)
    for w in (u, v, z):
        assert bool(((w.abs() >= 1) & (w.abs() <= 2)).all())
    assert (u.numel(), v.numel(), z.numel()) == (4096, 3, 5)  # rows x width, and the rest
    assert bool((u > 0).any() and (u < 0).any())


def test_sketch_weights_are_fixed_by_step_and_chunk_and_fresh_each_step():
    same = [step_weights(7, 2, 50_000) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*same, strict=True))
    assert not torch.equal(step_weights(8, 2, 50_000)[0], same[0][0])
    assert not torch.equal(step_weights(7, 3, 50_000)[0], same[0][0])
