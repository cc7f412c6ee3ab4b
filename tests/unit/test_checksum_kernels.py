"""matmul_checksum's arithmetic compiled by Inductor, and hand-written in C (the native kernels),
against the same checks run eagerly (the reference), on random products with NaN, Inf and
subnormal values and with faults, in float32, bfloat16 and float16: the verdicts (a ratio above
1, NaN or infinite) agree exactly; the ratios within 0.05 of the bound and 1e-5 relative (a
fused reduction sums in another order, and a clean row's checksum error is itself rounding
noise, which the bound covers eight sigmas wide); the other figures (norms, sums, projections)
within 1e-5 of the largest of their kind."""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Iterator

import pytest
import torch
import torch._inductor.config
import torch.nn.functional as F

from benchmarks.common import detector
from detectors import checksum_kernels, native_build, native_checksum
from detectors.checksum_kernels import Kernels
from detectors.native_build import EAGER_INSTEAD
from detectors.product_bounds import (
    Kept,
    OperandCheck,
    Rounding,
    bound_of,
    rounding_ratio,
    roundoff,
)
from harness.core.bus import PluginBus
from harness.core.events import CheckWarning

EAGER = Kernels("eager")
SPECIALS = (math.nan, math.inf, -math.inf)
COMPILER = shutil.which(os.environ.get("CC", "cc"))
# Each graph compiles in 2-3 s in a fresh Inductor cache, and a process's first compile with its
# imports takes 16-20 s beside a CI machine's two loaded test workers, which the default run's
# 8 minutes cannot hold: every compiling case is in the slow set (`pytest -m slow`).
FUSED = [pytest.param("compiled", marks=pytest.mark.slow), "native"]


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


@pytest.mark.parametrize("kind", FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_checks_agree_with_eager(kind: str, dtype: torch.dtype) -> None:
    """Forward, the output gradient's figures, and both operand checks of a batched product
    [4, 96, 64] @ [4, 64, 80] with a bias-like addend, subnormals among the operands, on clean,
    faulty and special (NaN, Inf) outputs and gradients, and a special operand. (The native
    kernels read float32 and bfloat16: float16 takes the eager path there.)"""
    fused = Kernels(kind)
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
            k.output(left_in, right, measured, addend, dtype, 1.0, 1.0, False, bound, rows, True)
            for k in (EAGER, fused)
        ]
        _agree_forward(*figures, f"{dtype} {case} forward")
        if case == "special":
            # A non-finite operand is upstream's fault: its rows count 0, the others stand.
            assert figures[0][0].isfinite()
            # The backward's L is the product's own (its gradients' specials are this case's).
            figures = [
                k.output(left, right, measured, addend, dtype, 1.0, 1.0, False, bound, rows, True)
                for k in (EAGER, fused)
            ]

        grad = _operand((4, 96, 80), dtype, gen)
        d_left = _spoil((grad.float() @ right.float().mT).to(dtype), case)
        d_right = _spoil((left.float().mT @ grad.float()).to(dtype), case)
        checks = (OperandCheck(d_left, bound_of(rounding, 80, 64), rows),
                  OperandCheck(d_right, bound_of(rounding, 96, 64), rows))  # fmt: skip
        (lefts, rights) = zip(
            *(k.backward(grad, dtype, 1.0, False, -2, kept, *checks)
              for k, (_, kept) in zip((EAGER, fused), figures, strict=True)),
            strict=True,
        )  # fmt: skip
        _agree(*lefts, f"{dtype} {case} input gradient", True)
        _agree(*rights, f"{dtype} {case} weight gradient", True)
        broken = {"clean": False, "fault": True, "special": True}[case]
        for ratio in (figures[0][0], lefts[0], rights[0]):
            if case != "special" or ratio is not figures[0][0]:
                assert bool(not ratio <= 1.0) == broken, (dtype, case)


@pytest.mark.parametrize("kind", FUSED)
@pytest.mark.parametrize(
    ("dtype", "backward"), [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)]
)
def test_fused_checks_repeat_an_autocast_kernels_casts(
    kind: str, dtype: torch.dtype, backward: bool
) -> None:
    """Under autocast the operands are float32 and the kernel reads them cast to 16 bits; with
    the float32 product before its rounding at hand (emulated numerics) the check holds it to
    the 32-bit bound, so the casts must be repeated exactly: a compiled check that skipped
    them (Inductor computes 16-bit values in float32 unless told not to) alarms on a clean
    product. Clean, faulty and special (NaN, Inf) outputs, subnormal operands: the verdicts
    agree. `backward`: the weight gradient's check too, whose L e the forward summed from the
    cast L."""
    fused = Kernels(kind)
    gen = torch.Generator().manual_seed(1)
    left = _operand((4, 96, 64), torch.float32, gen)
    right = _operand((4, 64, 80), torch.float32, gen)
    accumulator = left.to(dtype).float() @ right.to(dtype).float()
    rounding = _rounding(torch.float32)
    bound = bound_of(rounding, 64, 80)
    kept = []
    for case in ("clean", "fault", "special"):
        measured = _spoil(accumulator, case)
        figures = [
            k.output(left, right, measured, None, dtype, 1.0, 1.0, False, bound, False, True)
            for k in (EAGER, fused)
        ]
        ratios = [ratio for ratio, _ in figures]
        _agree(*ratios, f"{dtype} cast operands, {case}", True)
        assert (float(ratios[1]) <= 0.5) == (case == "clean"), (case, ratios)
        kept = kept or [k for _, k in figures]
    if not backward:
        return
    grad = torch.randn(4, 96, 80, generator=gen).to(dtype).float()  # as a 16-bit dP
    d_right = left.to(dtype).float().mT @ grad
    check = OperandCheck(d_right, bound_of(rounding, 96, 64), False)
    rights = [
        k.backward(grad, dtype, 1.0, False, -2, figures, None, check)[1]
        for k, figures in zip((EAGER, fused), kept, strict=True)
    ]
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
    first_trial, next_trial = Kernels("compiled"), Kernels("compiled")
    right_sums, grad = torch.randn(80), torch.randn(96, 80)
    with caplog.at_level(logging.WARNING, logger="detectors.checksum_kernels"):
        first = first_trial.grad(right_sums, grad, torch.float32, 1.0, False)
        second = first_trial.grad(right_sums, grad, torch.float32, 2.0, False)
        later = next_trial.grad(right_sums, grad, torch.float32, 1.0, False)
    assert [r.getMessage() for r in caplog.records] == [
        "matmul_checksum: compiled kernels unavailable (RuntimeError: Compiler: cc not found); "
        "the eager checks run instead, with the same verdicts"
    ]
    assert not first_trial.compiled and not next_trial.compiled
    eager = EAGER.grad(right_sums, grad, torch.float32, 1.0, False)
    for got, want in zip(first, eager, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(second[0], 2 * first[0])
    assert all(torch.equal(a, b) for a, b in zip(later, first, strict=True))


def _products(dtype: torch.dtype, gen: torch.Generator):
    """(name, L, R, addend, alpha, beta, flat) in the layouts the products' watch hands over: a
    Linear (R a transposed weight, a bias), over 1 MiB of float32 operands and output; tokens
    [B, T, q] against one weight (rows merged); attention's score product on strided per-head
    views of a packed projection (two batch dimensions that do not merge, R a transposed view);
    baddbmm with a 2-D addend broadcast over the batch, alpha and beta; one L broadcast over R's
    batch; addmm with one number added to every element (a 1-D addend of one)."""
    qkv = _operand((4, 48, 3, 2, 32), dtype, gen)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    weight = _operand((384, 256), dtype, gen)
    return [
        ("linear", _operand((1024, 256), dtype, gen), weight.mT, _operand((384,), dtype, gen),
         1.0, 1.0, False),
        ("tokens", _operand((4, 64, 96), dtype, gen), _operand((80, 96), dtype, gen).mT, None,
         1.0, 1.0, True),
        ("attention", q, k.mT, None, 0.125, 1.0, False),
        ("baddbmm", _operand((3, 40, 24), dtype, gen), _operand((3, 24, 56), dtype, gen),
         _operand((40, 56), dtype, gen), 0.5, 2.0, False),
        ("broadcast", _operand((40, 24), dtype, gen), _operand((3, 24, 56), dtype, gen), None,
         1.0, 1.0, False),
        ("one addend", _operand((8, 16), dtype, gen), _operand((16, 12), dtype, gen),
         torch.full((1,), 2.0, dtype=dtype), 1.0, 1.0, False),
    ]  # fmt: skip


def _output(left, right, addend, alpha, beta, dtype):
    product = alpha * (left.float() @ right.float())
    if addend is not None:
        product = product + beta * addend.float()
    return product.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_checks_agree_with_eager_in_every_layout(dtype: torch.dtype) -> None:
    """Every check of every layout (`_products`), clean and with one element of the output and
    of each gradient a thousand times larger: the native figures agree with eager's, and so do
    the verdicts, which are clean and broken as made. Where a compiler exists, the kernel
    applies to each (no eager fallback)."""
    native = Kernels("native")
    gen = torch.Generator().manual_seed(2)
    rounding = _rounding(dtype)
    rows = not rounding.fine
    for name, left, right, addend, alpha, beta, flat in _products(dtype, gen):
        output = _output(left, right, addend, alpha, beta, dtype)
        q, p = right.shape[-2], right.shape[-1]
        grad = _operand(output.shape, dtype, gen)
        left_grad = (alpha * grad.float() @ right.float().mT).to(dtype)
        grad2, left2 = grad.float().reshape(-1, p), left.float().reshape(-1, q)
        if flat:
            right_grad = (alpha * left2.mT @ grad2).to(dtype)
        else:
            right_grad = (alpha * left.float().mT @ grad.float()).to(dtype)
        m = left2.shape[0] if flat else left.shape[-2]
        for case in ("clean", "fault"):
            what = f"{dtype} {name} {case}"
            measured = _spoil(output, case)
            bound = bound_of(rounding, q, p)
            args = (left, right, measured, addend, dtype, alpha, beta, flat, bound, rows, True)
            forward = [k.output(*args) for k in (EAGER, native)]
            assert (native_checksum.output_figures(*args) is None) == (COMPILER is None)
            # The native figures are per batch matrix of P; eager's per operand's.
            _agree_forward(*forward, what, broadcast=True)
            assert bool(not forward[1][0] <= 1.0) == (case == "fault"), what
            if name == "broadcast":
                continue  # L is not one product's operand: its gradient is not checked
            along, stored = (-1, right_grad.mT) if name == "linear" else (-2, right_grad)
            checks = (
                OperandCheck(_spoil(left_grad, case), bound_of(rounding, p, q), rows),
                OperandCheck(_spoil(stored.contiguous(), case), bound_of(rounding, m, q), rows),
            )
            args = [(grad, dtype, alpha, flat, along, kept) for _, kept in forward]
            (lefts, rights) = zip(
                *(k.backward(*a, *checks) for k, a in zip((EAGER, native), args, strict=True)),
                strict=True,
            )  # fmt: skip
            assert (native_checksum.backward_ratios(*args[1], *checks) is None) == (
                COMPILER is None
            )
            _agree(*lefts, f"{what} input gradient", True)
            _agree(*rights, f"{what} weight gradient", True)
            assert bool(not lefts[1] <= 1.0) == (case == "fault"), what
            assert bool(not rights[1] <= 1.0) == (case == "fault"), what
            for at, alone in ((0, (checks[0], None)), (1, (None, checks[1]))):
                ratios = native.backward(*args[1], *alone)  # one operand's gradient made
                assert ratios[1 - at] is None, what
                _agree(ratios[at], (lefts, rights)[at][1], f"{what} alone", True)


@pytest.mark.parametrize("merged", [True, False])
def test_a_kept_native_description_reads_each_call_s_own_tensors(merged: bool) -> None:
    """The native kernels describe a call once per layout of its tensors and then only write in
    each call's addresses: three calls on new tensors of one layout (clean, one element of the
    output and of each gradient spoiled, clean again) give eager's figures and verdicts each
    time. Also where the description copies an operand (three batch dimensions that do not
    merge, described anew at each call)."""
    native = Kernels("native")
    gen = torch.Generator().manual_seed(4)
    rounding = _rounding(torch.float32)
    shape = (2, 3, 4, 24, 16) if merged else (4, 3, 2, 24, 16)
    for case in ("clean", "fault", "clean"):
        left = _operand(shape, torch.float32, gen)
        left = left if merged else left.permute(2, 1, 0, 3, 4)  # batch strides that do not merge
        right = _operand((*left.shape[:-2], 16, 20), torch.float32, gen)
        output = _spoil(left @ right, case)
        bound = bound_of(rounding, 16, 20)
        args = (left, right, output, None, torch.float32, 1.0, 1.0, False, bound, False, True)
        forward = [k.output(*args) for k in (EAGER, native)]
        _agree_forward(*forward, case)
        assert bool(not forward[1][0] <= 1.0) == (case == "fault"), case
        grad = _operand(output.shape, torch.float32, gen)
        checks = (
            OperandCheck(_spoil(grad @ right.mT, case), bound_of(rounding, 20, 16), False),
            OperandCheck(_spoil(left.mT @ grad, case), bound_of(rounding, 24, 16), False),
        )
        (lefts, rights) = zip(
            *(k.backward(grad, torch.float32, 1.0, False, -2, kept, *checks)
              for k, (_, kept) in zip((EAGER, native), forward, strict=True)),
            strict=True,
        )  # fmt: skip
        for what, ratios in (("input", lefts), ("weight", rights)):
            _agree(*ratios, f"{case} {what} gradient", True)
            assert bool(not ratios[1] <= 1.0) == (case == "fault"), f"{case} {what}"


def test_a_product_the_kernels_do_not_read_runs_eagerly_said_once(caplog) -> None:
    """A float16 product is not the kernels' (float32 and bfloat16 on the CPU): the eager checks
    run with the same verdicts, and the log says so once per kind of matrix, as
    docs/configuration.md promises (it said nothing)."""
    native_build.said.clear()
    built = native_checksum.load() is not None  # if not, the build's failure said it
    gen = torch.Generator().manual_seed(5)
    with caplog.at_level(logging.WARNING, logger=native_build.__name__):
        for dtype in (torch.float16, torch.float16):
            left, right = _operand((6, 8), dtype, gen), _operand((8, 5), dtype, gen)
            output = _output(left, right, None, 1.0, 1.0, dtype)
            rounding = _rounding(dtype)
            args = (left, right, output, None, dtype, 1.0, 1.0, False, bound_of(rounding, 8, 5),
                    not rounding.fine, False)  # fmt: skip
            assert native_checksum.output_figures(*args) is None
            native, eager = Kernels("native").output(*args), EAGER.output(*args)
            assert torch.equal(native[0], eager[0]) and bool(native[0] <= 1.0)
    said = [r.getMessage() for r in caplog.records]
    once = (
        f"{native_checksum.WHO} do not read a torch.float16 matrix read as torch.float16 on cpu; "
        "the eager checks run instead, with the same verdicts"
    )
    assert said == ([once] if built else []), said


def test_a_call_whose_sizes_disagree_is_not_handed_to_the_kernel() -> None:
    """The kernels trust the sizes they are given: a Linear's weight gradient handed over the
    wrong way round (its transpose, 384 x 256 read as 256 x 384), or an output one column short
    of the product, would have the kernel read and write past its buffers. Neither reaches it
    (the native functions return None, the caller's eager path runs), and the right call after
    them still does, with eager's verdict."""
    gen = torch.Generator().manual_seed(5)
    rounding = _rounding(torch.float32)
    left = _operand((1024, 256), torch.float32, gen)
    weight = _operand((384, 256), torch.float32, gen)
    output = left @ weight.mT
    bound = bound_of(rounding, 256, 384)
    forward = (left, weight.mT, output, None, torch.float32, 1.0, 1.0, False, bound, False)
    assert native_checksum.output_figures(*forward[:2], output[:, :-1], *forward[3:], True) is None
    assert (native_checksum.output_figures(*forward, True) is None) == (COMPILER is None)
    _, kept = EAGER.output(*forward, True)
    grad = _operand(output.shape, torch.float32, gen)
    weight_grad = grad.mT @ left  # [384, 256], as a Linear's weight
    for given, right_way in ((weight_grad.mT.contiguous(), False), (weight_grad, True)):
        check = OperandCheck(given, bound_of(rounding, 1024, 256), False)
        args = (grad, torch.float32, 1.0, False, -1, kept)
        ratios = native_checksum.backward_ratios(*args, None, check)
        assert (ratios is not None) == (right_way and COMPILER is not None)
    native = Kernels("native").backward(*args, None, check)[1]
    _agree(EAGER.backward(*args, None, check)[1], native, "weight gradient", True)
    assert bool(native <= 1.0)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32])
def test_native_rounding_check_agrees_with_eager(stored: torch.dtype) -> None:
    """The exact check of a bfloat16 rounding (emulated numerics), with subnormals, halfway
    cases and NaN, Inf in the float32 value: clean, 0 on both paths; one element off by one
    unit in the last place, or a NaN where a number was, infinite on both."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(300_000, generator=gen)
    wide[:4] = torch.tensor([math.nan, math.inf, -math.inf, torch.finfo(torch.float32).tiny / 3])
    wide[4:8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130])  # ties, subnormal
    rounded = wide.to(torch.bfloat16).to(stored)
    off = rounded.clone()
    off.view(torch.int16 if stored == torch.bfloat16 else torch.int32)[1234] += (
        1 if stored == torch.bfloat16 else 1 << 16
    )
    nan = rounded.clone()
    nan[99] = math.nan
    for case, values, broken in (("clean", rounded, False), ("off", off, True), ("nan", nan, True)):
        native = native_checksum.rounding_ratio(values, wide, torch.bfloat16)
        eager = rounding_ratio(values, wide, torch.bfloat16)
        if COMPILER is None:
            assert native is None
            continue
        assert native is not None
        assert torch.equal(native, eager), case
        assert bool(torch.isinf(native)) == broken, case


def test_native_checks_without_a_compiler_say_so_once_and_run_eagerly(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SDC_BENCH_CACHE", str(tmp_path / "cache"))
    native_checksum.load.cache_clear()
    try:
        left, right = torch.randn(96, 64), torch.randn(64, 80)
        bound = bound_of(_rounding(torch.float32), 64, 80)
        args = (left, right, left @ right, None, torch.float32, 1.0, 1.0, False, bound, False)
        with caplog.at_level(logging.WARNING):
            figures = [Kernels("native").output(*args, True) for _ in range(3)]
        said = [r.getMessage() for r in caplog.records if "native checks" in r.getMessage()]
        assert len(said) == 1 and "no C compiler" in said[0], said
        want_ratio, want = EAGER.output(*args, True)
        for ratio, got in figures:
            assert torch.equal(ratio, want_ratio)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    finally:
        native_checksum.load.cache_clear()


def _agree_forward(eager: tuple, other: tuple, what: str, broadcast: bool = False) -> None:
    """Two paths' forward check: the ratio's verdict, and each figure it keeps for the backward
    (`broadcast`: one path's are per batch matrix of P, the other's per operand's)."""
    (ratio, kept), (other_ratio, other_kept) = eager, other
    _agree(ratio, other_ratio, f"{what} ratio", True)
    for name, e, n in zip(kept._fields, kept, other_kept, strict=True):
        pair = torch.broadcast_tensors(e, n) if broadcast else (e, n)
        _agree(*pair, f"{what} {name}", False)


def _warned_steps(compiler: str | None, tmp_path, monkeypatch) -> list[str]:
    """The warnings a native matmul_checksum records over two steps of a Linear, with `CC` set
    to `compiler` (None: the machine's)."""
    if compiler is not None:
        monkeypatch.setenv("CC", compiler)
        monkeypatch.setenv("SDC_BENCH_CACHE", str(tmp_path / "cache"))
    native_checksum.load.cache_clear()
    try:
        model = torch.nn.Linear(16, 8)
        check = detector("matmul_checksum", model=model, kernels="native")
        PluginBus([check], check._log.verdicts).install_forward_hooks(model, lambda: 1)
        for _ in range(2):
            model(torch.randn(4, 16)).sum().backward()
        return [e.what for e in check._log.events if isinstance(e, CheckWarning)]
    finally:
        native_checksum.load.cache_clear()


def test_a_trial_whose_native_kernels_were_not_built_records_that_it_checked_eagerly(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a compiler the check runs eagerly with the same verdicts; its trial's record
    (the row's `warnings`) says so once, not only the log. With the kernels built, nothing."""
    assert _warned_steps(None, tmp_path, monkeypatch) == ([] if COMPILER else [EAGER_INSTEAD])
    assert _warned_steps(str(tmp_path / "no-such-cc"), tmp_path, monkeypatch) == [EAGER_INSTEAD]


@pytest.mark.parametrize("kind", ["eager", "native"])
def test_an_infinite_or_huge_16_bit_element_breaks_every_check_it_reaches(kind: str) -> None:
    """A bfloat16 output or gradient element turned infinite, or huge (the exponent's top bit
    flipped: 2^64 and more, whose square overflows float32), in a row after clean ones, and in
    rows of one element (p = 1) and of many: every check it reaches alarms, on both paths. (An
    infinite row norm used to widen the row's bound to infinity and hide the fault; the native
    path also used to skip the row once an earlier one had a ratio.)"""
    check = Kernels(kind)
    gen = torch.Generator().manual_seed(4)
    rounding = _rounding(torch.bfloat16)
    for p in (1, 2, 64):
        m, q = 8, 16
        left, right = _operand((m, q), torch.bfloat16, gen), _operand((q, p), torch.bfloat16, gen)
        output = (left.float() @ right.float()).to(torch.bfloat16)
        grad = _operand((m, p), torch.bfloat16, gen)
        kept = Kept(*(torch.linalg.vector_norm(t.float()) for t in (right, left)),
                    right.float().sum(-2), left.float().sum(-1))  # fmt: skip
        backward = (grad, torch.bfloat16, 1.0, False)
        d_left = (grad.float() @ right.float().mT).to(torch.bfloat16)
        d_right = (left.float().mT @ grad.float()).to(torch.bfloat16)
        for value in (math.inf, 1e30, 2.0**70):
            what = f"{kind} p={p} {value:g}"
            spoiled = output.clone()
            spoiled[5, p - 1] = value
            bound = bound_of(rounding, q, p)
            args = (left, right, spoiled, None, torch.bfloat16, 1.0, 1.0, False, bound, True, False)
            assert not check.output(*args)[0] <= 1.0, f"{what} forward"
            spoiled = d_left.clone()
            spoiled[6, 2] = value
            input_check = OperandCheck(spoiled, bound_of(rounding, p, q), True)
            ratio, _ = check.backward(*backward, -2, kept, input_check, None)
            assert not ratio <= 1.0, f"{what} input gradient"
            for along, stored in ((-2, d_right), (-1, d_right.mT.contiguous())):
                spoiled = stored.clone()
                spoiled.view(-1)[9] = value
                weight_check = OperandCheck(spoiled, bound_of(rounding, m, q), True)
                _, ratio = check.backward(*backward, along, kept, None, weight_check)
                assert not ratio <= 1.0, f"{what} weight gradient along {along}"


@pytest.mark.parametrize("kind", ["eager", "native"])
def test_a_clean_float32_linear_with_a_bias_passes_whatever_its_input_rows(kind: str) -> None:
    """A float32 Linear with a bias large beside its input rows (a zero row, rows scaled down
    to 1e-9): its output rounds the bias too, which the bound bounds by the bias's norm; clean,
    it passes on both paths (without that term the native path, summing the row in another
    order than torch sums the bias, alarmed at 1e29 on a zero row)."""
    check = Kernels(kind)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 256, generator=gen)
    for i, scale in enumerate((0.0, 1e-9, 1e-7, 1e-6, 1e-5, 1e-4)):
        x[i] *= scale
    weight, bias = 0.05 * torch.randn(384, 256, generator=gen), torch.randn(384, generator=gen)
    output = F.linear(x, weight, bias)
    bound = bound_of(_rounding(torch.float32), 256, 384)
    args = (x, weight.mT, output, bias, torch.float32, 1.0, 1.0, False, bound, False)
    assert float(check.output(*args, False)[0]) <= 0.5
    spoiled = output.clone()
    spoiled[0, 7] += 1e-3 * float(bias.norm())  # a fault the bias does not hide
    assert not check.output(x, weight.mT, spoiled, *args[3:], False)[0] <= 1.0


def test_native_figures_are_float32_whatever_torch_s_default_dtype() -> None:
    """The kernels write float32: their figures are float32 tensors even where torch's default
    dtype is float64 (they used to be float64 buffers holding float32 bits)."""
    gen = torch.Generator().manual_seed(6)
    left, right = torch.randn(32, 48, generator=gen), torch.randn(48, 40, generator=gen)
    bias = torch.randn(40, generator=gen)
    output = torch.addmm(bias, left, right)
    bound = bound_of(_rounding(torch.float32), 48, 40)
    args = (left, right, output, bias, torch.float32, 1.0, 1.0, False, bound, False, True)
    _, eager = EAGER.output(*args)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ratio, native = Kernels("native").output(*args)
    finally:
        torch.set_default_dtype(default)
    assert all(n.dtype == torch.float32 for n in (ratio, *native))
    for e, n in zip(eager, native, strict=True):
        torch.testing.assert_close(n, e, rtol=1e-5, atol=0)
    assert float(ratio) <= 0.5
