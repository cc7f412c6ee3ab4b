"""`matmul_checksum`'s checks of a plain product by a small C kernel (detectors/checksum.c):
each matrix a check needs read once, its sums, norms and products with the check's vector
together, the bound and the worst row's ratio in the same pass, where the eager path runs about
twenty tensor operations and several reads per product (docs/performance.md, "Fused checks").
Two calls per product: its forward check, and its backward's three (the output gradient's
figures, kept in the kernel's memory, then both operands' checks) once both operands'
gradients are made. A call's description of its tensors is kept per layout (`_Plan`): a later
call with the same layouts writes in only its tensors' addresses.

Entry contract: the arguments of the eager functions of the same names in
detectors/checksum_kernels.py (`backward_ratios`: of `Kernels.backward`), the reference, and
their figures back (float32, shaped to the product's batch), or None where the kernel does not
apply (a tensor off the CPU, a float16 or float64 operand or dtype) or cannot be built, and the
caller runs the eager functions. The two agree within a reduction's reordering, their verdicts
exactly (tests/unit/test_checksum_kernels.py). Built once per source, compiler and CPU, and
loaded once per process (detectors/native_build.py); where it cannot be built, the first
failure says so once in the process's log; a matrix it does not read (its dtype, its device),
once per kind."""

from __future__ import annotations

import array
import ctypes
import functools
import math
from collections.abc import Callable
from pathlib import Path

import torch

from detectors import native_build
from detectors.product_bounds import F32, Bound, Kept, OperandCheck

SOURCE = Path(__file__).with_name("checksum.c")
WHO = "matmul_checksum: native checks"
BF16 = torch.bfloat16
# (the tensor's dtype, the dtype it is read as): how the kernel reads it (checksum.c's enum).
READS = {(F32, F32): 0, (BF16, BF16): 1, (BF16, F32): 1, (F32, BF16): 2}
# Each function's arguments: matrices are checksum.c's `matrix` structs side by side, passed as
# one array of int64 (a pointer and nine sizes and strides each), and the bound as five doubles,
# both plain arrays: building ctypes structures costs more than the kernel on a small product,
# and, objects the garbage collector tracks, they would set it off every few steps.
POINTER, INT, REAL = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
SIGNATURES = {
    "forward_check": [POINTER, INT, INT, REAL, REAL, POINTER, *[POINTER] * 5],
    "backward_check": [POINTER, REAL, INT, *[POINTER] * 6, INT, POINTER],
    "rounding_check": [POINTER, POINTER, INT, INT],
}


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels of this process, built on first use; None if they cannot be built."""
    library = native_build.library(SOURCE, WHO)
    if library is not None:
        for name, argtypes in SIGNATURES.items():
            kernel = getattr(library, name)
            kernel.argtypes = argtypes
            kernel.restype = INT if name == "rounding_check" else None
    return library


class _Call:
    """One call's matrices, described for the kernel from its tensors (`sources`, by position),
    and the tensors the description points into (kept alive until the kernel has read them: a
    cast or a merged batch is a temporary)."""

    def __init__(self, sources: tuple[torch.Tensor, ...]) -> None:
        self.sources = sources
        self.held: list[torch.Tensor | array.array] = []
        self.fields: list[int] = []
        self.slots: list[tuple[int, int]] = []  # (the field of an address, its source)
        self.shapes: list[tuple[int, int, int]] = []  # each matrix's (batch matrices, rows, cols)
        self.pointers: list[tuple[int, int]] = []  # (an address argument, its source)
        self.applies = True
        self.copied = False  # some matrix is a copy of its source, not a view

    def _address(self, t: torch.Tensor, source: int) -> int:
        address = t.data_ptr()
        self.copied |= address != self.sources[source].data_ptr()
        return address

    def matrix(self, t: torch.Tensor, batch: torch.Size, read_as: torch.dtype, source: int) -> None:
        """Describe `t` (`sources[source]` or a view of it) [..., rows, cols], broadcast to
        `batch`, read as `read_as`."""
        kind = READS.get((t.dtype, read_as))
        if kind is None or t.device.type != "cpu":
            self.applies = False
            native_build.say_once(
                (WHO, t.dtype, read_as, t.device.type),
                "%s do not read a %s matrix read as %s on %s; the eager checks run instead, "
                "with the same verdicts", WHO, t.dtype, read_as, t.device.type,
            )  # fmt: skip
            return
        if t.shape[:-2] != batch:
            t = t.expand(*batch, *t.shape[-2:])
        dims = _batch_dims(t)
        if dims is None:  # more than two batch dimensions that do not merge
            t = t.contiguous()
            dims = _batch_dims(t)
        self.held.append(t)
        *_, rows, cols = t.shape
        *_, rstride, cstride = t.stride()
        self.slots.append((len(self.fields), source))
        self.shapes.append((dims[0] * dims[1], rows, cols))
        self.fields += [self._address(t, source), kind, *dims, rows, cols, rstride, cstride]

    def rows_first(
        self, t: torch.Tensor, batch: torch.Size, read_as: torch.dtype, source: int
    ) -> int:
        """Describe `t` as itself (0) or as its transpose (1), whichever has contiguous rows."""
        flip = t.stride(-1) != 1 and t.stride(-2) == 1 and t.shape[-1] > 1
        self.matrix(t.mT if flip else t, batch, read_as, source)
        return int(flip)

    def floats(self, t: torch.Tensor, shape: torch.Size, source: int) -> None:
        """A float32 figure (made by either path) laid out as the kernel indexes it: the next
        address argument."""
        if t.shape != shape or not t.is_contiguous() or t.dtype != F32:
            t = t.expand(shape).to(F32).contiguous()
            self.held.append(t)
        self.pointers.append((self._address(t, source), source))


class _Plan:
    """A call's description, kept per layout of its tensors (`_layouts`: dtypes, shapes,
    strides, device) and its flags, which alone decide it: a later call with the same layouts
    writes its own tensors' addresses into a copy of it. Describing costs several times the
    kernel's work on a small product. A description with a copy in it (a merged batch, a cast
    figure) is made anew at each call."""

    def __init__(self, call: _Call, extra: tuple) -> None:
        self.fields = array.array("q", call.fields)
        self.slots, self.pointers = tuple(call.slots), tuple(call.pointers)
        self.extra = extra  # what the kernel's caller needs besides: flags, output shapes
        self.held = call.held if call.copied else None  # a copy's own, for this call alone

    def bind(self, sources: tuple[torch.Tensor, ...]) -> tuple[array.array, list[int]]:
        """The matrices' description and the address arguments for these tensors."""
        if self.held is not None:
            return self.fields, [address for address, _ in self.pointers]
        fields = array.array("q", self.fields)
        for at, source in self.slots:
            fields[at] = sources[source].data_ptr()
        return fields, [sources[source].data_ptr() for _, source in self.pointers]


# Kept plans by `_layouts`: None where the kernel does not apply, ANEW where the description
# copies (not kept: the copy is the size of an operand).
_PLANS: dict[tuple, _Plan | str | None] = {}
ANEW = "anew"
# A model whose shapes change from step to step (a varying sequence length) makes a plan per
# shape: past this many, they are dropped and made again as met.
PLANS_KEPT = 4096


def _layouts(*tensors: torch.Tensor | None) -> tuple:
    return tuple(None if t is None else (t.dtype, t.shape, t.stride(), t.is_cpu) for t in tensors)


def _plan(
    key: tuple, sources: tuple[torch.Tensor, ...], describe: Callable[[_Call], tuple]
) -> _Plan | None:
    """The plan of a call whose layouts and flags are `key`: kept, or made by `describe` (which
    describes the call's matrices and returns the extra its caller needs)."""
    plan = _PLANS.get(key, ANEW)
    if plan is ANEW:
        call = _Call(sources)
        extra = describe(call)
        made = _Plan(call, extra) if call.applies else None
        if len(_PLANS) >= PLANS_KEPT:
            _PLANS.clear()
        _PLANS[key] = ANEW if made is not None and made.held is not None else made
        return made
    return plan


def _batch_dims(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """`t`'s batch dimensions as at most two: sizes, then strides; adjacent ones merged where
    their strides allow."""
    if t.dim() == 2:
        return 1, 1, 0, 0
    if t.dim() == 3:
        return 1, t.shape[0], 0, t.stride(0)
    dims: list[tuple[int, int]] = []
    for size, stride in zip(t.shape[:-2], t.stride()[:-2], strict=True):
        if size == 1:
            continue
        if dims and dims[-1][1] == size * stride:
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    if len(dims) > 2:
        return None
    (b0, s0), (b1, s1) = [(1, 0)] * (2 - len(dims)) + dims
    return b0, b1, s0, s1


_COEFFICIENTS: dict[tuple[Bound, bool], array.array] = {}


def _bound(bound: Bound, rows: bool) -> int:
    """The bound's coefficients as the kernel reads them, made once per bound."""
    coefficients = _COEFFICIENTS.get((bound, rows))
    if coefficients is None:
        coefficients = array.array("d", (*bound, float(rows)))
        _COEFFICIENTS[(bound, rows)] = coefficients
    return coefficients.buffer_info()[0]


def _flat(t: torch.Tensor, flat: bool) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if flat else t


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
) -> tuple[torch.Tensor, ...] | None:
    library = load()
    if library is None:
        return None
    sources = (left, right, measured, addend)
    plan = _plan(
        ("output", dtype, flat, *_layouts(*sources)), sources,
        functools.partial(_describe_output, dtype=dtype, flat=flat),
    )  # fmt: skip
    if plan is None:
        return None
    right_t, batch, (m, p) = plan.extra
    described, _ = plan.bind(sources)
    ratio, right_fro, left_fro = (torch.empty(shape, dtype=F32) for shape in ((), batch, batch))
    figures: tuple[torch.Tensor, ...] = (ratio, right_fro, left_fro)
    sums = [None, None]
    if keep:
        right_sums = torch.empty(*batch, p, dtype=F32)
        left_sums = torch.empty(*batch, m, dtype=F32)
        figures += (right_sums, left_sums)
        sums = [right_sums.data_ptr(), left_sums.data_ptr()]
    library.forward_check(
        described.buffer_info()[0], right_t, addend is not None, alpha, beta, _bound(bound, rows),
        right_fro.data_ptr(), left_fro.data_ptr(), *sums, ratio.data_ptr(),
    )  # fmt: skip
    return figures


def _describe_output(call: _Call, dtype: torch.dtype, flat: bool) -> tuple:
    left, right, measured, addend = call.sources
    out = _flat(measured, flat)
    batch = out.shape[:-2]
    call.matrix(_flat(left, flat), batch, dtype, 0)
    right_t = call.rows_first(right, batch, dtype, 1)
    call.matrix(out, batch, out.dtype, 2)
    if addend is not None:  # as the product adds it: cast to the kernel's dtype
        call.matrix(_flat(addend.expand(measured.shape), flat), batch, dtype, 3)
    if call.applies:
        # The kernel trusts the sizes (`_backward_agrees`).
        (n, m, q), right, output, *added = call.shapes
        inner, width = right[1:] if not right_t else right[:0:-1]
        call.applies = (
            (n, q) == (right[0], inner) and output == (n, m, width)
            and all(a == output for a in added)
            and n * m * width > 0  # an empty addend's address is null
        )  # fmt: skip
    return right_t, batch, call.shapes[2][1:] if call.applies else None


def backward_ratios(
    output_grad: torch.Tensor,
    dtype: torch.dtype,
    alpha: float,
    flat: bool,
    along: int,
    kept: Kept,
    input_check: OperandCheck | None,
    weight_check: OperandCheck | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """grad_figures, then left_ratio and right_ratio where their checks are given, in one call:
    the output gradient's figures stay in the kernel's memory."""
    library = load()
    if library is None:
        return None
    input_grad = None if input_check is None else input_check.grad
    weight_grad = None if weight_check is None else weight_check.grad
    sources = (output_grad, *kept, input_grad, weight_grad)
    plan = _plan(
        ("backward", dtype, flat, along, *_layouts(*sources)), sources,
        functools.partial(_describe_backward, dtype=dtype, flat=flat, along=along),
    )  # fmt: skip
    if plan is None:
        return None
    grad_t, (described, figures) = plan.extra, plan.bind(sources)
    left_bound = weight_bound = None
    if input_check is not None:
        left_bound = _bound(input_check.bound, input_check.rows)
    if weight_check is not None:
        weight_bound = _bound(weight_check.bound, weight_check.rows)
    ratios = torch.empty(2, dtype=F32)
    which = (input_check is not None) | (weight_check is not None) << 1
    library.backward_check(
        described.buffer_info()[0], alpha, which, *figures, left_bound, weight_bound, grad_t,
        ratios.data_ptr(),
    )  # fmt: skip
    input_ratio, weight_ratio = ratios.unbind()
    return (
        input_ratio if input_check is not None else None,
        weight_ratio if weight_check is not None else None,
    )


def _describe_backward(call: _Call, dtype: torch.dtype, flat: bool, along: int) -> int:
    output_grad, right_fro, left_fro, right_sums, left_sums, input_grad, weight_grad = call.sources
    output_grad = _flat(output_grad, flat)
    batch, (m, p) = output_grad.shape[:-2], output_grad.shape[-2:]
    call.matrix(output_grad, batch, dtype, 0)
    if input_grad is not None:
        grad = _flat(input_grad, flat)
        call.matrix(grad, grad.shape[:-2], grad.dtype, 5)
    grad_t = 0
    if weight_grad is not None:
        grad = weight_grad if along == -2 else weight_grad.mT  # dR itself: its columns summed
        grad_t = call.rows_first(grad, weight_grad.shape[:-2], weight_grad.dtype, 6)
    call.floats(right_sums, torch.Size((*batch, p)), 3)
    call.floats(left_sums, torch.Size((*batch, m)), 4)
    call.floats(right_fro, batch, 1)
    call.floats(left_fro, batch, 2)
    if call.applies:
        call.applies = _backward_agrees(call.shapes, grad_t, input_grad is not None)
    return grad_t


def _backward_agrees(shapes: list[tuple[int, int, int]], grad_t: int, input_checked: bool) -> bool:
    """Whether the backward's matrices agree with dP's sizes where the kernel indexes by them:
    it trusts them (one that did not, a weight's gradient given the wrong way round, would read
    and write past its buffers), so a call they do not fit runs eagerly, where torch says what
    is wrong. dL: its rows are dP's; dR: its columns are as many as dP's."""
    (n, m, p), *operands = shapes
    if input_checked and operands.pop(0)[:2] != (n, m):
        return False
    if not operands:
        return True
    batches, rows, cols = operands[0]
    return batches == n and (rows if grad_t else cols) == p


def rounding_ratio(
    rounded: torch.Tensor, wide: torch.Tensor, low: torch.dtype
) -> torch.Tensor | None:
    """product_bounds.rounding_ratio of a bfloat16 rounding, in one read of both: 0, or infinite
    where an element is not `wide` rounded once (a NaN against a NaN of any payload)."""
    library = load()
    applies = (
        library is not None and low == BF16 and wide.dtype == F32 and rounded.dtype in (F32, BF16)
        and rounded.shape == wide.shape and rounded.device.type == wide.device.type == "cpu"
        and rounded.is_contiguous() and wide.is_contiguous()
    )  # fmt: skip
    if not applies:
        return None
    wrong = library.rounding_check(
        wide.data_ptr(), rounded.data_ptr(), int(rounded.dtype == F32), wide.numel()
    )
    return torch.full((), math.inf if wrong else 0.0, dtype=F32)
