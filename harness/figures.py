"""The report's figures, drawn from the trial table alone (PNG under `figures/`)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: the report is written by a batch job

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

EFFECT_COLORS = {
    "masked": "#9ecae1",
    "benign": "#a1d99b",
    "harmful": "#fc9272",
    "crash": "#636363",
    "none": "#ffffff",
}


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def catch_rate_by_detector(df: pd.DataFrame, detectors: list[str], wilson, path: Path) -> Path:
    """Catch rate among fired and among harmful trials, with 95% Wilson intervals."""
    fired = df[df["fired"] == True]  # noqa: E712
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(detectors) + 2), 3.2))
    width = 0.38
    for offset, (label, subset) in zip(
        (-width / 2, width / 2),
        (("fired", fired), ("harmful", fired[fired["effect"] == "harmful"])),
        strict=True,
    ):
        rates, errors = [], [[], []]
        for d in detectors:
            k = int(subset["detected_by"].map(lambda s, d=d: d in s.split(";")).astype(bool).sum())
            n = len(subset)
            lo, hi = wilson(k, n) if n else (0.0, 0.0)
            rate = k / n if n else 0.0
            rates.append(rate)
            errors[0].append(max(0.0, rate - lo))  # rounding can put lo a hair above
            errors[1].append(max(0.0, hi - rate))
        x = np.arange(len(detectors)) + offset
        ax.bar(x, rates, width, yerr=errors, capsize=3, label=f"among {label}")
    ax.set_xticks(np.arange(len(detectors)), detectors, rotation=20, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("catch rate")
    ax.legend(fontsize=8)
    return _save(fig, path)


def effects_by_scenario(df: pd.DataFrame, path: Path) -> Path:
    """Masked / benign / harmful / crash shares per (site, model)."""
    faulty = df[df["site"] != "none"]
    table = pd.crosstab([faulty["site"], faulty["model"]], faulty["effect"], normalize="index")
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(table) + 1.5))
    left = np.zeros(len(table))
    for effect in ("masked", "benign", "harmful", "crash"):
        if effect in table:
            ax.barh(range(len(table)), table[effect], left=left, color=EFFECT_COLORS[effect],
                    label=effect, edgecolor="black", linewidth=0.3)  # fmt: skip
            left += table[effect].to_numpy()
    ax.set_yticks(range(len(table)), [f"{s} / {m}" for s, m in table.index])
    ax.set_xlabel("share of trials")
    ax.legend(fontsize=8, ncols=4, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    return _save(fig, path)


def catch_heatmap(df: pd.DataFrame, dtype: str, path: Path) -> Path | None:
    """Catch rate (any detector) per site and bit index, for trials with a numeric bit."""
    fired = df[(df["fired"] == True) & (df["dtype"] == dtype)].copy()  # noqa: E712
    fired["bit_index"] = pd.to_numeric(fired["bit"], errors="coerce")
    fired = fired.dropna(subset=["bit_index"])
    if fired.empty:
        return None
    grid = fired.pivot_table(index="site", columns="bit_index", values="detected", aggfunc="mean")
    fig, ax = plt.subplots(figsize=(max(5, 0.3 * grid.shape[1] + 2), 0.5 * len(grid) + 1.5))
    image = ax.imshow(grid.to_numpy(dtype=float), vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_yticks(range(len(grid)), grid.index)
    ax.set_xticks(range(grid.shape[1]), [str(int(b)) for b in grid.columns], fontsize=7)
    ax.set_xlabel(f"bit ({dtype}, LSB = 0)")
    fig.colorbar(image, ax=ax, label="catch rate")
    return _save(fig, path)


def detection_delay(df: pd.DataFrame, path: Path) -> Path | None:
    caught = df[df["detected"] == True]  # noqa: E712
    if caught.empty:
        return None
    fig, ax = plt.subplots(figsize=(5, 3))
    for detector, g in caught.groupby("first_detector"):
        ax.hist(pd.to_numeric(g["ttd_steps"]), bins=range(0, 22), alpha=0.6, label=detector)
    ax.set_xlabel("steps from injection to first alert")
    ax.set_ylabel("trials")
    ax.legend(fontsize=8)
    return _save(fig, path)
