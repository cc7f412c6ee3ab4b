"""matmul_checksum's arithmetic compiled by Inductor against the same source run eagerly (the
reference), on random products with NaN, Inf and subnormal values and with faults, in float32,
bfloat16 and float16: the verdicts (a ratio above 1, NaN or infinite) agree exactly; the
ratios within 0.05 of the bound and 1e-5 relative (a compiled reduction sums in another order,
and a clean row's checksum error is itself rounding noise, which the bound covers eight sigmas
wide); the other figures (norms, sums, projections) within 1e-5 of the largest of their kind."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import pytest
import torch
import torch._inductor.config

from detectors import checksum_kernels
from detectors.checksum_kernels import Kernels
from detectors.product_bounds import Rounding, bound_of, roundoff

EAGER, COMPILED = Kernels(compiled=False), Kernels(compiled=True)
SPECIALS = (math.nan, math.inf, -math.inf)


@pytest.fixture(autouse=True)
def isa_from_the_cpu_flags() -> Iterator[None]:
    """Inductor picks its vector ISA from the CPU's flags instead of dry-compiling a probe for
    each ISA first (about 8 s in a fresh cache): the same ISA, the same kernels."""
    with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
        yield


def _rounding(dtype: torch.dtype) -> Rounding:
    return Rounding(roundoff(dtype), roundoff(torch.float32), 0.0, 8.0)


def _operand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values with eight subnormals among them."""
    t = torch.randn(shape, generator=gen).to(dtype)
    at = torch.randint(0, t.numel(), (8,), generator=gen)
    t.view(-1)[at] = torch.finfo(dtype).tiny / 4
    return t


def _spoil(t: torch.Tensor, case: str) -> torch.Tensor:
    """`clean`; `fault`: one element a thousand times larger; `special`: a NaN, an Inf and a -Inf
    in three rows."""
    t = t.clone()
    flat = t.view(-1)
    if case == "fault":
        flat[flat.numel() // 3] = flat[flat.numel() // 3] * 1000 + 50
    elif case == "special":
        rows = t.shape[-1]
        for i, value in enumerate(SPECIALS):
            flat[(2 * i + 1) * rows + 3] = value
    return t


def _agree(eager: torch.Tensor, compiled: torch.Tensor, what: str, ratio: bool) -> None:
    if ratio:
        assert bool(eager <= 1.0) == bool(compiled <= 1.0), what  # the verdict
    assert torch.equal(eager.isnan(), compiled.isnan()), what
    assert torch.equal(eager.isinf(), compiled.isinf()), what
    finite = eager.isfinite()
    if ratio:
        torch.testing.assert_close(compiled[finite], eager[finite], rtol=1e-5, atol=0.05, msg=what)
    else:
        scale = float(eager[finite].abs().max()) if finite.any() else 0.0
        torch.testing.assert_close(
            compiled[finite], eager[finite], rtol=1e-5, atol=1e-5 * scale, msg=what
        )


# Each graph compiles in 2-3 s in a fresh Inductor cache, and a process's first compile with its
# imports takes 16-20 s beside a CI machine's two loaded test workers, which the default run's
# 8 minutes cannot hold: every compiling case is in the slow set (`pytest -m slow`).
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_checks_agree_with_eager(dtype: torch.dtype) -> None:
    """Forward, the output gradient's figures, and both operand checks of a batched product
    [4, 96, 64] @ [4, 64, 80] with a bias-like addend, subnormals among the operands, on clean,
    faulty and special (NaN, Inf) outputs and gradients, and a special operand."""
    gen = torch.Generator().manual_seed(0)
    rounding = _rounding(dtype)
    rows = not rounding.fine
    for case in ("clean", "fault", "special"):
        left, right = _operand((4, 96, 64), dtype, gen), _operand((4, 64, 80), dtype, gen)
        addend = _operand((80,), dtype, gen)
        output = torch.baddbmm(addend.float(), left.float(), right.float()).to(dtype)
        left_in = _spoil(left, "special") if case == "special" else left
        measured = _spoil(output, case)
        bound = bound_of(rounding, 64, 80)
        figures = [
            k.output(left_in, right, measured, addend, dtype, 1.0, 1.0, False, bound, rows)
            for k in (EAGER, COMPILED)
        ]
        for name, e, c in zip(("ratio", "right_fro", "left_fro"), *figures, strict=True):
            _agree(e, c, f"{dtype} {case} forward {name}", name == "ratio")
        if case == "special":
            # A non-finite operand is upstream's fault: its rows count 0, the others stand.
            assert figures[0][0].isfinite()

        grad = _operand((4, 96, 80), dtype, gen)
        dp = [k.grad(right, grad, dtype, 1.0, False) for k in (EAGER, COMPILED)]
        for name, e, c in zip(("projected", "row_sums", "norms", "sums"), *dp, strict=True):
            _agree(e, c, f"{dtype} {case} output gradient {name}", False)
        projected, row_sums, norms, sums_norm = dp[0]
        right_fro, left_fro = figures[0][1], figures[0][2]

        d_left = _spoil((grad.float() @ right.float().mT).to(dtype), case)
        d_right = _spoil((left.float().mT @ grad.float()).to(dtype), case)
        left_bound, right_bound = bound_of(rounding, 80, 64), bound_of(rounding, 96, 80)
        lefts = [
            k.left(d_left, projected, norms, right_fro, sums_norm, False, left_bound, rows)
            for k in (EAGER, COMPILED)
        ]
        _agree(*lefts, f"{dtype} {case} input gradient", True)
        rights = [
            k.right(d_right, left, dtype, row_sums, left_fro, norms, -1, False, right_bound, rows)
            for k in (EAGER, COMPILED)
        ]
        _agree(*rights, f"{dtype} {case} weight gradient", True)
        broken = {"clean": False, "fault": True, "special": True}[case]
        for ratio in (figures[0][0], lefts[0], rights[0]):
            if case != "special" or ratio is not figures[0][0]:
                assert bool(not ratio <= 1.0) == broken, (dtype, case)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "backward"), [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)]
)
def test_compiled_checks_repeat_an_autocast_kernels_casts(
    dtype: torch.dtype, backward: bool
) -> None:
    """Under autocast the operands are float32 and the kernel reads them cast to 16 bits; with
    the float32 product before its rounding at hand (emulated numerics) the check holds it to
    the 32-bit bound, so the casts must be repeated exactly: a compiled check that skipped
    them (Inductor computes 16-bit values in float32 unless told not to) alarms on a clean
    product. Clean, faulty and special (NaN, Inf) outputs, subnormal operands: the verdicts
    agree. `backward`: the weight gradient's check too, which casts L again."""
    gen = torch.Generator().manual_seed(1)
    left = _operand((4, 96, 64), torch.float32, gen)
    right = _operand((4, 64, 80), torch.float32, gen)
    accumulator = left.to(dtype).float() @ right.to(dtype).float()
    rounding = _rounding(torch.float32)
    bound = bound_of(rounding, 64, 80)
    for case in ("clean", "fault", "special"):
        measured = _spoil(accumulator, case)
        ratios = [
            k.output(left, right, measured, None, dtype, 1.0, 1.0, False, bound, False)[0]
            for k in (EAGER, COMPILED)
        ]
        _agree(*ratios, f"{dtype} cast operands, {case}", True)
        assert (float(ratios[1]) <= 0.5) == (case == "clean"), (case, ratios)
    if not backward:
        return
    grad = torch.randn(4, 96, 80, generator=gen)
    d_right = left.to(dtype).float().mT @ grad
    row_sums, norms = grad.sum(-1), torch.linalg.vector_norm(grad, dim=-1)
    left_fro = torch.linalg.vector_norm(left.to(dtype).float(), dim=(-2, -1))
    figures = (row_sums, left_fro, norms, -1, False, bound_of(rounding, 96, 80), False)
    rights = [k.right(d_right, left, dtype, *figures) for k in (EAGER, COMPILED)]
    assert float(rights[0]) <= 0.5 and float(rights[1]) <= 0.5, rights


def test_a_failed_compile_says_so_once_and_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler: the first call logs one warning, for the whole process (a later trial's
    check too), and every call returns eager's figures."""

    def no_compiler(fn, **kwargs):
        def fail(*args, **kw):
            raise RuntimeError("Compiler: cc not found\nmore detail")

        return fail

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(checksum_kernels, "_COMPILED", {})
    monkeypatch.setattr(checksum_kernels, "_FAILED", [])
    first_trial, next_trial = Kernels(compiled=True), Kernels(compiled=True)
    right, grad = torch.randn(64, 80), torch.randn(96, 80)
    with caplog.at_level(logging.WARNING, logger="detectors.checksum_kernels"):
        first = first_trial.grad(right, grad, torch.float32, 1.0, False)
        second = first_trial.grad(right, grad, torch.float32, 2.0, False)
        later = next_trial.grad(right, grad, torch.float32, 1.0, False)
    assert [r.getMessage() for r in caplog.records] == [
        "matmul_checksum: compiled kernels unavailable (RuntimeError: Compiler: cc not found); "
        "the eager checks run instead, with the same verdicts"
    ]
    assert not first_trial.compiled and not next_trial.compiled
    for got, want in zip(first, EAGER.grad(right, grad, torch.float32, 1.0, False), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(second[0], 2 * first[0])
    assert all(torch.equal(a, b) for a, b in zip(later, first, strict=True))
