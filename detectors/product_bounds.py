"""What `matmul_checksum` (detectors/matmul_checksum.py) computes for one product: the call
read as a product (`product_of`), its rows' checksum errors against their rounding bound
(`bound_of`, `bounded_ratio`), the exact check of a rounding (`rounding_ratio`), and the product
FLOPs it verifies (`checked_flops`, for campaign.json's product_coverage).

A product P = L R (of L [..., m, q] and R [..., q, p]) must satisfy P e = L (R e), e the vector
of ones: each row's sum against the row of L times the row sums of R, O(operands) work for an
O(m q p) product. Checked, when the product is computed:
    forward   C = A B (F.linear: x W^T + b; addmm, baddbmm: beta input + alpha A B)
    backward  dA = dC B^T and dB = A^T dC, the gradients the product's backward computes for its
              operands (a Linear's input and weight), each when it reaches that operand
A row sums over features, never over tokens: rows that are alike (padding, a repeated input)
never add up their rounding errors in one sum.

The bound. u_o is the unit roundoff of the product's dtype (bfloat16 2^-8, float16 2^-11,
float32 2^-24), u_a that of its accumulation (float32 for 16- and 32-bit kernels, float64 for
float64), u_i that of the operands where the kernel rounds them: a float32 kernel at the
precision torch lets its backend use (`operand_rounding`: TF32 2^-11, bfloat16 2^-8; else 0: an
autocast kernel's operand casts are repeated here exactly). Row i of P passes when

    |sum_j P_ij - L_i . (R e)| <= s [ (u_o + sqrt(p) u_a) ||P_i||
                                       + (u_a (sqrt(q) + sqrt(p)) + sqrt(2) u_i) ||L_i|| ||R||_F
                                       + (sqrt(q) u_a + sqrt(2) u_i) ||L_i|| ||R e|| ] + p tiny

with s = `sigmas` and tiny float32's smallest normal, each norm taken NORM_SLACK larger: a
float32 sum of squares drops those below tiny (elements under 2^-63), so a row of about 1e-23
(an attention score gradient's under a sharp softmax, in float16) had a norm of 0, a bound of
p tiny, and its sum's own float32 rounding read as a fault. Two terms read a cheaper upper bound: a
32- or 64-bit product reads ||L_i|| ||R||_F + ||a_i|| for ||P_i|| (Cauchy-Schwarz and the
triangle inequality, a_i the row's addend, beta times: a bias large beside a small input row
is most of what the output rounds), and a weight gradient dR = L^T dP, checked by its
columns as the rows of dR^T = dP^T L (that product's P e = L (R e) with dP^T for L and L for
R), reads ||dP||_F for its rows' norms, dP's columns (a reduction along columns costs twenty
times one along rows on the CPU). Both gradients' checks take what they need of the operands,
R^T e, L e and the Frobenius norms, from the forward check (`Kept`): the backward reads dP and
the gradients only, not the operands again. ||P_i|| itself, where read, is summed in float64
(detectors/norms.py): a 16-bit fault of 2^64 or more overflows a float32 sum of squares, and an
infinite norm would hide the fault in an infinite bound.
An addend (a Linear's bias, addmm's input) is added in the accumulation and the sum rounded
once, as BLAS's gemm with beta does (and as the CPU's F.linear was measured to: 0.002% of
bfloat16 outputs differ from one rounding of the float32 result, 27% from two): a model that
adds a bias itself does it in an operation of its own, outside the product. Each term bounds a
sum of independent rounding errors by Hoeffding's inequality, as Higham and Mary's probabilistic
error analysis does: the product's own rounding to its dtype (u_o ||P_i||, which dominates in 16
bits), its accumulation over q (by Cauchy-Schwarz, sum_l |L_il R_lj| <= ||L_i|| ||R_:j||), and
the check's own sums over p and q, and its own product L (R e), which a backend at that
precision computes from rounded operands too (a cuDNN convolution with the summed filter, a
GEMM of one column). A clean row exceeds it with probability below 2 exp(-s^2 /
2): 2.5e-14 at the default 8. A change d of one element of row i is caught when |d| exceeds the
row's bound: in bfloat16 about s u_o ||P_i|| = ||P_i|| / 32, a third of the row's RMS at p =
128; in float32 a few tenths of a percent of ||L_i|| ||R||_F at gpt's sizes. What falls below is
the check's blind band (docs/detectors.md). MindSpore's check for bfloat16, c_max 2^-8 sqrt(n),
is a bound on the largest element of a whole matrix: each row's own norm is tighter wherever
rows differ in scale.

Under emulated numerics (harness/core/emulation.py: a 16-bit product is the float32 product of
16-bit values, rounded once) the watch computes the product itself and hands over the float32
product before its rounding (`MatmulCall.accumulator`) and, in backward, each operand's float32
gradient before its rounding (`MatmulCall.wide_grads`). The check then reads those against the
32-bit bound (u_o of float32: about 2^16 tighter than the 16-bit one) and checks each rounding
exactly (`rounding_ratio`): the 16-bit value must equal the float32 one rounded, bit for bit,
which a clean run always meets and any change of the 16-bit value breaks. That closes the 16-bit
blind band for every product the emulation computes (docs/detectors.md); elsewhere (native
numerics, cuda) the 16-bit bound stands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from detectors import convolutions
from harness.core.matmuls import MatmulCall

F32 = torch.float32
TINY = torch.finfo(F32).tiny
# What a float32 norm of up to 2^32 elements may lose to squares below TINY, each under 2^-126:
# sqrt(2^32 2^-126). Next to a norm of 1e-10 it is 7e-5 of it; the C kernel's is the same.
NORM_SLACK = 2.0**-47
# The operands' rounding inside a float32 kernel, by the precision torch lets its backend use.
PRECISION_ROUNDING = {"tf32": 2.0**-11, "bf16": 2.0**-8}


def operand_rounding(device: torch.device, convolution: bool) -> float:
    """u_i of a float32 product on `device`: what torch lets the backend that computes it
    round its operands to (`torch.backends.*.fp32_precision`, each setting inheriting
    `torch.backends.fp32_precision`): cuBLAS's matmuls and cuDNN's convolutions on a GPU, where
    a convolution is TF32 by default; oneDNN's on the CPU. The settings are read, not torch's
    legacy `get_float32_matmul_precision`, which raises once a job uses them."""
    backends = torch.backends
    if device.type == "cuda":
        setting = backends.cudnn.conv if convolution else backends.cuda.matmul
    elif device.type == "cpu":
        setting = backends.mkldnn.conv if convolution else backends.mkldnn.matmul
    else:
        return 0.0
    return PRECISION_ROUNDING.get(setting.fp32_precision, 0.0)


def roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


@dataclass
class Product:
    """P = alpha L R (+ beta addend), as a kernel of dtype `dtype` reads it: L [..., m, q] and
    R [..., q, p], with L's leading dimensions merged into rows where R is a matrix."""

    left: torch.Tensor
    right: torch.Tensor
    addend: torch.Tensor | None
    alpha: float
    beta: float
    left_at: int  # where the operands are in the call's arguments
    right_at: int
    transposed: bool  # R is the argument transposed (F.linear's weight)
    # A grouped product (torch._grouped_mm): R [E, q, p] one matrix per group of L's rows, `offs`
    # the cumulative row counts (detectors/grouped_products.py).
    offs: torch.Tensor | None = None
    # torch.matmul's 1-D operands, read as a row [1, q] (left) or a column [q, 1] (right): the
    # product's output and the operands' gradients lack that dimension until `as_*` adds it.
    vectors: tuple[bool, bool] = (False, False)

    def checks_grad(self, operand: torch.Tensor, output: torch.Tensor) -> bool:
        """An operand's gradient is one product when it is not broadcast over P's batch."""
        return operand.shape[:-2] == output.shape[:-2]

    def as_output(self, t: torch.Tensor) -> torch.Tensor:
        """The output (or its gradient) as [..., m, p]."""
        t = t.unsqueeze(-1) if self.vectors[1] else t
        return t.unsqueeze(-2) if self.vectors[0] else t

    def as_left(self, grad: torch.Tensor) -> torch.Tensor:
        return grad.unsqueeze(0) if self.vectors[0] else grad

    def as_right(self, grad: torch.Tensor) -> torch.Tensor:
        return grad.unsqueeze(-1) if self.vectors[1] else grad


def product_of(call: MatmulCall) -> Product | None:
    """The call as a product, or None for one this check does not verify."""
    args, kwargs = call.args, call.kwargs
    if "out" in kwargs or call.func in convolutions.FUNCS:
        return None
    if call.func is F.linear:
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        x, w = args[0], args[1]
        found = Product(x, w.transpose(-1, -2), bias, 1.0, 1.0, 0, 1, True)
    elif call.func is torch._grouped_mm:
        return _grouped(args, kwargs)
    elif call.func in ADDENDS:
        beta, alpha = float(kwargs.get("beta", 1)), float(kwargs.get("alpha", 1))
        found = Product(args[1], args[2], args[0], alpha, beta, 1, 2, False)
    else:
        found = Product(args[0], args[1], None, 1.0, 1.0, 0, 1, False)
    tensors = [found.left, found.right] + ([] if found.addend is None else [found.addend])
    if not all(convolutions.readable(t) for t in tensors):
        return None
    if call.func in VECTOR_PRODUCTS:
        left, right = found.left, found.right
        found.vectors = (left.dim() == 1, right.dim() == 1)
        found.left = left.unsqueeze(0) if left.dim() == 1 else left
        found.right = right.unsqueeze(-1) if right.dim() == 1 else right
    if found.left.dim() < 2 or found.right.dim() < 2:
        return None
    return found


# The products with an addend, their first argument (a tensor's method: the tensor).
ADDENDS = (torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm)
# The products that take 1-D operands (torch.matmul's rules: a vector is a row on the left, a
# column on the right, and that dimension is dropped from the output).
VECTOR_PRODUCTS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)


def _grouped(args: list, kwargs: dict) -> Product | None:
    """A mixture of experts' grouped product: 2-D tokens against 3-D experts, no bias, the
    output in the operands' dtype; other grouped layouts are not verified."""
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    extra = len(args) > 3 or any(kwargs.get(k) is not None for k in ("bias", "out_dtype"))
    left, right = args[0], args[1]
    if offs is None or extra or not all(convolutions.readable(t) for t in (left, right)):
        return None
    if left.dim() != 2 or right.dim() != 3 or offs.dim() != 1:
        return None
    return Product(left, right, None, 1.0, 1.0, 0, 1, False, offs)


def checked_flops(call: MatmulCall, output: torch.Tensor, backward: bool) -> int:
    """The product FLOPs of `call` that this check verifies: 2 m q p for the forward product
    and, with `backward`, as much for each operand gradient it checks (as `_check_left` and
    `_check_right` decide), that operand requiring a gradient."""
    if call.func in convolutions.FUNCS:  # forward only (detectors/convolutions.py)
        return convolutions.forward_flops(call, output) if convolutions.checkable(call) else 0
    product = product_of(call)
    if product is None:
        return 0
    each = 2 * output.numel() * product.right.shape[-2]
    flat = product.right.dim() == 2 and product.left.dim() > 2
    checked = each
    for at, operand in ((product.left_at, product.left), (product.right_at, product.right)):
        if not (backward and call.args[at].requires_grad):
            continue
        if (
            product.offs is not None
            or flat
            or product.checks_grad(operand, product.as_output(output))
        ):
            checked += each
    return checked


@dataclass(frozen=True)
class Rounding:
    """The unit roundoffs of one product (module docstring): its dtype's, its accumulation's,
    its operands' inside the kernel; and the bound's width in Hoeffding widths."""

    out: float
    acc: float
    operands: float
    sigmas: float

    @property
    def fine(self) -> bool:
        """A 32- or 64-bit product: its own rounding is negligible, and ||P_i|| is bounded by
        ||L_i|| ||R||_F (Cauchy-Schwarz) instead of being read."""
        return self.out < 1e-6


class Bound(NamedTuple):
    """A product's bound (module docstring) as coefficients folded on the host (each tensor
    operation costs microseconds on the CPU): of ||P_i|| (`row`), of ||L_i|| ||R||_F (`fro`), of
    ||L_i|| ||R e|| (`sums`), and the floor p tiny."""

    row: float
    fro: float
    sums: float
    floor: float


class OperandCheck(NamedTuple):
    """One operand's gradient under check in its product's backward: as measured, its bound,
    and whether the bound reads the gradient's rows' norms (16 bits)."""

    grad: torch.Tensor
    bound: Bound
    rows: bool


class Kept(NamedTuple):
    """What a product's forward check keeps for its backward's, so that the backward reads only
    the gradients: per batch matrix ||R||_F and ||L||_F, and, where the backward is checked,
    R^T e [..., p] and L e [..., m] (rows merged where the check merged them)."""

    right_fro: torch.Tensor
    left_fro: torch.Tensor
    right_sums: torch.Tensor | None = None
    left_sums: torch.Tensor | None = None


def bound_of(rounding: Rounding, inner: int, length: int) -> Bound:
    s, q, p = rounding.sigmas, math.sqrt(inner), math.sqrt(length)
    return Bound(
        row=s * (rounding.out + p * rounding.acc),
        fro=s * (rounding.acc * (q + p) + math.sqrt(2) * rounding.operands),
        sums=s * (q * rounding.acc + math.sqrt(2) * rounding.operands),
        floor=length * TINY,
    )


def bounded_ratio(
    actual: torch.Tensor,
    expected: torch.Tensor,
    row_norm: torch.Tensor | None,
    left_norm: torch.Tensor,
    right_fro: torch.Tensor,
    right_sums_norm: torch.Tensor,
    bound: Bound,
    addend_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """The largest ratio over the rows of |P_i e - L_i (R e)| to the row's bound (module
    docstring), a 0-d tensor: above 1, NaN or infinite when a row breaks it; rows whose operands'
    checksum is not finite count 0 (a fault upstream, not this product's). `row_norm` None: the
    Cauchy-Schwarz bound ||L_i|| ||R||_F stands for ||P_i||, plus `addend_norm` (the norm of the
    row's addend, beta times) where the product adds one; read, it is detectors/norms.py's."""
    # Products and sums, not `alpha=` arguments: a compiled check would specialise on those.
    right_fro, right_sums_norm = right_fro + NORM_SLACK, right_sums_norm + NORM_SLACK
    left_norm = left_norm + NORM_SLACK
    if row_norm is None:
        per_left = right_fro * (bound.fro + bound.row) + right_sums_norm * bound.sums
        addend = NORM_SLACK if addend_norm is None else addend_norm + NORM_SLACK
        limit = left_norm * per_left.unsqueeze(-1) + addend * bound.row
    else:
        per_left = right_fro * bound.fro + right_sums_norm * bound.sums
        limit = (row_norm + NORM_SLACK) * bound.row + left_norm * per_left.unsqueeze(-1)
    ratio = (actual - expected).abs_().div_(limit.add_(bound.floor))
    return torch.where(torch.isfinite(expected), ratio, 0.0).amax()


def addend_figures(
    addend: torch.Tensor,
    dtype: torch.dtype,
    beta: float,
    shape: torch.Size,
    flat: bool,
    norms: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The addend's part of each row of an output of `shape`, as the kernel adds it (cast to
    `dtype`, beta times): its sum and, with `norms`, its norm; one figure for all rows (a bias,
    a row as wide as the output) or one per row, merged into one dimension of rows where
    `flat`."""
    addend = addend.to(dtype)
    if addend.dim() == 1 and addend.shape[0] == shape[-1]:  # not one number broadcast
        norm = abs(beta) * torch.linalg.vector_norm(addend, dtype=F32) if norms else None
        return beta * addend.sum(dtype=F32), norm
    wide = addend.expand(shape)
    total = beta * wide.sum(-1, dtype=F32)
    norm = abs(beta) * torch.linalg.vector_norm(wide, dim=-1, dtype=F32) if norms else None
    if flat:
        return total.reshape(-1), None if norm is None else norm.reshape(-1)
    return total, norm


def rounding_ratio(rounded: torch.Tensor, wide: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """0 when `rounded` holds `wide` rounded once to `low` (then widened exactly to its own
    dtype), infinite when an element does not: the rounding is exact, so any change is a fault.
    Compared bit for bit: a NaN from upstream rounds to the same bits in both, so only this
    product's own change counts (and the comparison of integers is 3x faster on the CPU than
    one of 16-bit floats)."""
    expected = wide.to(low).to(rounded.dtype)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[rounded.element_size()]
    wrong = torch.ne(rounded.view(bits), expected.view(bits)).any()
    return torch.where(wrong, math.inf, 0.0)
