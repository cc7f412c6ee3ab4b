"""Benchmark 7: a 16-bit `gpt` training step on the CPU against a float32 one, in one run.

Each variant is one rank's step as the trainer runs it (zero_grad, forward, backward, AdamW
step; no DDP), one thread, on the `gpt` workload at each width, timed interleaved:
- `float32`, the reference; and float32 with the emulated mode installed (it passes float32
  products through: its cost is the mode's per-call check);
- `bfloat16` with `topology.cpu_numerics=emulated` (harness/runtime/numerics.py), the default
  on the CPU, and `native` (torch's own 16-bit kernels, the path before the mode);
- float32 weights under `torch.autocast("cpu", bfloat16)`, emulated.
Target: an emulated bfloat16 step costs at most 2x a float32 one.

How far the values move: after one step from the same weights and batch, the relative
difference (L2 norm of the difference over that of the reference) of the loss and of the
gradient (every parameter's, flattened) between emulated bfloat16, native bfloat16 and float32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from benchmarks.common import gpt_config
from benchmarks.timing import Figure, interleaved, paired_ratio
from harness.runtime import numerics
from harness.runtime.workloads import Workload

# name: (weights' dtype, cpu_numerics, autocast to bfloat16)
VARIANTS = {
    "float32": ("float32", "native", False),
    "float32, mode installed": ("float32", "emulated", False),
    "bfloat16, emulated": ("bfloat16", "emulated", False),
    "bfloat16, native": ("bfloat16", "native", False),
    "autocast bfloat16, emulated": ("float32", "emulated", True),
}


@dataclass(frozen=True)
class Plan:
    widths: tuple[int, ...] = (128, 256)
    rounds: int = 5  # the native bfloat16 step takes seconds: few rounds suffice for its ratio
    micro_batch_size: int | None = None
    context: int | None = None

    @classmethod
    def quick(cls) -> Plan:
        return cls(widths=(32,), rounds=1, micro_batch_size=2, context=16)


class Step:
    """One variant's model, optimizer and batch; `run()` is one training step, `grads()` the
    loss and gradient of a step from the initial weights."""

    def __init__(self, plan: Plan, width: int, dtype: str, mode: str, autocast: bool):
        changes = {"micro_batch_size": plan.micro_batch_size, "context": plan.context}
        changes = {k: v for k, v in changes.items() if v is not None}
        cfg = replace(
            gpt_config(), dtype=dtype, d_model=width, heads=max(1, width // 32), **changes
        )
        self.workload = Workload(cfg)
        self.model = self.workload.build_model()
        self.optimizer = self.workload.build_optimizer(self.model)
        self.batch = self.workload.batch(0, 0, 0)
        self.mode, self.autocast = mode, autocast

    def loss(self) -> torch.Tensor:
        with (
            numerics.installed(self.mode, "cpu"),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast),
        ):
            loss = self.workload.loss(self.model, self.batch)
        loss.backward()
        return loss.detach()

    def grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss()
        flat = torch.cat([p.grad.double().reshape(-1) for p in self.model.parameters()])
        return loss.double(), flat

    def run(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.loss()
        self.optimizer.step()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def run(plan: Plan) -> list[Figure]:
    torch.set_num_threads(1)  # as a rank runs (topology.threads_per_rank=1)
    figures = []
    for width in plan.widths:
        steps = {name: Step(plan, width, *v) for name, v in VARIANTS.items()}
        # Before timing: every model is still at its initial weights.
        fp32, emulated, native = (
            steps[name].grads() for name in ("float32", "bfloat16, emulated", "bfloat16, native")
        )
        times = interleaved({name: s.run for name, s in steps.items()}, plan.rounds)
        at = f"gpt d_model={width}"
        figures.append(
            Figure(
                f"step_ms_fp32_{width}",
                f"float32 step, {at}",
                1e3 * min(times["float32"]),
                unit=" ms",
            )  # fmt: skip
        )
        for name, key, target in (
            ("bfloat16, emulated", "bf16_step_vs_fp32", 2.0),
            ("bfloat16, native", "bf16_native_step_vs_fp32", None),
            ("autocast bfloat16, emulated", "autocast_step_vs_fp32", None),
            ("float32, mode installed", "fp32_mode_step_vs_fp32", None),
        ):
            ratio = paired_ratio(times, name, "float32")
            figures.append(Figure(f"{key}_{width}", f"step time, {name} / float32, {at}", ratio,
                                  target=target))  # fmt: skip
        for (a, b), label in (
            ((emulated, fp32), "emulated bfloat16 vs float32"),
            ((native, fp32), "native bfloat16 vs float32"),
            ((emulated, native), "emulated vs native bfloat16"),
        ):
            key = label.replace(" bfloat16", "").replace(" ", "_")
            for i, what in enumerate(("loss", "grad")):
                figures.append(
                    Figure(
                        f"{what}_diff_{key}_{width}",
                        f"relative difference of the {what} after one step, {label}, {at}",
                        relative(a[i], b[i]),
                        unit="",
                    )  # fmt: skip
                )
    return figures
