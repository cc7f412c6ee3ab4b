"""`python -m benchmarks`: run every benchmark and print each figure next to its target.

    .venv/bin/python -m benchmarks                      # all, into results/runs/bench-<time>
    .venv/bin/python -m benchmarks --out DIR --only kernels,overhead
    .venv/bin/python -m benchmarks --quick              # tiny sizes: checks that all of it runs

Writes into the output folder: figures.csv and figures.md (the table), overhead.csv (docs/design.md
section 4), step_times.csv, growth_size.csv, growth_ranks.csv, profile_*.txt (where the time of
the checks goes) and environment.txt (the load on the machine while it ran: numbers from a busy
machine are noisier, not biased, since every ratio is taken between interleaved runs).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks import (
    audit,
    growth,
    integrations,
    kernels,
    numerics,
    products,
    step_overhead,
    throughput,
)
from benchmarks.timing import Figure, table
from benchmarks.worlds import Worlds

PARTS = ("kernels", "overhead", "hook", "throughput", "growth", "numerics", "integrations")


def parse(argv: list[str] | None) -> argparse.Namespace:
    summary = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=summary)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    parser.add_argument("--out", type=Path, default=Path("results/runs") / f"bench-{stamp}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round each")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated: {PARTS}")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the world benchmarks")
    args = parser.parse_args(argv)
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = set(args.only) - set(PARTS)
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; allowed: {', '.join(PARTS)}")
    return args


def run_all(out: Path, quick: bool, only: list[str], rounds: int | None = None) -> list[Figure]:
    """Run the chosen benchmarks into `out`; the figures, in the issue's order. Each part's
    duration goes to `out/durations.txt`."""
    out.mkdir(parents=True, exist_ok=True)
    figures: list[Figure] = []
    durations: list[str] = []

    def part(name: str, fn, *args) -> None:
        started = time.perf_counter()
        figures.extend(fn(*args))
        durations.append(f"{name}: {time.perf_counter() - started:.1f} s")

    if "kernels" in only:
        part("kernels", _kernels, out, quick)
    with Worlds() as worlds:
        if "overhead" in only:
            plan = step_overhead.Plan.quick() if quick else step_overhead.Plan()
            part("overhead", step_overhead.run, worlds, out, _with_rounds(plan, "rounds", rounds))
        if "hook" in only:
            plan = step_overhead.Plan.quick() if quick else step_overhead.Plan()
            part("hook", step_overhead.hook_run, worlds, _with_rounds(plan, "rounds", rounds))
        if "throughput" in only:
            plan = throughput.Plan.quick() if quick else throughput.Plan()
            part("throughput", throughput.run, worlds.tmp, plan)
        if "growth" in only:
            plan = growth.Plan.quick() if quick else growth.Plan()
            part("growth", growth.run, worlds, out, _with_rounds(plan, "world_rounds", rounds))
    if "numerics" in only:
        part("numerics", numerics.run, numerics.Plan.quick() if quick else numerics.Plan())
    if "integrations" in only:
        plan = integrations.Plan.quick() if quick else integrations.Plan()
        part("integrations", integrations.run, plan)
    (out / "durations.txt").write_text("\n".join(durations) + "\n")
    return figures


def _kernels(out: Path, quick: bool) -> list[Figure]:
    figures = kernels.run(rounds=2 if quick else 31, quick=quick)
    figures += products.run(rounds=2 if quick else 15, quick=quick)
    figures += audit.run(rounds=1 if quick else 15, quick=quick)
    kernels.profile(out, quick=quick)
    kernels.size_sweep(out, quick=quick)
    return figures


def _with_rounds(plan, key: str, rounds: int | None):
    return plan if rounds is None else replace(plan, **{key: rounds})


def environment() -> str:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cpu = torch.cpu.get_capabilities().get("cpu_name") or platform.processor() or platform.machine()
    return (
        f"time: {time.strftime('%Y-%m-%d %H:%M:%S')}\nhost: {platform.node()}\n"
        f"cpu: {cpu}, {os.cpu_count()} cores\n"
        f"python: {platform.python_version()}, torch: {torch.__version__}\n"
        f"load average (1, 5, 15 min): {load}\n"
    )


def write(out: Path, figures: list[Figure], started_env: str) -> None:
    with open(out / "figures.csv", "w", newline="") as f:
        fields = [*asdict(figures[0]), "verdict"] if figures else ["key"]
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(asdict(fig) | {"verdict": fig.verdict()} for fig in figures)
    (out / "figures.md").write_text(table(figures) + "\n")
    (out / "environment.txt").write_text(f"at start\n{started_env}\nat end\n{environment()}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    started_env = environment()
    started = time.perf_counter()
    figures = run_all(args.out, args.quick, args.only, args.rounds)
    write(args.out, figures, started_env)
    print(table(figures))
    missed = [f.key for f in figures if f.met is False]
    print(f"\n{len(figures)} figures in {time.perf_counter() - started:.0f} s; "
          f"missed: {', '.join(missed) or 'none'}; results: {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":  # the guard matters: worlds spawn processes that import this module
    sys.exit(main())
