"""The guard's callbacks in the trainers people use: a step of Lightning's Trainer and of Hugging
Face's Trainer with the callback running `nan_inf` and `weight_consensus` every 10 steps,
against the same Trainer without it, in one run.

Each example (examples/train_lightning.py, examples/train_hf_trainer.py) runs under torchrun on
4 CPU processes with `--twin`: the same processes fit without the callback, then with it, and
each rank reports the median wall time of its steps after the first in either fit. The figure
is the median over the ranks of guarded / plain: what the callback costs a step of that
Trainer, its hooks and its Guard together.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.timing import Figure

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {
    "lightning": ROOT / "examples" / "train_lightning.py",
    "hf_trainer": ROOT / "examples" / "train_hf_trainer.py",
}
CHECKS = {"nan_inf": {}, "weight_consensus": {"interval": 10}}
RANKS = 4


@dataclass(frozen=True)
class Plan:
    steps: int = 40

    @classmethod
    def quick(cls) -> Plan:
        return cls(steps=4)


def run(plan: Plan) -> list[Figure]:
    return [_ratio(name, example, plan) for name, example in EXAMPLES.items()]


def _ratio(name: str, example: Path, plan: Plan) -> Figure:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        torchrun = Path(sys.executable).parent / "torchrun"
        command = [
            str(torchrun), "--standalone", f"--nproc-per-node={RANKS}", str(example),
            "--out", str(out), "--twin", "--steps", str(plan.steps),
            "--save-every", str(plan.steps + 1), "--detectors", json.dumps(CHECKS),
        ]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
        if proc.returncode != 0:
            raise RuntimeError(f"{example.name} failed: {proc.stderr[-2000:]}")
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    ratio = statistics.median(r["step_ms"] / r["unguarded_step_ms"] for r in ranks)
    plain = statistics.median(r["unguarded_step_ms"] for r in ranks)
    return Figure(
        f"{name}_step_vs_plain",
        f"{name} step with the callback (nan_inf, weight_consensus every 10) / without",
        ratio,
        note=f"plain step {plain:.0f} ms, {plan.steps} steps, 4 CPU ranks",
    )
