"""Benchmark 4, continued: what `matmul_checksum` costs per kind of product and per workload.

- Per kind, the check (forward and both operand gradients, through its hooks, as the products'
  watch calls them) against the product's own forward and backward, float32, one thread: a
  Linear of `gpt`'s MLP (1024 tokens, 128 into 512), attention's score and value products
  (16 sequences, 4 heads of 32 channels, 64 tokens) and a mixture of experts' grouped product
  (2048 routed rows over 4 experts, 128 into 256).
- Per workload, one rank's training step (forward, backward, optimizer) with the check on
  against the same step without it, in this process on one thread, under the ranks' numerics:
  `gpt` (float32 and bf16-mixed), `llama` (the LLM recipe) and `mixtral` (bf16-mixed); `gpt`'s
  also with the check's arithmetic compiled by Inductor (detectors/checksum_kernels.py), its
  first step (the compiles) stated apart. No world and no collective: the world benchmark's
  figure for `gpt` (overhead.csv) adds the communication the step overlaps.

Each figure is a median of per-round ratios of interleaved calls (benchmarks/timing.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.common import compose_run, detector
from benchmarks.timing import Figure, interleaved, paired_ratio
from harness.core import attention
from harness.core.bus import PluginBus
from harness.core.matmuls import MatmulCall
from harness.core.plugins import EventLog
from harness.runtime import numerics
from harness.runtime.workloads import Workload

STEP = 1
# Per workload, the overrides of the step timed.
WORKLOADS = {
    "gpt": ("workload=gpt",),
    "gpt_bf16": ("workload=gpt", "workload.precision=bf16-mixed"),
    "llama": ("workload=llama",),
    "mixtral": ("workload=mixtral", "workload.precision=bf16-mixed"),
}
# One rank's share of the step the check may take (eager or compiled), where it has a target.
TARGETS = {"gpt": 10.0, "gpt_bf16": 15.0}
# The steps also timed with the check's arithmetic compiled (detectors/checksum_kernels.py);
# not in a quick run: a step's first compile takes about 40 s in a fresh Inductor cache.
COMPILED = ("gpt", "gpt_bf16")


def run(rounds: int = 15, quick: bool = False) -> list[Figure]:
    torch.set_num_threads(1)
    figures = [kind_figure(name, make, rounds) for name, make in KINDS.items()]
    for name, overrides in WORKLOADS.items():
        if quick and name == "gpt_bf16":  # gpt's code path, timed again in another precision
            continue
        small = ("workload.micro_batch_size=2",) if quick else ()
        figures += step_figures(name, (*overrides, *small), rounds, name in COMPILED and not quick)
    return figures


def _linear() -> tuple[Callable, list[torch.Tensor]]:
    x, w, b = torch.randn(16, 64, 128), torch.randn(512, 128), torch.randn(512)
    return F.linear, [x, w, b]


def _attention() -> tuple[Callable, list[torch.Tensor]]:
    return F.scaled_dot_product_attention, [torch.randn(16, 4, 64, 32) for _ in range(3)]


def _grouped() -> tuple[Callable, list[torch.Tensor]]:
    offs = torch.tensor([512, 1024, 1536, 2048], dtype=torch.int32)
    return torch._grouped_mm, [torch.randn(2048, 128), torch.randn(4, 128, 256), offs]


KINDS = {"linear": _linear, "attention": _attention, "grouped": _grouped}


def kind_figure(name: str, make: Callable, rounds: int) -> Figure:
    """The check's forward and backward work on one product kind / the product's own."""
    func, args = make()
    leaves = [a.requires_grad_() if a.is_floating_point() else a for a in args]
    check = detector("matmul_checksum")

    def run_products(watched: bool) -> None:
        def multiply(left, right, role: str = "") -> torch.Tensor:
            return _product(check if watched else None, torch.matmul, [left, right], role)

        if func is F.scaled_dot_product_attention:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                out = attention.decomposed(leaves, {"is_causal": True}, multiply)
        else:
            out = _product(check if watched else None, func, list(leaves), "")
        out.backward(torch.ones_like(out))
        for leaf in leaves:
            leaf.grad = None
        check.found.clear()

    times = interleaved(
        {"checked": lambda: run_products(True), "plain": lambda: run_products(False)}, rounds
    )
    return Figure(
        f"checksum_{name}",
        f"matmul_checksum on a {name} product, forward and backward, over the product's own",
        100 * (paired_ratio(times, "checked", "plain") - 1),
        unit="%",
    )


def _product(check, func: Callable, args: list, role: str) -> torch.Tensor:
    call = MatmulCall(func, args, {}, ("blocks.0",), role)
    if check is not None:
        check.on_matmul_operands(STEP, call)
    output = call.compute()
    if check is not None:
        check.on_matmul_output(STEP, call, output)
    return output


def step_figures(
    name: str, overrides: tuple[str, ...], rounds: int, compiled: bool
) -> list[Figure]:
    """One rank's step with the check / without, minus 1: its default arithmetic (the C kernels,
    detectors/native_checksum.py), and the eager reference; `compiled`: also compiled by
    Inductor, and the seconds of that check's first step, its compiles included."""
    run_cfg = compose_run(*overrides)
    steps = {}
    for label in ("plain", "native", "eager", *(("compiled",) if compiled else ())):
        workload = Workload(run_cfg.workload)
        model = workload.build_model()
        optimizer = workload.build_optimizer(model)
        plugins = (
            [detector("matmul_checksum", model=model, workload=workload, kernels=label)]
            if label != "plain"
            else []
        )
        bus = PluginBus(plugins, EventLog(0, 0).verdicts)
        bus.install_forward_hooks(model, lambda: STEP)
        steps[label] = _stepper(workload, model, optimizer, run_cfg.topology.cpu_numerics, plugins)
    first = 0.0
    if compiled:
        started = time.perf_counter()
        steps["compiled"]()
        first = time.perf_counter() - started
    times = interleaved(steps, rounds)
    what = f"one rank's {name.replace('_bf16', ' bf16-mixed')} step (one thread, no world)"
    target = TARGETS.get(name)
    figures = [
        Figure(f"checksum_step_{name}", f"matmul_checksum, {what}",
               100 * (paired_ratio(times, "native", "plain") - 1), unit="%", target=target),
        Figure(f"checksum_step_{name}_eager", f"matmul_checksum eager, {what}",
               100 * (paired_ratio(times, "eager", "plain") - 1), unit="%"),
    ]  # fmt: skip
    if compiled:
        figures += [
            Figure(f"checksum_step_{name}_compiled", f"matmul_checksum compiled, {what}",
                   100 * (paired_ratio(times, "compiled", "plain") - 1), unit="%"),
            Figure(f"checksum_compile_step_s_{name}",
                   f"matmul_checksum compiled, {what}: its first step (the compiles)",
                   first, unit="s"),
        ]  # fmt: skip
    return figures


def _stepper(workload: Workload, model, optimizer, cpu_numerics, plugins) -> Callable[[], None]:
    batch = workload.batch(0, 0, 0)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with numerics.installed(cpu_numerics, "cpu"), workload.forward_rng(0, 0, 0):
            workload.loss(model, batch).backward()
        optimizer.step()
        for plugin in plugins:
            plugin.found.clear()

    return step
