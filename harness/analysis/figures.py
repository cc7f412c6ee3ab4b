"""The report's figures, drawn from the trial table alone (PNG under `figures/`)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

from harness.analysis.tables import (
    as_text,
    bit_dtypes,
    catch_counts,
    cell_label,
    scenario_columns,
    silent_fired,
    sweep_columns,
)
from harness.core.vocabulary import Effect, Site
from harness.results.trial_row import Column

matplotlib.use("Agg")  # no display: the report is written by a batch job

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

EFFECT_COLORS = {
    Effect.MASKED: "#9ecae1",
    Effect.BENIGN: "#a1d99b",
    Effect.LATENT: "#fdd0a2",
    Effect.HARMFUL: "#fc9272",
    Effect.CRASH: "#636363",
    Effect.NONE: "#ffffff",
}
MAX_TTD_BINS = 50


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def catch_rate_by_detector(df: pd.DataFrame, detectors: list[str], wilson, path: Path) -> Path:
    """Catch rate among fired and among harmful trials, with 95% Wilson intervals: each
    detector's n counts the trials in which it ran, the report's table's counts (catch_counts).
    A detector that ran in none of a set's trials has no bar there, and says n=0."""
    counts = catch_counts(df)
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(detectors) + 2), 3.2))
    width = 0.38
    for offset, label in zip((-width / 2, width / 2), ("all fired", "harmful"), strict=True):
        x, rates, errors = [], [], [[], []]
        for i, d in enumerate(detectors):
            k, n = counts[label].get(d, (0, 0))
            if n == 0:
                ax.text(i + offset, 0.02, "n=0", ha="center", fontsize=7)
                continue
            lo, hi = wilson(k, n)
            x.append(i + offset)
            rates.append(k / n)
            errors[0].append(max(0.0, k / n - lo))  # rounding can put lo a hair above
            errors[1].append(max(0.0, hi - k / n))
        ax.bar(x, rates, width, yerr=errors, capsize=3, label=f"among {label}")
    ax.set_xticks(np.arange(len(detectors)), detectors, rotation=20, ha="right")
    # Every detector's place, with bars or without (a campaign of clean trials has none).
    ax.set_xlim(-0.6, len(detectors) - 0.4)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("catch rate")
    ax.legend(fontsize=8)
    return _save(fig, path)


def effects_by_scenario(df: pd.DataFrame, path: Path) -> Path:
    """Masked / benign / latent / harmful / crash shares per scenario cell (site, model, the
    columns that tell the trials' scenarios apart, bit class; tables.cell_label names each),
    of the trials with an effect: a planned fault that never struck is counted apart."""
    faulty = df[(df[Column.site] != Site.NONE) & (df[Column.effect] != Effect.NONE)]
    columns = [Column.site, Column.model, *scenario_columns(df), Column.bit_class]
    named = as_text(faulty, columns)
    cells = named[columns].apply(lambda row: cell_label(row.to_dict()), axis=1)
    table = pd.crosstab(cells.rename("cell"), named[Column.effect], normalize="index")
    # Wide enough for the longest cell's name beside the bars (about 0.075 in a character).
    longest = max((len(name) for name in table.index), default=0)
    fig, ax = plt.subplots(figsize=(max(7.0, 4.5 + 0.075 * longest), 0.35 * len(table) + 1.5))
    left = np.zeros(len(table))
    for effect in (Effect.MASKED, Effect.BENIGN, Effect.LATENT, Effect.HARMFUL, Effect.CRASH):
        if effect in table:
            ax.barh(range(len(table)), table[effect], left=left, color=EFFECT_COLORS[effect],
                    label=effect, edgecolor="black", linewidth=0.3)  # fmt: skip
            left += table[effect].to_numpy()
    ax.set_yticks(range(len(table)), list(table.index))
    ax.set_xlabel("share of trials")
    if ax.get_legend_handles_labels()[0]:  # no trial fired: nothing to name
        ax.legend(fontsize=8, ncols=5, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    return _save(fig, path)


def catch_heatmap(df: pd.DataFrame, dtype: str, path: Path) -> Path | None:
    """Catch rate (any detector) per site and bit index, for trials with a numeric bit of
    `dtype` (the bit's own: a bfloat16 output's under bf16-mixed, `bit_dtypes`)."""
    fired = df[(df[Column.fired] == True) & (bit_dtypes(df) == dtype)].copy()  # noqa: E712
    fired["bit_index"] = pd.to_numeric(fired[Column.bit], errors="coerce")
    fired = fired.dropna(subset=["bit_index"])
    if fired.empty:
        return None
    grid = fired.pivot_table(
        index=Column.site, columns="bit_index", values=Column.detected, aggfunc="mean"
    )
    fig, ax = plt.subplots(figsize=(max(5, 0.3 * grid.shape[1] + 2), 0.5 * len(grid) + 1.5))
    image = ax.imshow(grid.to_numpy(dtype=float), vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_yticks(range(len(grid)), grid.index)
    ax.set_xticks(range(grid.shape[1]), [str(int(b)) for b in grid.columns], fontsize=7)
    ax.set_xlabel(f"bit ({dtype}, LSB = 0)")
    fig.colorbar(image, ax=ax, label="catch rate")
    return _save(fig, path)


def detection_delay(df: pd.DataFrame, path: Path) -> Path | None:
    fired = silent_fired(df)
    caught = fired[fired[Column.detected] == True]  # noqa: E712
    if caught.empty:
        return None
    ttd = pd.to_numeric(caught[Column.ttd_steps], errors="coerce")
    # Bins up to the slowest detection, a step wide until that makes more than MAX_TTD_BINS: a
    # fixed range silently left out every trial past it.
    top = int(np.nan_to_num(ttd.max()))
    step = max(1, math.ceil((top + 1) / MAX_TTD_BINS))
    bins = np.arange(0, top + step + 1, step)
    fig, ax = plt.subplots(figsize=(5, 3))
    for detector, g in ttd.groupby(caught[Column.first_detector]):
        ax.hist(g, bins=bins, alpha=0.6, label=detector)
    ax.set_xlabel("steps from injection to first alert")
    ax.set_ylabel("trials")
    ax.legend(fontsize=8)
    return _save(fig, path)


def escape_impact(escaped: pd.DataFrame, cell: list[str], path: Path) -> Path:
    """|loss_delta| of each harmful trial no detector caught, one row per scenario cell; a final
    loss that is not a number is drawn as a cross at the right edge."""
    groups = list(escaped.groupby(cell, dropna=False))
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(groups) + 1.5))
    deltas = pd.to_numeric(escaped[Column.loss_delta], errors="coerce").abs()
    finite = deltas[np.isfinite(deltas) & (deltas > 0)]
    edge = 10 * finite.max() if len(finite) else 1.0
    lost = False
    for y, (_, g) in enumerate(groups):
        delta = pd.to_numeric(g[Column.loss_delta], errors="coerce").abs().to_numpy()
        shown = np.isfinite(delta) & (delta > 0)
        jitter = np.linspace(-0.15, 0.15, len(delta)) if len(delta) > 1 else np.zeros(1)
        ax.scatter(delta[shown], y + jitter[shown], s=14, color=EFFECT_COLORS[Effect.HARMFUL],
                   edgecolor="black", linewidth=0.3)  # fmt: skip
        if (~np.isfinite(delta)).any():
            lost = True
            ax.scatter(np.full((~np.isfinite(delta)).sum(), edge), y + jitter[~np.isfinite(delta)],
                       marker="x", color="black", s=20)  # fmt: skip
    ax.set_xscale("log")
    if not len(finite):  # crosses alone: no loss change to scale the axis by
        ax.set_xticks([edge], ["NaN/Inf"])
        ax.minorticks_off()
    ax.set_yticks(range(len(groups)), [" / ".join(str(k) or "-" for k in key) for key, _ in groups])
    ax.set_xlabel("|final loss - golden final loss|" + ("  (x: NaN/Inf)" if lost else ""))
    return _save(fig, path)


def overhead_vs_interval(table: pd.DataFrame, path: Path) -> Path | None:
    """Overhead (solid) and its floor (dashed) against the interval, per check with one."""
    periodic = table.dropna(subset=["steps"])
    if periodic.empty:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    swept = sweep_columns(periodic)
    for keys, g in periodic.groupby([*swept, "detector"]):
        name = " ".join(map(str, keys))  # a line per workload, dtype and precision, where several
        (line,) = ax.plot(g["steps"], g["overhead_pct"], marker="o", label=name)
        floor = g.dropna(subset=["floor_pct"])
        if not floor.empty:
            ax.plot(floor["steps"], floor["floor_pct"], marker="s", linestyle="--",
                    color=line.get_color(), label=f"{name} floor")  # fmt: skip
    ax.set_xscale("log")
    intervals = sorted(periodic["steps"].unique())
    ax.set_xticks(intervals, [f"{k:g}" for k in intervals])
    ax.minorticks_off()  # log-scale minor labels (2x10^0 ...) would hide the measured intervals
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.set_xlabel("interval (steps)")
    ax.set_ylabel("step overhead (%)")
    ax.legend(fontsize=8)
    return _save(fig, path)
