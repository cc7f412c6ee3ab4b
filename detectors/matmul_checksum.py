"""`matmul_checksum`: every product of the forward (harness/core/matmuls.py: F.linear, matmul, mm,
bmm, addmm, baddbmm, a mixture of experts' grouped products, convolutions, and attention's score
and value products where the call runs on the math backend) verified in the step that computes
it, with the rank and the module named: a checksum in the line of Huang and Abraham's
algorithm-based fault tolerance. Attention is checked as the math backend computes it
(harness/core/attention.py): its score product before the mask is added, so a fault in a score
the mask then discards is still in its row's sum; a fused call (flash, memory-efficient, cuDNN)
never forms its products and is not checked. Convolutions: detectors/convolutions.py.

Each product P = L R: its rows' sums against L (R e) within a rounding bound, and its rounding
exactly where its float32 value is at hand (detectors/product_bounds.py). Cost (per product: a
sum and a norm of each operand and row, one product of L with a vector; docs/performance.md)
against coverage: `interval`, `fraction`. The arithmetic (`kernels`): a C kernel per check,
each matrix read once (detectors/native_checksum.py, the default), or torch's operations
(detectors/checksum_kernels.py), eager or compiled. No collective: each rank judges its own
products, the verdicts kept on the device until the step's read. Backward checks hold the
operands until backward; not checked there: an operand broadcast over the product's batch.

Cost per step (sdc-plan): bytes = 2*A*(N + 1.5*N*t/d)/k, flops = 4*(N + 1.5*N*t/d)/k:
on a checked step (every k-th, every product: `fraction` 1), every product's operands and output
read once in forward, and its output's and operands' gradients once in backward (which takes
R^T e and L e from the forward, not the operands again), a multiply-add per element read (the
symbols: harness/analysis/estimates.py).
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from detectors import convolutions, native_build, native_checksum
from detectors import grouped_products as grouped
from detectors.checksum_kernels import KERNELS, Kernels
from detectors.product_bounds import (
    F32,
    Bound,
    Kept,
    OperandCheck,
    Product,
    Rounding,
    bound_of,
    bounded_ratio,
    operand_rounding,
    product_of,
    roundoff,
)
from harness.core.checks import CheckConfig, looks_at_multiples
from harness.core.matmuls import MatmulCall, StepProducts, on_grad, tapped
from harness.core.plugins import Detector, DetectorContext, EventLog
from harness.core.values import above, choice, flag, fraction, integer


@dataclass
class Checked:
    """One product under check, from its forward to its backward checks."""

    key: str
    step: int
    product: Product
    dtype: torch.dtype = F32  # the kernel's
    operands: float = 0.0  # u_i: the kernel's rounding of float32 operands (product_bounds.py)
    flat: bool = False  # L's leading dimensions merged into rows
    backward: bool = False  # its operands' gradients are checked
    kept: Kept | None = None  # the forward check's, for the backward's
    output_grad: torch.Tensor | None = None  # dP, from its arrival to the operands' gradients
    wide_grads: dict[int, torch.Tensor] | None = None  # emulated numerics' (MatmulCall)


def _whole_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor `t` views all of, in the same order, where there is one with a node of its
    own; else `t`."""
    base = t._base
    whole = (
        base is not None and base.grad_fn is not None and base.numel() == t.numel()
        and base.is_contiguous() and t.is_contiguous()
    )  # fmt: skip
    return base if whole else t


def _keep_output_grad(checked: Checked, shape: torch.Size, grad: torch.Tensor) -> None:
    checked.output_grad = grad.reshape(shape)


class unwatched:
    """The checks' own arithmetic: no autograd graph, no autocast (sums stay float32), and no
    torch function mode (the products' watch, emulated numerics) between it and the kernels:
    the checks' operations are not the model's, and a mode's Python dispatch costs
    microseconds per operation, and makes a compiled check specialise on its every float.
    Autocast is turned off only where it is on: entering its context costs 3 us. A class, not
    a generator's context: the checks enter it four times per product, and a generator's costs
    4 us a time, a fifth of a small product's native check."""

    __slots__ = ("device", "grad", "modes", "autocast")

    def __init__(self, device: torch.device):
        self.device = device.type

    def __enter__(self) -> None:
        self.grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        self.modes = torch._C.DisableTorchFunction()
        self.modes.__enter__()
        self.autocast = None
        if torch.is_autocast_enabled(self.device):
            self.autocast = torch.autocast(self.device, enabled=False)
            self.autocast.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.autocast is not None:
            self.autocast.__exit__(*exc)
        self.modes.__exit__(*exc)
        torch._C._set_grad_enabled(self.grad)


class MatmulChecksum(Detector):
    name = "matmul_checksum"
    parallel = ("ddp", "fsdp", "hsdp")

    @dataclass(frozen=True)
    class Config(CheckConfig):
        interval: int = 1  # check the products of every N-th step
        fraction: float = 1.0  # the seeded share of a checked step's products that is checked
        backward: bool = True  # also the gradients the products' backward computes
        sigmas: float = 8.0  # the bound's width (module docstring): P(clean alarm) < 2e^-s²/2
        kernels: str = "native"  # C; "eager" torch; "compiled" Inductor (checksum_kernels.py)

        def __post_init__(self) -> None:
            super().__post_init__()
            integer("interval", self.interval, 1)
            above("fraction", self.fraction, 0.0)
            if self.fraction != 1:
                fraction("fraction", self.fraction, " or 1 (every product)")
            self._normalise("fraction", float(self.fraction))
            flag("backward", self.backward)
            above("sigmas", self.sigmas, 0.0)
            choice("kernels", self.kernels, KERNELS)

        @property
        def every(self) -> int | None:
            return self.interval if self.interval > 1 else None

    @classmethod
    def first_suspect_step(
        cls, config: Config, alarm_step: int, checkpointed: Callable[[int], bool]
    ) -> int:
        """Where it checks every product of every step, a check of its step's values (the
        default): a product of operands already wrong counts as right, yet their values can
        overflow its check (a flipped exponent's 1e37 in a row of a gradient makes a NaN
        ratio), and so it alarms on weights an earlier update left wrong, or moments before
        them. Checking every k-th step, or a drawn share of the products, it vouches for no
        step: an intermittent fault (a defective unit strikes at a rate) may have struck a step
        or a product it skipped, before any it saw clean."""
        if config.fraction < 1 or config.interval > 1:
            return 0
        return super().first_suspect_step(config, alarm_step, checkpointed)

    @classmethod
    def looks(cls, config: Config, steps: range, checkpointed: Callable[[int], bool]) -> int:
        """Counted: its checked steps in `steps` (module docstring: every `interval`-th)."""
        return looks_at_multiples(config.interval, steps)

    def __init__(self, config: Config, ctx: DetectorContext, log: EventLog):
        super().__init__(config, ctx, log)
        self.seed = ctx.workload.cfg.seed if ctx.workload is not None else 0
        # u_i by device and kind (product or convolution), read once a step: a job may set
        # its precision after building the check.
        self.precisions: dict[tuple[str, bool], float] = {}
        # By call, from operands to output, the call held with its entry so that its id is not
        # another call's while the entry lasts (a product that raised leaves its entry: cleared
        # with the step's verdicts).
        self.open: dict[int, tuple[MatmulCall, Checked]] = {}
        self.convolutions: dict[int, tuple[MatmulCall, str]] = {}  # a convolution checked: key
        self.products = StepProducts()  # where each product of the step stands
        self.found: list[tuple[int, str, str, torch.Tensor]] = []  # (step, phase, key, ratio)
        self.kernels = Kernels(config.kernels)
        self.eager_instead = config.kernels == "native" and native_checksum.load() is None
        self.roundings: dict[tuple[float, tuple[torch.dtype, ...]], Rounding] = {}
        self.bounds: dict[tuple[Rounding, int, int], Bound] = {}

    def watches_matmuls(self) -> bool:
        return True

    def _key(self, step: int, stack: tuple[str, ...]) -> str:
        """`module#n` (harness/core/matmuls.py, StepProducts): in a step of one micro-batch, an
        alert's `blocks.0#2` is the product `fault.tensor=blocks.0 fault.product=2` strikes (the
        score product, after its child `blocks.0.qkv`'s)."""
        if step != self.products.step:
            self.precisions = {}
        module, n = self.products.place(step, stack)
        return f"{module or 'model'}#{n}"

    def _sampled(self, step: int, key: str) -> bool:
        if self.config.fraction >= 1.0:
            return True
        draw = zlib.crc32(f"{self.seed}:{step}:{key}".encode()) / 2**32
        return draw < self.config.fraction

    def _precision(self, device: torch.device, convolution: bool) -> float:
        """u_i of a float32 product or convolution on `device` this step."""
        key = (device.type, convolution)
        u = self.precisions.get(key)
        if u is None:
            u = self.precisions[key] = operand_rounding(device, convolution)
        return u

    def _rounding(self, operands: float, *dtypes: torch.dtype) -> Rounding:
        """The roundings of a product of these dtypes whose kernel rounds float32 operands by
        `operands` (u_i)."""
        rounding = self.roundings.get((operands, dtypes))
        if rounding is None:  # once per dtypes: torch.finfo costs microseconds, four per product
            acc = torch.float64 if torch.float64 in dtypes else F32
            out = max(roundoff(d) for d in dtypes)
            rounding = Rounding(out, roundoff(acc), operands, self.config.sigmas)
            self.roundings[operands, dtypes] = rounding
        return rounding

    def _reads_rows(self, *dtypes: torch.dtype) -> bool:
        """Whether the bound of a product of these dtypes reads its rows' norms (16 bits)."""
        return not self._rounding(0.0, *dtypes).fine

    def on_matmul_operands(self, step: int, call: MatmulCall) -> None:
        if step % self.config.interval:
            return
        if self.eager_instead:
            self.eager_instead = False
            self.warn(step, native_build.EAGER_INSTEAD, {"kernels": "eager"})
        # The check's own views and hooks are not the model's operations: no torch
        # function mode (emulated numerics) between them and torch.
        with torch._C.DisableTorchFunction():
            self._take_operands(step, call)

    def _take_operands(self, step: int, call: MatmulCall) -> None:
        key = self._key(step, call.stack)
        if call.func in convolutions.FUNCS:
            if self._sampled(step, key) and convolutions.checkable(call):
                self.convolutions[id(call)] = (call, key)
            return
        product = product_of(call) if self._sampled(step, key) else None
        if call.role:
            key = f"{key} {call.role}"
        if product is None:
            return
        operands = self._precision(product.left.device, False)
        checked = Checked(key, step, product, operands=operands, wide_grads=call.wide_grads)
        call.wide = True
        self.open[id(call)] = (call, checked)
        if self.config.backward and torch.is_grad_enabled():
            at = tuple(i for i in (product.left_at, product.right_at) if call.args[i].requires_grad)
            if at:
                views = tapped([call.args[i] for i in at], self._backward(checked, at))
                checked.backward = True
                for i, operand in zip(at, views, strict=True):
                    call.args[i] = operand

    def on_matmul_output(
        self, step: int, call: MatmulCall, output: torch.Tensor
    ) -> torch.Tensor | None:
        _, key = self.convolutions.pop(id(call), (None, None))
        _, checked = self.open.pop(id(call), (None, None))
        if output.numel() == 0:  # no row to check: an expert no token reached, an empty batch
            return None
        if key is not None:
            with unwatched(output.device):
                figures = convolutions.forward(call, output, self._reads_rows(output.dtype))
                operands = self._precision(output.device, True)
                ratio = self._ratio(
                    figures, figures["inner"], figures["length"], operands, output.dtype
                )
            self.found.append((step, "forward", f"{key} output", ratio))
        if checked is None:
            return None
        hooked = self.config.backward and torch.is_grad_enabled()
        with unwatched(output.device):
            self._check_output(step, checked, output, call.accumulator)
            if hooked and output.requires_grad:
                # A hook, not a Function: a model may change the product in place. It only
                # keeps dP: the checks run once the operands' gradients are made (`_backward`).
                # On the node that made the product: F.linear of 3-D data that needs no
                # gradient views its 2-D product, and a view changed in place (an in-place
                # activation) leaves the graph with its node, and the hook with it.
                made = _whole_base(output)
                on_grad(made, functools.partial(_keep_output_grad, checked, output.shape))
        return None

    def _operands(self, checked: Checked) -> tuple[torch.Tensor, torch.Tensor]:
        """A grouped product's L and R as the kernel read them: an autocast kernel's casts,
        repeated (a plain product's: detectors/checksum_kernels.py)."""
        product, dtype = checked.product, checked.dtype
        return product.left.to(dtype), product.right.to(dtype)

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
        if accumulator is not None:
            exact = self.kernels.rounding(output, accumulator, output.dtype)
            self.found.append((step, "forward", f"{checked.key} output rounding", exact))
        measured = product.as_output(output if accumulator is None else accumulator)
        rounding = self._rounding(checked.operands, measured.dtype)
        bound = self._bound(rounding, product.left.shape[-1], measured.shape[-1])
        ratio, checked.kept = self.kernels.output(
            product.left, product.right, measured, product.addend, checked.dtype,
            product.alpha, product.beta, checked.flat, bound, not rounding.fine, checked.backward,
        )  # fmt: skip
        self.found.append((step, "forward", f"{checked.key} output", ratio))

    def _check_grouped_output(self, step: int, checked: Checked, output: torch.Tensor) -> None:
        left, right = self._operands(checked)
        rows = self._reads_rows(output.dtype)
        figures = grouped.forward(left, right, checked.product.offs, output, rows)
        checked.kept = Kept(figures["right_fro"], figures["left_norm"])
        inner, length = right.shape[-2], right.shape[-1]
        ratio = self._ratio(figures, inner, length, checked.operands, output.dtype)
        self.found.append((step, "forward", f"{checked.key} output", ratio))

    def _ratio(
        self,
        figures: dict[str, torch.Tensor],
        inner: int,
        length: int,
        operands: float,
        *dtypes: torch.dtype,
    ) -> torch.Tensor:
        rounding = self._rounding(operands, *dtypes)
        return bounded_ratio(
            figures["actual"], figures["expected"], None if rounding.fine else figures["row_norm"],
            figures["left_norm"], figures["right_fro"], figures["right_sums_norm"],
            self._bound(rounding, inner, length), figures.get("addend_norm"),
        )  # fmt: skip

    def _backward(self, checked: Checked, at: tuple[int, ...]):
        """When the product's backward has made its operands' gradients (positions `at` in the
        call's arguments, those that need one): with dP, kept since it arrived, each checked.
        With an operand's float32 gradient before its rounding at hand (emulated numerics),
        that value is checked against the float32 bound and the gradient against its rounding,
        exactly."""

        def seen(grads: tuple[torch.Tensor | None, ...]) -> None:
            wide = checked.wide_grads or {}
            arrived = {i: (g, wide.pop(i, None)) for i, g in zip(at, grads, strict=True)}
            output_grad, checked.output_grad = checked.output_grad, None
            if output_grad is None:
                return
            with self.charged(), unwatched(output_grad.device):
                made = {i: pair for i, pair in arrived.items() if pair[0] is not None}
                self._check_backward(checked, checked.product.as_output(output_grad), made)

        return seen

    def _check_backward(
        self,
        checked: Checked,
        output_grad: torch.Tensor,
        made: dict[int, tuple[torch.Tensor, torch.Tensor | None]],
    ) -> None:
        """dL = alpha dP R^T: dL e against alpha dP (R^T e); dR = alpha L^T dP by its columns:
        e^T dR against alpha (L e)^T dP (alpha is in the dP figures), the weight's entries
        first. R^T e and L e are the forward check's (`Kept`): the backward reads dP and the
        gradients, not the operands again (they are out of the cache by then: most of the
        backward check's time). dR's columns are the rows of dR^T = alpha dP^T L, bounded as a
        product's rows with ||dP||_F for the norms of dP's columns: reducing a matrix along its
        columns costs twenty times a reduction along its rows on the CPU, eagerly."""
        product = checked.product
        roundings: dict[str, torch.Tensor] = {}
        measured: dict[str, tuple[torch.Tensor, bool]] = {}
        for name, at in (("weight", product.right_at), ("input", product.left_at)):
            if at in made:
                grad, wide = made[at]
                if wide is not None:
                    roundings[name] = self.kernels.rounding(grad, wide, checked.dtype)
                measured[name] = (grad if wide is None else wide), wide is not None
        if product.offs is not None:
            ratios = self._check_grouped_backward(checked, output_grad, measured)
        else:
            ratios = self._check_plain_backward(checked, output_grad, measured)
        for name in ("weight", "input"):
            for entry, ratio in ((f"{name} gradient rounding", roundings.get(name)),
                                 (f"{name} gradient", ratios.get(name))):  # fmt: skip
                if ratio is not None:
                    self.found.append((checked.step, "pre_allreduce", f"{checked.key} {entry}",
                                       ratio))  # fmt: skip

    def _check_plain_backward(
        self,
        checked: Checked,
        output_grad: torch.Tensor,
        measured: dict[str, tuple[torch.Tensor, bool]],
    ) -> dict[str, torch.Tensor]:
        """Each operand's check, by name, where its gradient is one product."""
        product = checked.product
        checks: dict[str, OperandCheck] = {}
        if "input" in measured:
            grad, accumulated = measured["input"]
            grad = product.as_left(grad)
            if checked.flat or product.checks_grad(product.left, output_grad):
                rounding = self._operand_rounding(checked, grad, accumulated)
                bound = self._bound(rounding, product.right.shape[-1], grad.shape[-1])
                checks["input"] = OperandCheck(grad, bound, not rounding.fine)
        along = -1 if product.transposed else -2  # dR's columns: a Linear's dW's rows
        if "weight" in measured:
            grad, accumulated = measured["weight"]
            grad = product.as_right(grad)
            if checked.flat or product.checks_grad(product.right, output_grad):
                rounding = self._operand_rounding(checked, grad, accumulated)
                left = product.left
                inner = left.numel() // left.shape[-1] if checked.flat else left.shape[-2]
                bound = self._bound(rounding, inner, grad.shape[along])
                checks["weight"] = OperandCheck(grad, bound, not rounding.fine)
        if not checks:
            return {}
        ratios = self.kernels.backward(
            output_grad, checked.dtype, product.alpha, checked.flat, along, checked.kept,
            checks.get("input"), checks.get("weight"),
        )  # fmt: skip
        return {
            name: r for name, r in zip(("input", "weight"), ratios, strict=True) if r is not None
        }

    def _operand_rounding(
        self, checked: Checked, grad: torch.Tensor, accumulated: bool
    ) -> Rounding:
        dtypes = (F32,) if accumulated else (checked.dtype, grad.dtype)
        return self._rounding(checked.operands, *dtypes)

    def _bound(self, rounding: Rounding, inner: int, length: int) -> Bound:
        """bound_of, once per rounding and shape: its square roots cost microseconds."""
        key = (rounding, inner, length)
        bound = self.bounds.get(key)
        if bound is None:
            bound = self.bounds[key] = bound_of(rounding, inner, length)
        return bound

    def _check_grouped_backward(
        self,
        checked: Checked,
        output_grad: torch.Tensor,
        measured: dict[str, tuple[torch.Tensor, bool]],
    ) -> dict[str, torch.Tensor]:
        """A grouped product's: its output gradient's figures, then each operand's check
        (detectors/grouped_products.py)."""
        product = checked.product
        left, right = self._operands(checked)
        dp = grouped.output_grad(right, product.offs, output_grad.to(checked.dtype))
        ratios = {}
        if "input" in measured:
            grad = product.as_left(measured["input"][0])
            rows = self._reads_rows(checked.dtype, grad.dtype)
            figures = grouped.left_grad(grad, dp, checked.kept.right_fro, rows)
            inner = product.right.shape[-1]
            ratio = self._ratio(
                figures, inner, grad.shape[-1], checked.operands, checked.dtype, grad.dtype
            )
            ratios["input"] = ratio
        if "weight" in measured:
            grad = product.as_right(measured["weight"][0])
            rows = self._reads_rows(checked.dtype, grad.dtype)
            figures, inner = grouped.right_grad(left, product.offs, grad, dp, rows)
            ratio = self._ratio(
                figures, inner, grad.shape[-1], checked.operands, checked.dtype, grad.dtype
            )
            ratios["weight"] = ratio
        return ratios

    def on_audit(self, step: int) -> None:
        self._defer()

    def on_update(self, step: int, model: torch.nn.Module) -> None:
        self._defer()  # products computed after the audit (a replay's recomputation)

    def _defer(self) -> None:
        self.open.clear()  # the entries of products that raised before their output
        self.convolutions.clear()
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
