"""The guard's overhead on examples/train_guarded.py, per check, against the same loop without
the guard (`--guard-off`): median step time of each run, median over rounds, configurations
interleaved so that a busy machine slows every one alike.

    python examples/guard_overhead.py [--rounds 5] [--steps 30]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).with_name("train_guarded.py")
CONFIGS = {
    "guard-off": ["--guard-off"],
    "hook only": ["--detectors", "{}"],
    "nan_inf": ["--detectors", '{"nan_inf": {}}'],
    "grad_stats": ["--detectors", '{"grad_stats": {}}'],
    "allreduce_sketch": ["--detectors", '{"allreduce_sketch": {}}'],
    "weight_consensus (every 10)": ["--detectors", '{"weight_consensus": {}}'],
    "replay (every 5)": ["--detectors", '{"replay": {"interval": 5}}'],
    "replay (every 1)": ["--detectors", '{"replay": {"interval": 1}}'],
    "every check (defaults)": [],
}


def step_time(args: list[str], steps: int) -> tuple[float, float]:
    torchrun = Path(sys.executable).with_name("torchrun")
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(
            [str(torchrun), "--standalone", "--nproc-per-node=4", str(EXAMPLE), "--out", out,
             "--steps", str(steps), "--checkpoint-every", str(steps), *args],
            check=True, capture_output=True, env=dict(os.environ),
        )  # fmt: skip
        summary = json.loads((Path(out) / "summary.json").read_text())
    return summary["step_time_s"], summary["replay_transfer_s"] / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    transfer: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name, extra in CONFIGS.items():
            step, shipped = step_time(extra, args.steps)
            times[name].append(step)
            transfer[name].append(shipped)
    base = statistics.median(times["guard-off"])
    print("| configuration | step (ms) | overhead | runs (ms) | replay transfer (ms/step) |")
    print("|---|---|---|---|---|")
    for name in CONFIGS:
        step = statistics.median(times[name])
        spread = f"{1000 * min(times[name]):.1f}-{1000 * max(times[name]):.1f}"
        print(f"| {name} | {1000 * step:.1f} | {100 * (step / base - 1):+.1f}% | {spread} | "
              f"{1000 * statistics.median(transfer[name]):.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
