"""Timing on a shared, noisy machine, and the `Figure` every benchmark reports.

Two rules fight the noise. Interleave: the variants being compared run in alternation (A B B A
...), so a burst of load from another process hits both sides rather than one. Pair: a ratio is
the median of per-round ratios, each taken between calls made a few milliseconds apart.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

# A timed sample repeats a fast call until it lasts this long: the clock's and the
# interpreter's jitter (microseconds) must stay small against what is measured.
MIN_SAMPLE_S = 2e-3


@dataclass
class Figure:
    """One measured number next to its target: `value <= target` (op "<=") or ">=".

    `target` is None for a figure shown for information only (the tiny model, the other dtype).
    """

    key: str
    label: str
    value: float
    unit: str = "x"
    target: float | None = None
    op: str = "<="
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.target is None or not math.isfinite(self.value):
            return None
        return self.value <= self.target if self.op == "<=" else self.value >= self.target

    def target_text(self) -> str:
        return "" if self.target is None else f"{self.op} {self.target:g}{self.unit}"

    def value_text(self) -> str:
        return f"{self.value:.3g}{self.unit}"

    def verdict(self) -> str:
        return {True: "met", False: "MISSED", None: "info"}[self.met]


def _calls_per_sample(fn: Callable[[], object]) -> int:
    started = time.perf_counter()
    fn()
    once = time.perf_counter() - started
    return max(1, math.ceil(MIN_SAMPLE_S / max(once, 1e-9)))


def interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each function, `rounds` samples each, in alternating order.

    The first call of each is untimed (allocator, cached signs, lazy imports); the second sets
    how many calls one sample makes.
    """
    for fn in fns.values():
        fn()
    calls = {name: _calls_per_sample(fn) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            fn, n = fns[name], calls[name]
            started = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - started) / n)
    return times


def paired_ratio(times: dict[str, list[float]], num: str, den: str) -> float:
    """Median over rounds of time(num) / time(den): each ratio compares neighbours in time."""
    return statistics.median(a / b for a, b in zip(times[num], times[den], strict=True))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def table(figures: list[Figure]) -> str:
    """A markdown table: figure, measured, target, verdict, note (what `python -m benchmarks`
    prints and writes, and docs/performance.md shows)."""
    lines = ["| figure | measured | target | | note |", "|---|---:|---|---|---|"]
    for f in figures:
        note = f.note.replace("|", "\\|")  # a `|` inside a cell would end it
        lines.append(
            f"| {f.label} | {f.value_text()} | {f.target_text()} | {f.verdict()} | {note} |"
        )
    return "\n".join(lines)
