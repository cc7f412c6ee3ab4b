"""The arithmetic of `matmul_checksum`'s checks of a plain product (one matrix, or a batch of
them), as pure functions of tensors and host floats in one source that runs two ways:
eagerly, the reference, or compiled by Inductor (`torch.compile`: C++/OpenMP on the CPU,
Triton on a GPU), which fuses the reductions that read the same operand into one pass and the
twenty-odd small operations of a check into a few kernels (docs/performance.md). A third way,
the CPU's default: the same checks hand-written in C, each matrix read once
(detectors/native_checksum.py), the eager functions where it does not apply.

Entry contract: operands as the product read them before the kernel's casts (left [..., m, q],
right [..., q, p]), the product's output [..., m, p] as the check measures it; `dtype` the
kernel's (the casts are repeated here, where the compiled pass fuses them into its reads);
`flat` merges L's leading dimensions into rows. Every figure returned is float32 on the
operands' device; the caller runs these without autograd or autocast. Compiled and eager
figures agree within a reduction's reordering and their verdicts exactly on the layouts tested
(tests/unit/test_checksum_kernels.py); a value within that reordering of its bound, as a clean
row's rounding is under a bound set far narrower than the default, may be judged either way.

`Kernels("compiled")` compiles each function once per process, dtype and rank, with dynamic
shapes, so one compile serves every shape of a run and every check made in the process.
Inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR, by default under the system's temporary
folder) serves later processes: a world's other ranks, later trials and runs. Where nothing
compiles (no C++ compiler on the CPU, no Triton on a GPU), the first failure says so once in
the process's log and every later call runs eagerly, with the same verdicts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from detectors import native_checksum
from detectors.norms import row_norms
from detectors.product_bounds import (
    F32,
    Bound,
    Kept,
    OperandCheck,
    addend_figures,
    bounded_ratio,
    rounding_ratio,
)

logger = logging.getLogger(__name__)

KERNELS = ("native", "eager", "compiled")

# Graphs per function: dtypes x ranks x (bias, input addend, none) x (rows read or bounded).
RECOMPILE_LIMIT = 64


def _as_read(left: torch.Tensor, dtype: torch.dtype, flat: bool) -> torch.Tensor:
    """L as the kernel read it (an autocast kernel's cast, repeated), its leading dimensions
    merged into rows where `flat`."""
    left = left.to(dtype)
    return left.reshape(-1, left.shape[-1]) if flat else left


def _times_column(matrix: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """M c for M [..., m, q] and c [..., q, 1], as [..., m]. A batch of them as a dot product
    per row: a batched product with one column costs 3-4x that on the CPU (gpt's attention,
    [16, 4, 64, 64] by [16, 4, 64, 1], one thread: 231 us against 58)."""
    if matrix.dim() == 2 and column.dim() == 2:
        return (matrix @ column).squeeze(-1)
    return torch.linalg.vecdot(matrix, column.transpose(-1, -2))


def output_figures(
    left: torch.Tensor,
    right: torch.Tensor,
    measured: torch.Tensor,
    addend: torch.Tensor | None,
    dtype: torch.dtype,
    alpha: float,
    beta: float,
    flat: bool,
    bound: Bound,
    rows: bool,
    keep: bool,
) -> tuple[torch.Tensor, ...]:
    """The forward check: the worst row's ratio of P e against alpha L (R e) (+ beta times the
    addend's row sums), then ||R||_F and ||L||_F, and with `keep` (the backward is checked)
    R^T e and L e: what the backward's checks read of the operands (`Kept`). `rows`: read
    ||P_i|| (a 16-bit output) instead of bounding it (by ||L_i|| ||R||_F and the addend's
    norm: a float32 output's rounding grows with the bias it holds too)."""
    left, right = _as_read(left, dtype, flat), right.to(dtype)
    out = measured.reshape(-1, measured.shape[-1]) if flat else measured
    sums = right.sum(-1, keepdim=True, dtype=F32)
    right_fro = torch.linalg.vector_norm(right, dim=(-2, -1), dtype=F32)
    expected = _times_column(left.to(F32), sums)
    if alpha != 1:
        expected = alpha * expected
    addend_norm = None
    if addend is not None:
        summed, addend_norm = addend_figures(addend, dtype, beta, measured.shape, flat, not rows)
        expected = expected + summed
    left_norm = torch.linalg.vector_norm(left, dim=-1, dtype=F32)
    left_fro = torch.linalg.vector_norm(left_norm, dim=-1)
    if alpha != 1:
        left_norm = left_norm * abs(alpha)
    row_norm = row_norms(out) if rows else None
    sums_norm = torch.linalg.vector_norm(sums, dim=(-2, -1))
    ratio = bounded_ratio(
        out.sum(-1, dtype=F32), expected, row_norm, left_norm, right_fro, sums_norm, bound,
        addend_norm,
    )  # fmt: skip
    if not keep:
        return ratio, right_fro, left_fro
    return ratio, right_fro, left_fro, right.sum(-2, dtype=F32), left.sum(-1, dtype=F32)


def grad_figures(
    right_sums: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype, alpha: float, flat: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the output's gradient dP [..., m, p]: dP (R^T e) and the rows' norms ||dP_i|| (each
    alpha times, as both operands' gradients are), and ||R^T e||, R^T e the forward's."""
    grad = grad.to(dtype)
    if flat:
        grad = grad.reshape(-1, grad.shape[-1])
    projected = _times_column(grad.to(F32), right_sums.unsqueeze(-1))
    norms = torch.linalg.vector_norm(grad, dim=-1, dtype=F32)
    if alpha != 1:
        projected, norms = alpha * projected, abs(alpha) * norms
    return projected, norms, torch.linalg.vector_norm(right_sums, dim=-1)


def left_ratio(
    grad: torch.Tensor,
    projected: torch.Tensor,
    grad_norms: torch.Tensor,
    right_fro: torch.Tensor,
    sums_norm: torch.Tensor,
    flat: bool,
    bound: Bound,
    rows: bool,
) -> torch.Tensor:
    """dL = alpha dP R^T: dL e against alpha dP (R^T e)."""
    out = grad.reshape(-1, grad.shape[-1]) if flat else grad
    row_norm = row_norms(out) if rows else None
    return bounded_ratio(
        out.sum(-1, dtype=F32), projected, row_norm, grad_norms, right_fro, sums_norm, bound
    )


def right_ratio(
    grad: torch.Tensor,
    output_grad: torch.Tensor,
    dtype: torch.dtype,
    alpha: float,
    left_sums: torch.Tensor,
    left_fro: torch.Tensor,
    grad_norms: torch.Tensor,
    along: int,
    flat: bool,
    bound: Bound,
    rows: bool,
) -> torch.Tensor:
    """dR = alpha L^T dP, checked by its columns: e^T dR, summed along `along` (a Linear's
    weight gradient is dR^T), against alpha (L e)^T dP, L e the forward's. These are the rows of
    dR^T = alpha dP^T L, bounded as a product's rows are, with ||dP||_F for the norms of dP's
    columns (detectors/product_bounds.py)."""
    output_grad = output_grad.to(dtype)
    if flat:
        output_grad = output_grad.reshape(-1, output_grad.shape[-1])
    expected = (left_sums.unsqueeze(-2) @ output_grad.to(F32)).squeeze(-2)
    if alpha != 1:
        expected = alpha * expected
    row_norm = row_norms(grad, along) if rows else None
    return bounded_ratio(
        grad.sum(along, dtype=F32), expected, row_norm,
        torch.linalg.vector_norm(grad_norms, dim=-1).unsqueeze(-1), left_fro,
        torch.linalg.vector_norm(left_sums, dim=-1), bound,
    )  # fmt: skip


F = TypeVar("F", bound=Callable)

# Per process, shared by every check made in it (a trial's, the next trial's): each function's
# compiled form, made on first use, so later checks reuse its graphs instead of tracing again;
# and the compile error that turned compiling off, said once.
_COMPILED: dict[str, Callable] = {}
_FAILED: list[str] = []


def _compiled(fn: Callable) -> Callable:
    fast = _COMPILED.get(fn.__name__)
    if fast is None:
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT
        )
        # Inductor would otherwise drop a cast down and back up (it computes 16-bit values in
        # float32), and the checks repeat an autocast kernel's casts of its operands exactly.
        options = {"emulate_precision_casts": True}
        fast = _COMPILED[fn.__name__] = torch.compile(fn, dynamic=True, options=options)
    return fast


class Kernels:
    """The four checks, by `kind` (KERNELS): natively where the C kernel applies, else eagerly;
    compiled, falling back to eager in this process from the first failure to compile on."""

    def __init__(self, kind: str):
        self.kind = kind
        self.figures = self._wrap(output_figures, native_checksum.output_figures)
        # The backward's three checks, one by one; natively all three in one call (`backward`).
        self.grad = self._wrap(grad_figures)
        self.left = self._wrap(left_ratio)
        self.right = self._wrap(right_ratio)
        # The exact check of a rounding (emulated numerics) is one comparison: nothing to fuse.
        self.rounding = rounding_ratio
        if kind == "native":
            self.rounding = self._wrap(rounding_ratio, native_checksum.rounding_ratio)

    def output(self, *args: object) -> tuple[torch.Tensor, Kept]:
        """The forward check (`output_figures`, its arguments): its ratio, and what the
        backward's checks keep."""
        ratio, *kept = self.figures(*args)
        return ratio, Kept(*kept)

    def backward(
        self,
        output_grad: torch.Tensor,
        dtype: torch.dtype,
        alpha: float,
        flat: bool,
        along: int,
        kept: Kept,
        input_check: OperandCheck | None,
        weight_check: OperandCheck | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A product's backward checked once both operands' gradients are made, from dP and what
        the forward check kept (with `keep`): the output gradient's figures (`grad`), then the
        input gradient's ratio (`left`) and the weight gradient's (`right`, its sums along
        `along`), each where its check is given. Natively in one call where the C kernel
        applies (one description and one entry for the three), else as the three."""
        if self.kind == "native":
            ratios = native_checksum.backward_ratios(
                output_grad, dtype, alpha, flat, along, kept, input_check, weight_check
            )
            if ratios is not None:
                return ratios
        projected, norms, sums_norm = self.grad(kept.right_sums, output_grad, dtype, alpha, flat)
        input_ratio = weight_ratio = None
        if input_check is not None:
            grad, bound, rows = input_check
            input_ratio = self.left(
                grad, projected, norms, kept.right_fro, sums_norm, flat, bound, rows
            )
        if weight_check is not None:
            grad, bound, rows = weight_check
            weight_ratio = self.right(
                grad, output_grad, dtype, alpha, kept.left_sums, kept.left_fro, norms, along,
                flat, bound, rows,
            )  # fmt: skip
        return input_ratio, weight_ratio

    @property
    def compiled(self) -> bool:
        """Compiled as requested, and no compile has failed in this process."""
        return self.kind == "compiled" and not _FAILED

    def _wrap(self, fn: F, native: Callable | None = None) -> F:
        if self.kind == "eager" or (self.kind == "native" and native is None):
            return fn
        if self.kind == "native":

            def fused(*args):
                figures = native(*args)
                return fn(*args) if figures is None else figures

            return fused  # type: ignore[return-value]

        def run(*args):
            if not _FAILED:
                # Parameters (a Linear's bias) as plain tensors: Dynamo holds a parameter's
                # shape static, and would compile once per layer width.
                plain = [a.detach() if isinstance(a, torch.nn.Parameter) else a for a in args]
                try:
                    return _compiled(fn)(*plain)
                except Exception as error:  # a missing compiler shows in many exception types
                    _FAILED.append(f"{type(error).__name__}: {_first_line(error)}")
                    logger.warning(
                        "matmul_checksum: compiled kernels unavailable (%s); the eager checks "
                        "run instead, with the same verdicts", _FAILED[0],
                    )  # fmt: skip
            return fn(*args)

        return run  # type: ignore[return-value]


def _first_line(error: Exception) -> str:
    text = str(error)
    return text.splitlines()[0] if text else ""
