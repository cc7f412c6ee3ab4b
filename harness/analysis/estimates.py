"""Each check's cost in a job the harness never ran: `sdc-plan --gpu h100|h200|b200 --params N
--tokens-per-step T` estimates it from what the check reads and computes, against the step's
6 N T FLOPs, on the GPU's bandwidth and throughput.

Each check's docstring states its cost per step in one line, `Cost per step (sdc-plan): bytes =
..., flops = ...[, host = ...][, train = ...]`, whose expressions are those of `FORMULAS` below
(tests/unit/test_estimates.py holds the two to the same text and recomputes the plan's figures
from the docstrings). The symbols, for one data-parallel replica (the GPUs that hold one copy of
the model between them, by tensor, pipeline or expert parallelism):

    N  parameters (--params)
    t  tokens per replica per step: T / R (--tokens-per-step over --replicas)
    d  hidden width, from N = 12 L d^2 with L = d / 128 layers (a transformer's usual aspect)
    k  the check's audit interval in steps (1: every step)
    B  4: bytes of a float32 gradient, weight or master element
    A  2: bytes of a bfloat16 product's operand or output
    m  what a weight fingerprint reads per parameter: 3 with weight_consensus's
       `optimizer_state` (the weights and Adam's two moments), else 1
    r  titan_replay's `num_replays`: the step's forward and backward run that many times again

matmul_checksum's products: per token a transformer layer's linear maps read and write
sum(d_in + d_out) = 18 d elements (q, k, v, o: 2 d each; a 4 d MLP: 5 d each way), against
N = 12 L d^2 parameters, so 1.5 N / d per token (a SwiGLU MLP of 8/3 d gives 19 d: 1.58).

The terms' rates: `bytes` at the GPU's memory bandwidth, `flops` at its dense BF16 peak, `host`
bytes at HOST_RATE (a CPU core hashing), `train` (a forward and backward run again) at the
step's own efficiency, --mfu of the peak. The step is 6 N t FLOPs at that efficiency. The
replica's GPUs share the check's work as they share the step's, so their number cancels, and
a check's overhead is the ratio of the two times. Not modelled: a check's own collectives (a
few bytes per rank), launch latency, overlap with communication; attention's score and value
products are outside `matmul_checksum`'s estimate (a fused kernel never forms them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Dense BF16 tensor-core throughput (no sparsity) and HBM bandwidth, per GPU, from NVIDIA's data
# sheets: H100 SXM5 80 GB, H200 SXM 141 GB, and B200 (HGX B200, per GPU).
GPUS = {
    "h100": ("H100 SXM", 3.35e12, 989e12, "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    "h200": ("H200 SXM", 4.8e12, 989e12, "NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    "b200": ("B200", 8.0e12, 2.25e15, "NVIDIA HGX B200 datasheet, per GPU (dense BF16)"),
}
# SHA-1 on one CPU core, about 1 GB/s (megatron_hash copies every parameter to the host and
# hashes it there).
HOST_RATE = 1e9
B, A = 4, 2
# The Llama 3 405B run's data-parallel degree on 16,384 GPUs (TP 8 x PP 16 x DP 128; The Llama 3
# Herd of Models, 2024, table 4): the plan's default job.
REPLICAS = 128
MFU = 0.4  # the step's share of the peak: 38-43% in the Llama 3 405B run (same table)

# Per check: its terms' expressions (the docstring line's), in the symbols above.
FORMULAS: dict[str, dict[str, str]] = {
    "nan_inf": {"bytes": "2*B*N", "flops": "0"},
    "grad_stats": {"bytes": "B*N", "flops": "2*N"},
    "allreduce_sketch": {"bytes": "2*B*N", "flops": "4*N"},
    "weight_consensus": {"bytes": "B*N*m/k", "flops": "0"},
    "gather_consensus": {"bytes": "B*N/k", "flops": "0"},
    "megatron_hash": {"bytes": "B*N/k", "flops": "0", "host": "B*N/k"},
    "spiky_loss": {"bytes": "0", "flops": "0"},
    "replay": {"bytes": "B*N/k", "flops": "0", "train": "6*N*t/k"},
    # Every step (num_steps -1): an upper bound for its default, the first step only.
    "titan_replay": {"bytes": "B*N*r", "flops": "0", "train": "6*N*t*r"},
    "matmul_checksum": {"bytes": "2*A*(N + 1.5*N*t/d)/k", "flops": "4*(N + 1.5*N*t/d)/k"},
}


class EstimateError(ValueError):
    """Bad input: one line, exit 2."""


def setting_symbols(settings: Mapping[str, Any]) -> dict[str, float]:
    """m and r of a check's settings (the module docstring)."""
    return {"m": 3 if settings.get("optimizer_state") else 1, "r": settings.get("num_replays", 1)}


def docstring_line(name: str) -> str:
    """The line of `name`'s docstring that states its cost (FORMULAS, in the docstring's form)."""
    terms = ", ".join(f"{term} = {expr}" for term, expr in FORMULAS[name].items())
    return f"Cost per step (sdc-plan): {terms}"


def evaluate(expression: str, symbols: dict[str, float]) -> float:
    """An expression of FORMULAS (arithmetic over the module's symbols)."""
    return float(eval(expression, {"__builtins__": {}}, symbols))  # our own table, no names


@dataclass(frozen=True)
class JobShape:
    """The job a plan estimates costs for."""

    gpu: str
    params: float
    tokens_per_step: float
    replicas: int = REPLICAS
    mfu: float = MFU

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise EstimateError(f"--gpu: '{self.gpu}' is not allowed; allowed: {', '.join(GPUS)}")
        for flag, value in (("--params", self.params), ("--tokens-per-step", self.tokens_per_step),
                            ("--replicas", self.replicas)):  # fmt: skip
            if not math.isfinite(value) or value < 1:
                raise EstimateError(f"{flag}: must be a number >= 1, got {value:g}")
        if not 0 < self.mfu <= 1:
            raise EstimateError(f"--mfu: must be in (0, 1], got {self.mfu:g}")

    @property
    def hidden(self) -> float:
        return (128 * self.params / 12) ** (1 / 3)

    @property
    def tokens_per_replica(self) -> float:
        return self.tokens_per_step / self.replicas

    def symbols(self, k: int = 1, settings: Mapping[str, Any] | None = None) -> dict[str, float]:
        t = self.tokens_per_replica
        return {"N": self.params, "t": t, "d": self.hidden, "k": k, "B": B, "A": A,
                **setting_symbols(settings or {})}  # fmt: skip

    def seconds(
        self, terms: dict[str, str], k: int = 1, settings: Mapping[str, Any] | None = None
    ) -> float:
        """One replica's seconds per step for `terms`, as if on a single GPU of the kind (the
        replica's GPUs divide the check and the step alike)."""
        _, bandwidth, peak, _ = GPUS[self.gpu]
        rates = {"bytes": bandwidth, "flops": peak, "host": HOST_RATE, "train": peak * self.mfu}
        values = self.symbols(k, settings)
        return sum(evaluate(expr, values) / rates[term] for term, expr in terms.items())

    @property
    def step_seconds(self) -> float:
        return self.seconds({"train": "6*N*t"})

    def overhead_pct(
        self, check: str, k: int = 1, settings: Mapping[str, Any] | None = None
    ) -> float:
        """`check`'s estimated cost at interval k and its `settings` (campaign.json's), in
        percent of the step."""
        return 100 * self.seconds(FORMULAS[check], k, settings) / self.step_seconds

    def describe(self) -> str:
        name, bandwidth, peak, source = GPUS[self.gpu]
        t = self.tokens_per_replica
        return (
            f"{name} ({bandwidth / 1e12:g} TB/s, {peak / 1e12:g} TFLOP/s dense BF16; {source}), "
            f"{self.params:.3g} parameters, {self.tokens_per_step:.3g} tokens per step over "
            f"{self.replicas} data-parallel replicas (t = {t:,.0f} tokens per replica), hidden "
            f"width d = {self.hidden:,.0f} (from N = 12 L d^2, L = d/128), the step at "
            f"{self.mfu:.0%} of the peak"
        )
