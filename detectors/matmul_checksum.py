"""`matmul_checksum`: every matrix multiply of the forward (harness/core/matmuls.py: F.linear,
matmul, mm, bmm, addmm, baddbmm, a mixture of experts' grouped products, and attention's score
and value products where the call runs on the math backend) verified in the step that computes
it, with the rank and the module named: a checksum in the line of Huang and Abraham's
algorithm-based fault tolerance.

Attention (harness/core/attention.py) is checked as the math backend computes it: the score
product S = (Q sqrt(s)) (K sqrt(s))^T in float32 before the mask is added (a fault in a score
the mask then discards is still in S's row sum), and the value product P V of the softmax's
probabilities; both are float32 products, so their bound is the fine one below. A call on a
fused backend (flash, memory-efficient, cuDNN: the CPU's default, and the GPU's) never forms S
or P and is not checked; the harness's ranks pin the math backend, and under the guard a job
has its attention checked where it runs on the math backend (`sdpa_kernel(SDPBackend.MATH)`).

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
float64), u_i that of the operands where the kernel rounds them (float32 under
`torch.set_float32_matmul_precision`: "high" TF32 2^-11, "medium" bfloat16 2^-8; else 0: an
autocast kernel's operand casts are repeated here exactly). Row i of P passes when

    |sum_j P_ij - L_i . (R e)| <= s [ (u_o + sqrt(p) u_a) ||P_i||
                                       + (u_a (sqrt(q) + sqrt(p)) + sqrt(2) u_i) ||L_i|| ||R||_F
                                       + sqrt(q) u_a ||L_i|| ||R e|| ] + p tiny

with s = `sigmas` and tiny float32's smallest normal. Two terms read a cheaper upper bound: a
32- or 64-bit product reads ||L_i|| ||R||_F for ||P_i|| (Cauchy-Schwarz; its own rounding is
negligible there), and a weight gradient dR = L^T dP reads ||L||_F for its rows' ||L_i||, the
norms of L's columns (a reduction along columns costs twenty times one along rows on the CPU).
An addend (a Linear's bias, addmm's input) is added in the accumulation and the sum rounded
once, as BLAS's gemm with beta does (and as the CPU's F.linear was measured to: 0.002% of
bfloat16 outputs differ from one rounding of the float32 result, 27% from two): a model that
adds a bias itself does it in an operation of its own, outside the product. Each term bounds a
sum of independent rounding errors by Hoeffding's inequality, as Higham and Mary's probabilistic
error analysis does: the product's own rounding to its dtype (u_o ||P_i||, which dominates in 16
bits), its accumulation over q (by Cauchy-Schwarz, sum_l |L_il R_lj| <= ||L_i|| ||R_:j||), and
the check's own sums over p and q. A clean row exceeds it with probability below 2 exp(-s^2 /
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

Cost: a sum and a norm of each operand and of the product's rows, and one product of L with a
vector, per checked product (benchmarks: docs/performance.md); `interval` and `fraction` (a
seeded share of the products of a checked step) trade it against coverage. The verdicts stay on
the device until the step's read (harness/core/verdicts.py); no collective: each rank judges the
products it computed.

Backward checks keep a reference to the operands until backward (the product's backward keeps
them too, except under autocast, where it keeps its 16-bit copies and this check the originals).
Products it cannot check in backward: an operand broadcast over the product's batch dimensions
(its gradient is a sum over them); 1-D operands are not checked at all.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from detectors import grouped_products as grouped
from harness.core.checks import CheckConfig
from harness.core.matmuls import MatmulCall, Tap
from harness.core.plugins import Detector, DetectorContext, EventLog
from harness.core.values import above, flag, fraction, integer

F32 = torch.float32
TINY = torch.finfo(F32).tiny
# The operands' rounding inside a float32 kernel, by torch's float32 matmul precision.
OPERAND_ROUNDING = {"highest": 0.0, "high": 2.0**-11, "medium": 2.0**-8}


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

    def checks_grad(self, operand: torch.Tensor, output: torch.Tensor) -> bool:
        """An operand's gradient is one product when it is not broadcast over P's batch."""
        return operand.shape[:-2] == output.shape[:-2]


def product_of(call: MatmulCall) -> Product | None:
    """The call as a product, or None for one this check does not verify."""
    args, kwargs = call.args, call.kwargs
    if "out" in kwargs:
        return None
    if call.func is F.linear:
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        x, w = args[0], args[1]
        found = Product(x, w.transpose(-1, -2), bias, 1.0, 1.0, 0, 1, True)
    elif call.func is torch._grouped_mm:
        return _grouped(args, kwargs)
    elif call.func in (torch.addmm, torch.baddbmm):
        beta, alpha = float(kwargs.get("beta", 1)), float(kwargs.get("alpha", 1))
        found = Product(args[1], args[2], args[0], alpha, beta, 1, 2, False)
    else:
        found = Product(args[0], args[1], None, 1.0, 1.0, 0, 1, False)
    tensors = [found.left, found.right] + ([] if found.addend is None else [found.addend])
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
        return None
    if found.left.dim() < 2 or found.right.dim() < 2:
        return None
    return found


def _grouped(args: list, kwargs: dict) -> Product | None:
    """A mixture of experts' grouped product: 2-D tokens against 3-D experts, no bias, the
    output in the operands' dtype; other grouped layouts are not verified."""
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    extra = len(args) > 3 or any(kwargs.get(k) is not None for k in ("bias", "out_dtype"))
    left, right = args[0], args[1]
    if offs is None or extra or not all(_floating(t) for t in (left, right)):
        return None
    if left.dim() != 2 or right.dim() != 3 or offs.dim() != 1:
        return None
    return Product(left, right, None, 1.0, 1.0, 0, 1, False, offs)


def _floating(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def checked_flops(call: MatmulCall, output: torch.Tensor, backward: bool) -> int:
    """The product FLOPs of `call` that this check verifies: 2 m q p for the forward product
    and, with `backward`, as much for each operand gradient it checks (as `_check_left` and
    `_check_right` decide), that operand requiring a gradient."""
    product = product_of(call)
    if product is None:
        return 0
    each = 2 * output.numel() * product.right.shape[-2]
    flat = product.right.dim() == 2 and product.left.dim() > 2
    checked = each
    for at, operand in ((product.left_at, product.left), (product.right_at, product.right)):
        if not (backward and call.args[at].requires_grad):
            continue
        if product.offs is not None or flat or product.checks_grad(operand, output):
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


def worst_ratio(
    actual: torch.Tensor,
    expected: torch.Tensor,
    row_norm: torch.Tensor | None,
    left_norm: torch.Tensor,
    right_fro: torch.Tensor,
    right_sums_norm: torch.Tensor,
    inner: int,
    length: int,
    rounding: Rounding,
) -> torch.Tensor:
    """The largest ratio over the rows of |P_i e - L_i (R e)| to the row's bound (module
    docstring), a 0-d tensor: above 1, NaN or infinite when a row breaks it; rows whose operands'
    checksum is not finite count 0 (a fault upstream, not this product's). `row_norm` None: the
    Cauchy-Schwarz bound ||L_i|| ||R||_F stands for ||P_i||."""
    s, q, p = rounding.sigmas, math.sqrt(inner), math.sqrt(length)
    # The coefficients are folded on the host: each tensor operation costs microseconds here.
    row = s * (rounding.out + p * rounding.acc)
    fro = s * (rounding.acc * (q + p) + math.sqrt(2) * rounding.operands)
    sums = s * q * rounding.acc
    if row_norm is None:
        per_left = torch.add(right_fro * (fro + row), right_sums_norm, alpha=sums)
        bound = left_norm * per_left.unsqueeze(-1)
    else:
        per_left = torch.add(right_fro * fro, right_sums_norm, alpha=sums)
        bound = torch.addcmul(row_norm * row, left_norm, per_left.unsqueeze(-1))
    ratio = (actual - expected).abs_().div_(bound.add_(length * TINY))
    return torch.where(torch.isfinite(expected), ratio, 0.0).amax()


@dataclass
class Checked:
    """One product under check, from its forward to its backward checks."""

    key: str
    step: int
    product: Product
    dtype: torch.dtype = F32  # the kernel's
    flat: bool = False  # L's leading dimensions merged into rows
    right_fro: torch.Tensor | None = None  # ||R||_F per batch matrix
    left_fro: torch.Tensor | None = None  # ||L||_F per batch matrix
    # From the product's output gradient dP, when it arrives: dP (R^T e), dP e and ||dP_i||.
    projected: torch.Tensor | None = None
    row_sums: torch.Tensor | None = None
    grad_norms: torch.Tensor | None = None
    sums_norm: torch.Tensor | None = None  # ||R^T e|| per batch matrix
    # Under emulated numerics, the operands' float32 gradients before their rounding
    # (MatmulCall.wide_grads), by position in the call's arguments.
    wide_grads: dict[int, torch.Tensor] | None = None


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


@contextmanager
def unwatched(device: torch.device) -> Iterator[None]:
    """The checks' own arithmetic: no autograd graph, no autocast (sums stay float32)."""
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        yield


class MatmulChecksum(Detector):
    name = "matmul_checksum"
    parallel = ("ddp", "fsdp", "hsdp")

    @dataclass(frozen=True)
    class Config(CheckConfig):
        interval: int = 1  # check the products of every N-th step
        fraction: float = 1.0  # the seeded share of a checked step's products that is checked
        backward: bool = True  # also the gradients the products' backward computes
        sigmas: float = 8.0  # the bound's width (module docstring): P(clean alarm) < 2e^-s²/2

        def __post_init__(self) -> None:
            super().__post_init__()
            integer("interval", self.interval, 1)
            above("fraction", self.fraction, 0.0)
            if self.fraction != 1:
                fraction("fraction", self.fraction, " or 1 (every product)")
            self._normalise("fraction", float(self.fraction))
            flag("backward", self.backward)
            above("sigmas", self.sigmas, 0.0)

        @property
        def every(self) -> int | None:
            return self.interval if self.interval > 1 else None

    def __init__(self, config: Config, ctx: DetectorContext, log: EventLog):
        super().__init__(config, ctx, log)
        self.seed = ctx.workload.cfg.seed if ctx.workload is not None else 0
        self.u_in = OPERAND_ROUNDING.get(torch.get_float32_matmul_precision(), 0.0)
        self.open: dict[int, Checked] = {}  # by call, from operands to output
        self.calls: dict[str, int] = {}  # products per module in `calls_step`
        self.calls_step = -1
        # (step, phase, product, worst ratio) not yet deferred.
        self.found: list[tuple[int, str, str, torch.Tensor]] = []

    def watches_matmuls(self) -> bool:
        return True

    def _key(self, step: int, module: str) -> str:
        if step != self.calls_step:
            self.calls, self.calls_step = {}, step
        n = self.calls.get(module, 0)
        self.calls[module] = n + 1
        return f"{module or 'model'}#{n}"

    def _sampled(self, step: int, key: str) -> bool:
        if self.config.fraction >= 1.0:
            return True
        draw = zlib.crc32(f"{self.seed}:{step}:{key}".encode()) / 2**32
        return draw < self.config.fraction

    def _rounding(self, *dtypes: torch.dtype) -> Rounding:
        acc = torch.float64 if torch.float64 in dtypes else F32
        out = max(roundoff(d) for d in dtypes)
        return Rounding(out, roundoff(acc), self.u_in, self.config.sigmas)

    def on_matmul_operands(self, step: int, call: MatmulCall) -> None:
        if step % self.config.interval:
            return
        key = self._key(step, call.module)
        product = product_of(call) if self._sampled(step, key) else None
        if call.role:
            key = f"{key} {call.role}"
        if product is None:
            return
        checked = Checked(key, step, product, wide_grads=call.wide_grads)
        call.wide = True
        self.open[id(call)] = checked
        if self.config.backward and torch.is_grad_enabled():
            for at, which in ((product.left_at, "left"), (product.right_at, "right")):
                operand = call.args[at]
                if operand.requires_grad:
                    call.args[at] = Tap.apply(operand, self._operand_grad(checked, which))

    def on_matmul_output(
        self, step: int, call: MatmulCall, output: torch.Tensor
    ) -> torch.Tensor | None:
        checked = self.open.pop(id(call), None)
        if checked is None:
            return None
        with unwatched(output.device):
            self._check_output(step, checked, output, call.accumulator)
        if self.config.backward and output.requires_grad and torch.is_grad_enabled():
            # A hook, not a Function: a model may change the product in place.
            output.register_hook(self._output_grad(checked))
        return None

    def _operands(self, checked: Checked) -> tuple[torch.Tensor, torch.Tensor]:
        """L (rows merged where R is a matrix) and R as the kernel read them: an autocast
        kernel's casts, repeated."""
        product, dtype = checked.product, checked.dtype
        left, right = product.left.to(dtype), product.right.to(dtype)
        if checked.flat:
            left = left.reshape(-1, left.shape[-1])
        return left, right

    def _check_output(
        self,
        step: int,
        checked: Checked,
        output: torch.Tensor,
        accumulator: torch.Tensor | None = None,
    ) -> None:
        """P e against alpha L (R e) (+ the addend's row sums). With the float32 product before
        its rounding at hand (emulated numerics), that product against the float32 bound and
        the output against its rounding, exactly."""
        product = checked.product
        checked.dtype = output.dtype
        if product.offs is not None:
            self._check_grouped_output(step, checked, output)
            return
        checked.flat = product.right.dim() == 2 and product.left.dim() > 2
        left, right = self._operands(checked)
        if accumulator is not None:
            exact = rounding_ratio(output, accumulator, output.dtype)
            self.found.append((step, "forward", f"{checked.key} output rounding", exact))
        measured = output if accumulator is None else accumulator
        out = measured.reshape(-1, measured.shape[-1]) if checked.flat else measured
        sums = right.sum(-1, keepdim=True, dtype=F32)
        checked.right_fro = torch.linalg.vector_norm(right, dim=(-2, -1), dtype=F32)
        expected = (left.to(F32) @ sums).squeeze(-1)
        if product.alpha != 1:
            expected = product.alpha * expected
        if product.addend is not None:
            addend = product.addend.to(output.dtype)
            if addend.dim() == 1:
                expected = expected + product.beta * addend.sum(dtype=F32)
            else:
                summed = addend.expand(output.shape).sum(-1, dtype=F32)
                expected = expected + product.beta * (
                    summed.reshape(-1) if checked.flat else summed
                )
        rounding = self._rounding(measured.dtype)
        left_norm = torch.linalg.vector_norm(left, dim=-1, dtype=F32)
        checked.left_fro = torch.linalg.vector_norm(left_norm, dim=-1)
        if product.alpha != 1:
            left_norm = left_norm * abs(product.alpha)
        row_norm = None if rounding.fine else torch.linalg.vector_norm(out, dim=-1, dtype=F32)
        ratio = worst_ratio(
            out.sum(-1, dtype=F32), expected, row_norm, left_norm, checked.right_fro,
            torch.linalg.vector_norm(sums, dim=(-2, -1)), left.shape[-1], out.shape[-1],
            rounding,
        )  # fmt: skip
        self.found.append((step, "forward", f"{checked.key} output", ratio))

    def _check_grouped_output(self, step: int, checked: Checked, output: torch.Tensor) -> None:
        left, right = self._operands(checked)
        figures = grouped.forward(left, right, checked.product.offs, output)
        checked.right_fro = figures["right_fro"]
        checked.left_fro = figures["left_norm"]
        ratio = self._grouped_ratio(figures, right.shape[-2], right.shape[-1], output.dtype)
        self.found.append((step, "forward", f"{checked.key} output", ratio))

    def _grouped_ratio(
        self, figures: dict[str, torch.Tensor], inner: int, length: int, *dtypes: torch.dtype
    ) -> torch.Tensor:
        rounding = self._rounding(*dtypes)
        return worst_ratio(
            figures["actual"], figures["expected"], None if rounding.fine else figures["row_norm"],
            figures["left_norm"], figures["right_fro"], figures["right_sums_norm"], inner,
            length, rounding,
        )  # fmt: skip

    def _output_grad(self, checked: Checked):
        """When dP arrives (before the product's backward): dP (R^T e) and dP e, which the
        operand checks need, and the rows' norms. Two matrix-vector products: one product with
        the two vectors side by side costs ten times more on the CPU."""

        def seen(grad: torch.Tensor) -> None:
            with self.charged(), unwatched(grad.device):
                _, right = self._operands(checked)
                grad = grad.to(checked.dtype)
                if checked.product.offs is not None:
                    dp = grouped.output_grad(right, checked.product.offs, grad)
                    checked.projected, checked.row_sums = dp["projected"], dp["row_sums"]
                    checked.grad_norms, checked.sums_norm = dp["grad_norms"], dp["sums_norm"]
                    return
                if checked.flat:
                    grad = grad.reshape(-1, grad.shape[-1])
                sums = right.sum(-2, dtype=F32)
                wide = grad.to(F32)
                projected = (wide @ sums.unsqueeze(-1)).squeeze(-1)
                row_sums = grad.sum(-1, dtype=F32)
                norms = torch.linalg.vector_norm(grad, dim=-1, dtype=F32)
                alpha = checked.product.alpha
                if alpha != 1:  # both operands' gradients are alpha times a product with dP
                    projected, row_sums, norms = (
                        alpha * projected,
                        alpha * row_sums,
                        abs(alpha) * norms,
                    )
                checked.projected, checked.row_sums, checked.grad_norms = projected, row_sums, norms
                checked.sums_norm = torch.linalg.vector_norm(sums, dim=-1)

        return seen

    def _operand_grad(self, checked: Checked, which: str):
        """The operand's gradient, as the product's backward made it. With its float32 value
        before the rounding at hand (emulated numerics), that value is checked against the
        float32 bound and the gradient against its rounding, exactly."""
        product = checked.product
        at = product.left_at if which == "left" else product.right_at

        def seen(grad: torch.Tensor) -> None:
            wide = (checked.wide_grads or {}).pop(at, None)
            if checked.projected is None:
                return
            with self.charged(), unwatched(grad.device):
                if wide is not None:
                    ratio = rounding_ratio(grad, wide, checked.dtype)
                    name = "input" if which == "left" else "weight"
                    entry = f"{checked.key} {name} gradient rounding"
                    self.found.append((checked.step, "pre_allreduce", entry, ratio))
                check = self._check_left if which == "left" else self._check_right
                check(checked, grad if wide is None else wide, wide is not None)

        return seen

    def _check_left(self, checked: Checked, grad: torch.Tensor, accumulated: bool = False) -> None:
        """dL = alpha dP R^T: dL e against alpha dP (R^T e) (alpha is in the dP figures)."""
        product = checked.product
        if product.offs is not None:
            figures = grouped.left_grad(grad, self._dp(checked), checked.right_fro)
            inner = product.right.shape[-1]
            ratio = self._grouped_ratio(figures, inner, grad.shape[-1], checked.dtype, grad.dtype)
            self.found.append(
                (checked.step, "pre_allreduce", f"{checked.key} input gradient", ratio)
            )
            return
        if not checked.flat and not product.checks_grad(product.left, grad):
            return
        out = grad.reshape(-1, grad.shape[-1]) if checked.flat else grad
        rounding = self._rounding(*((F32,) if accumulated else (checked.dtype, grad.dtype)))
        row_norm = None if rounding.fine else torch.linalg.vector_norm(out, dim=-1, dtype=F32)
        ratio = worst_ratio(
            out.sum(-1, dtype=F32), checked.projected, row_norm,
            checked.grad_norms, checked.right_fro, checked.sums_norm,
            product.right.shape[-1], out.shape[-1], rounding,
        )  # fmt: skip
        self.found.append((checked.step, "pre_allreduce", f"{checked.key} input gradient", ratio))

    def _check_right(self, checked: Checked, grad: torch.Tensor, accumulated: bool = False) -> None:
        """dR = alpha L^T dP: dR e against alpha L^T (dP e). The rows of L^T are L's columns,
        whose norms ||L||_F bounds: reducing a matrix along its columns costs twenty times a
        reduction along its rows on the CPU, and the bound's L term is small beside the
        product's own rounding (about half of it in bfloat16, a hundredth in float32)."""
        product = checked.product
        if product.offs is not None:
            left, _ = self._operands(checked)
            figures, inner = grouped.right_grad(left, product.offs, grad, self._dp(checked))
            ratio = self._grouped_ratio(figures, inner, grad.shape[-1], checked.dtype, grad.dtype)
            self.found.append(
                (checked.step, "pre_allreduce", f"{checked.key} weight gradient", ratio)
            )
            return
        if not checked.flat and not product.checks_grad(product.right, grad):
            return
        left, _ = self._operands(checked)
        wide = left.to(F32)
        rounding = self._rounding(*((F32,) if accumulated else (checked.dtype, grad.dtype)))
        expected = (checked.row_sums.unsqueeze(-2) @ wide).squeeze(-2)
        left_norm = checked.left_fro.unsqueeze(-1)
        # dR's rows are the columns of a Linear's weight gradient (dR = dW^T).
        along = -2 if product.transposed else -1
        row_norm = None
        if not rounding.fine:
            grad32 = grad.to(F32)
            row_norm = (grad32 * grad32).sum(along).sqrt()
        ratio = worst_ratio(
            grad.sum(along, dtype=F32), expected, row_norm, left_norm,
            torch.linalg.vector_norm(checked.grad_norms, dim=-1),
            torch.linalg.vector_norm(checked.row_sums, dim=-1), left.shape[-2],
            grad.shape[along], rounding,
        )  # fmt: skip
        self.found.append((checked.step, "pre_allreduce", f"{checked.key} weight gradient", ratio))

    @staticmethod
    def _dp(checked: Checked) -> dict[str, torch.Tensor]:
        """The output gradient's figures, as detectors/grouped_products.py names them."""
        return {
            "projected": checked.projected, "row_sums": checked.row_sums,
            "grad_norms": checked.grad_norms, "sums_norm": checked.sums_norm,
        }  # fmt: skip

    def on_audit(self, step: int) -> None:
        self._defer()

    def on_update(self, step: int, model: torch.nn.Module) -> None:
        self._defer()  # products computed after the audit (a replay's recomputation)

    def _defer(self) -> None:
        groups: dict[tuple[int, str], list[tuple[str, torch.Tensor]]] = {}
        for step, phase, key, ratio in self.found:
            groups.setdefault((step, phase), []).append((key, ratio))
        self.found = []
        for (step, phase), entries in groups.items():
            ratios = torch.stack([r for _, r in entries])
            broken = ~(ratios <= 1.0).all()
            self.defer(step, phase, broken, self._explainer(step, phase, [k for k, _ in entries]),
                       ratios)  # fmt: skip

    def _explainer(self, step: int, phase: str, keys: list[str]):
        def explain(ratios: list[float]) -> None:
            bad = [(k, r) for k, r in zip(keys, ratios, strict=True) if not r <= 1.0]
            worst = max(bad, key=lambda kr: kr[1] if math.isfinite(kr[1]) else math.inf)
            module, _, product = worst[0].partition(" ")
            evidence = {
                "module": module.rpartition("#")[0],
                "product": product,
                "ratio": worst[1] if math.isfinite(worst[1]) else str(worst[1]),
                "products": [k for k, _ in bad[:8]],
            }
            self.alert(step, phase, [self.info.rank], evidence)

        return explain


DETECTOR = MatmulChecksum
