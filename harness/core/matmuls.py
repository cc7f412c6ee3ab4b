"""Matrix multiplies as plug-ins see them: every call to one of `MATMULS` in a model's forward,
caught by one torch-function mode (`Watch`) that is open from the model's forward pre-hook to its
forward hook, with the names of the modules whose forward is running at that moment. A call of
F.scaled_dot_product_attention is two products, the score product Q K^T and the value product
P V, each handed over as a `torch.matmul` (harness/core/attention.py), where the call runs on the
math backend or a plug-in asks for its products (`expands`); a fused call passes through whole.

Plug-ins take part through two hooks (harness/core/plugins.py): `on_matmul_operands` may wrap a
call's operands before the product is computed (checks first, then injectors, so that a gradient
an injector corrupts in backward reaches a check's wrap already corrupted), and
`on_matmul_output` may replace the product after it (injectors first, then checks, which thus
see what the fault made). A plug-in's own arithmetic inside those hooks is not watched: torch
leaves a mode off while its handler runs.

`traced` runs one forward under the same mode and names the modules whose forward runs and those
in whose forward a matrix multiply runs: the targets a fault at site activation or matmul can
strike (a container such as an `nn.ModuleList` holds layers but its own forward never runs), and
how many products one run of each makes (what `fault.product` can pick), attention's two counted
whatever backend the call would take.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from harness.core import attention, emulation

# The matrix multiplies a matmul fault can strike and matmul_checksum verifies, with the position
# of their second operand (a Linear's weight). A tensor's method reaches the mode as itself, not
# as torch's function, its tensor first as the function's first argument: `b.addmm(x, w)`.
MATMULS: dict[Callable, int] = {
    F.linear: 1, torch.matmul: 1, torch.Tensor.matmul: 1, torch.Tensor.__matmul__: 1,
    torch.mm: 1, torch.Tensor.mm: 1, torch.bmm: 1, torch.Tensor.bmm: 1,
    torch.addmm: 2, torch.Tensor.addmm: 2, torch.baddbmm: 2, torch.Tensor.baddbmm: 2,
    # A mixture of experts' products (F.grouped_mm reaches the mode as torch._grouped_mm).
    torch._grouped_mm: 1,
    # Convolutions: a product of the weight with every input patch.
    F.conv1d: 1, F.conv2d: 1, F.conv3d: 1,
}  # fmt: skip
# The convolutions among them: their outputs' columns (the output channels) are dimension 1.
CONVOLUTIONS = (F.conv1d, F.conv2d, F.conv3d)


@dataclass
class MatmulCall:
    """One matrix multiply as the model's forward called it; `args` may be changed in place."""

    func: Callable
    args: list[Any]
    kwargs: dict[str, Any]
    # Every module whose forward is running, outermost first (the root model is not named).
    stack: tuple[str, ...]
    # What the product is where the call is one of a function's products ("attention scores").
    role: str = ""
    # Set by a plug-in that reads what follows: where `compute` made a 16-bit product as the
    # emulated numerics do, the float32 product before its rounding (until the plug-ins have
    # seen the output), and, filled in backward, the float32 gradient of each operand before its
    # rounding, by position in `args` (the reader pops them).
    wide: bool = False
    accumulator: torch.Tensor | None = None
    wide_grads: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def module(self) -> str:
        """The innermost running module: where the product is computed."""
        return self.stack[-1] if self.stack else ""

    @property
    def second(self) -> int:
        """The position in `args` of the second operand."""
        return MATMULS[self.func]

    def compute(self) -> Any:
        """The product. Asked for `wide` under emulated numerics, a 16-bit one is computed here
        as the emulation computes it (harness/core/emulation.py, the same bits), keeping its
        float32 product in `accumulator` and tapping its float32 operands for `wide_grads`: what
        a check needs to verify the float32 products against a float32 bound and each rounding
        exactly."""
        wide = emulation.widened(self.func, self.args, self.kwargs) if self.wide else None
        if wide is None:
            return self.func(*self.args, **self.kwargs)
        args, kwargs, low = wide
        grads = self.wide_grads  # not `self`: the hook outlives the call until backward
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.requires_grad and torch.is_grad_enabled():
                on_grad(a, functools.partial(_keep, grads, i))
        with torch.autocast("cpu", enabled=False):
            self.accumulator = self.func(*args, **kwargs)
        return self.accumulator.to(low)


def _keep(grads: dict[int, torch.Tensor], at: int, grad: torch.Tensor) -> None:
    grads[at] = grad


def on_grad(t: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> None:
    """`fn(grad)` once backward has made `t`'s gradient (not where none flowed), as a tensor
    hook would, but through a hook on the node that made `t`: cheaper to place and to call, a
    few microseconds a product. A leaf has no such node: its own hook."""
    if t.grad_fn is None:
        t.register_hook(fn)
    else:
        t.grad_fn.register_prehook(functools.partial(_handed, fn, t.output_nr))


def _handed(
    fn: Callable[[torch.Tensor], None], output_nr: int, grads: tuple[torch.Tensor | None, ...]
) -> None:
    if grads[output_nr] is not None:
        fn(grads[output_nr])


def tapped(
    inputs: list[torch.Tensor], seen: Callable[[tuple[torch.Tensor | None, ...]], None]
) -> list[torch.Tensor]:
    """Views of `inputs` to compute with in their place: once backward has made the gradients
    of all of them (None where none flowed), `seen` gets them together. Each view's autograd
    node (torch's own) has a hook before it: no autograd Function of ours in the graph, whose
    Python node costs tens of microseconds a product in backward."""
    gathered = _Gathered(seen, len(inputs))
    views = []
    for at, x in enumerate(inputs):
        view = x.view_as(x)
        view.grad_fn.register_prehook(functools.partial(gathered.arrived, at))
        views.append(view)
    return views


class _Gathered:
    """A product's operands' gradients as their views' nodes receive them in one backward,
    handed to `seen` when the last arrives. Each backward gathers its own (a graph kept for a
    second one): one that reached only some of them (`inputs=`, `autograd.grad` of a subset)
    leaves its gradients to no other."""

    __slots__ = ("seen", "grads", "missing", "backward")

    def __init__(self, seen: Callable[[tuple[torch.Tensor | None, ...]], None], count: int):
        self.seen = seen
        self.grads: list[torch.Tensor | None] = [None] * count
        self.missing = count
        self.backward = -1  # the graph task (one backward) gathered for

    def arrived(self, at: int, grads: tuple[torch.Tensor | None, ...]) -> None:
        backward = torch._C._current_graph_task_id()  # as torch's own multi-grad hook tells
        if backward != self.backward:
            count = len(self.grads)
            self.backward, self.grads, self.missing = backward, [None] * count, count
        self.grads[at] = grads[0]
        self.missing -= 1
        if not self.missing:
            made, self.grads = tuple(self.grads), [None] * len(self.grads)  # not kept after
            self.seen(made)


class StepProducts:
    """Where each product of a step stands: its innermost running module, and its place among
    the products made in the step while that module ran, its children's counted, from 1, as
    `fault.product` counts a module's products in one run of its forward (the same in a step of
    one micro-batch). One numbering for matmul_checksum's alerts and a defective unit's events."""

    __slots__ = ("step", "counts")

    def __init__(self) -> None:
        self.step = -1
        self.counts: dict[str, int] = {}

    def place(self, step: int, stack: tuple[str, ...]) -> tuple[str, int]:
        """The next product of `step`, made while the modules of `stack` run: (module, place);
        module "" where none of the model's runs (the root's own)."""
        if step != self.step:
            self.step, self.counts = step, {}
        running = stack or ("",)
        for name in running:
            self.counts[name] = self.counts.get(name, 0) + 1
        return running[-1], self.counts[running[-1]]


@dataclass(frozen=True)
class TracedProduct:
    """The K-th product of a module's forward as a matmul fault strikes it, over the module's
    runs: the fewest elements, every dtype, the widest."""

    size: int  # its output's elements
    dtypes: tuple[str, ...]  # its output's
    width: int  # its columns (a convolution's: its output channels): a defective unit's lanes
    # Its second operand, whose gradient a backward fault corrupts (the gradient has the
    # operand's dtype and elements), and whether it is a frozen parameter: no gradient reaches it.
    operand_size: int
    operand_dtypes: tuple[str, ...]
    operand_frozen: bool

    def merged(self, other: TracedProduct) -> TracedProduct:
        return TracedProduct(
            min(self.size, other.size), tuple(sorted({*self.dtypes, *other.dtypes})),
            max(self.width, other.width), min(self.operand_size, other.operand_size),
            tuple(sorted({*self.operand_dtypes, *other.operand_dtypes})),
            self.operand_frozen and other.operand_frozen,
        )  # fmt: skip


@dataclass(frozen=True)
class ForwardModules:
    """What one forward of a workload's model runs, in the order modules first ran."""

    ran: tuple[str, ...]  # modules whose forward runs
    multiplying: tuple[str, ...]  # those in whose forward (or a child's) a matrix multiply runs
    products: dict[str, int]  # the most products one run of a multiplying module's forward makes
    # The floating dtypes of what a fault strikes there: each module's output (activation) and
    # the products its forward makes (matmul). Under autocast, 16-bit where the weights are not.
    outputs: dict[str, tuple[str, ...]]  # dtype names ("bfloat16"): the record is JSON
    made: dict[str, tuple[str, ...]]
    # Each module's output elements, the fewest over its runs (what a schedule's index may
    # reach at site activation), and each product one run of its forward makes, by K - 1 (as
    # `fault.product` counts, from 1).
    output_sizes: dict[str, int]
    product_traces: dict[str, tuple[TracedProduct, ...]]
    # The loss's dtype, what a fault at site loss strikes: float32 from a 16-bit model's
    # scores (harness/losses.py), a user's loss its own (blank: not traced).
    loss: tuple[str, ...] = ()

    def product(self, name: str, k: int) -> TracedProduct:
        """The `k`-th product (from 1, as `fault.product` counts) of module `name`."""
        return self.product_traces[name][k - 1]


def _never(_stack: tuple[str, ...]) -> bool:
    return False


class Watch(TorchFunctionMode):
    """Open during a model's forward: each matrix multiply goes to `on_call`, which computes it
    (`call.func(*call.args, **call.kwargs)`) and returns what the model gets. `expands(stack)`
    says whether an attention call that would run fused is computed as its two products.
    `traces`: also count each module's products (`traced`), work a training step never reads."""

    def __init__(
        self,
        on_call: Callable[[MatmulCall], Any],
        expands: Callable[[tuple[str, ...]], bool] = _never,
        traces: bool = False,
    ):
        super().__init__()
        self.on_call = on_call
        self.expands = expands
        self.traces = traces
        self.stack: list[str] = []
        self.ran: dict[str, None] = {}
        self.counts: dict[str, int] = {}  # products of each running module's current run
        self.most: dict[str, int] = {}
        self.outputs: dict[str, set[torch.dtype]] = {}  # traced: each module's output dtypes
        self.made: dict[str, set[torch.dtype]] = {}  # traced: its products' dtypes
        self.output_sizes: dict[str, int] = {}  # traced: ForwardModules's
        self.product_traces: dict[str, dict[int, TracedProduct]] = {}
        self.depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            stack = tuple(self.stack)
            if self.expands(stack) or attention.runs_math(args, kwargs):
                return attention.decomposed(args, kwargs, self._multiply)
            return func(*args, **kwargs)
        if func not in MATMULS:
            return func(*args, **kwargs)
        return self._product(func, list(args), kwargs)

    def _multiply(self, left: torch.Tensor, right: torch.Tensor, role: str) -> torch.Tensor:
        return self._product(torch.matmul, [left, right], {}, role)

    def _product(
        self, func: Callable, args: list[Any], kwargs: dict[str, Any], role: str = ""
    ) -> Any:
        stack = tuple(self.stack)
        for name in stack if self.traces else ():
            self.counts[name] += 1
            self.most[name] = max(self.most.get(name, 0), self.counts[name])
        call = MatmulCall(func, args, kwargs, stack, role)
        output = self.on_call(call)
        if self.traces and isinstance(output, torch.Tensor):
            self._trace(call, output)
        return output

    def _trace(self, call: MatmulCall, output: torch.Tensor) -> None:
        """A product made, in every running module's record."""
        operand = call.args[call.second] if len(call.args) > call.second else None
        held = isinstance(operand, torch.Tensor)
        # A frozen weight as the product takes it, or a view of it (`x @ w.t()`): the trace runs
        # without grad, where a view of any weight needs none, so the weight itself says.
        weight = operand._base if held and operand._base is not None else operand
        made = TracedProduct(
            output.numel(), _names({output.dtype}),
            output.shape[1 if call.func in CONVOLUTIONS else -1] if output.dim() else 1,
            operand.numel() if held else 0, _names({operand.dtype} if held else set()),
            isinstance(weight, nn.Parameter) and not weight.requires_grad,
        )  # fmt: skip
        for name in call.stack:
            self.made.setdefault(name, set()).add(output.dtype)
            found = self.product_traces.setdefault(name, {})
            k = self.counts[name]
            found[k] = found[k].merged(made) if k in found else made

    def traced(self) -> ForwardModules:
        """What the forwards it watched with `traces` on ran and multiplied."""
        ran = tuple(self.ran)
        return ForwardModules(
            ran, tuple(n for n in ran if n in self.most), dict(self.most),
            {n: _names(d) for n, d in self.outputs.items()},
            {n: _names(d) for n, d in self.made.items()}, dict(self.output_sizes),
            {n: tuple(found[k] for k in sorted(found)) for n, found in self.product_traces.items()},
        )  # fmt: skip

    def install(self, model: nn.Module) -> list[Any]:
        """Hooks that keep `stack` and open the mode for the root's forward; their handles."""
        handles = []
        for name, module in model.named_modules():
            if name:
                handles.append(module.register_forward_pre_hook(self._entered(name)))
                handles.append(module.register_forward_hook(self._left, always_call=True))
        handles.append(model.register_forward_pre_hook(self._open))
        handles.append(model.register_forward_hook(self._close, always_call=True))
        return handles

    def _entered(self, name: str) -> Callable:
        def hook(_module, _inputs):
            self.stack.append(name)
            self.ran[name] = None
            self.counts[name] = 0

        return hook

    def _left(self, _module, _inputs, output):
        name = self.stack.pop()
        if self.traces and isinstance(output, torch.Tensor) and output.is_floating_point():
            self.outputs.setdefault(name, set()).add(output.dtype)
            self.output_sizes[name] = min(self.output_sizes.get(name, output.numel()),
                                          output.numel())  # fmt: skip

    # A forward that calls the root again from inside (none known) opens the mode once.
    def _open(self, _module, _inputs):
        self.depth += 1
        if self.depth == 1:
            self.__enter__()

    def _close(self, _module, _inputs, _output):
        self.depth -= 1
        if self.depth == 0:
            self.__exit__(None, None, None)


def _names(dtypes: set[torch.dtype]) -> tuple[str, ...]:
    return tuple(sorted(str(d).removeprefix("torch.") for d in dtypes))


@contextmanager
def watching(model: nn.Module, watch: Watch) -> Iterator[Watch]:
    """`watch` on `model`'s forwards for the block, and off it afterwards, whatever happens."""
    handles = watch.install(model)
    try:
        yield watch
    finally:
        for handle in handles:
            handle.remove()


def traced(model: nn.Module, forward: Callable[[], Any]) -> ForwardModules:
    """The modules one call of `forward` (a forward of `model` and its loss) runs, those that
    multiply, how many products each makes, and the loss's dtype."""
    with watching(model, Watch(MatmulCall.compute, expands=lambda _: True, traces=True)) as watch:
        loss = forward()
    found = watch.traced()
    if isinstance(loss, torch.Tensor) and loss.is_floating_point():
        found = dataclasses.replace(found, loss=_names({loss.dtype}))
    return found
