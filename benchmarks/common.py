"""What the benchmarks measure on: the project's own configs, models and detectors.

Configs come from experiments/ through Hydra's compose API (as `sdc-bench` would compose them),
so a benchmark measures exactly what a campaign runs. Detectors are the real classes, built
on the context of rank 0, so their per-bucket work is timed as the trainer calls it.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

from detectors import detector_class
from harness.config.load import run_config
from harness.config.schema import RunConfig
from harness.core.plugins import Bucket, Detector, DetectorContext, EventLog, RankInfo
from harness.runtime.workloads import Workload, WorkloadConfig

# harness.cli's CONFIG_DIR, not imported from there: that would load the report's pandas and
# matplotlib into every rank a world spawns (spawn re-imports the main module).
CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "experiments")
# Larger than this machine's last-level cache (32 MiB) several times over: a pass over buffers
# that together exceed it reads from memory, as a pass over a real model's gradients does.
COLD_BYTES = 128 * 2**20


def compose_run(*overrides: str) -> RunConfig:
    """The validated RunConfig that `sdc-bench OVERRIDES` would run."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return run_config(OmegaConf.to_container(cfg, resolve=True))


@functools.cache
def gpt_config() -> WorkloadConfig:
    """The reference workload (`workload=gpt`) as configured in experiments/."""
    return compose_run("workload=gpt", "detectors=[]").workload


def gpt(width: int | None = None, dtype: str = "float32", **changes: Any) -> nn.Module:
    """The `gpt` workload's model, optionally wider; heads keep 32 channels each."""
    cfg = gpt_config()
    if width is not None:
        changes |= {"d_model": width, "heads": max(1, width // 32)}
    return Workload(replace(cfg, dtype=dtype, **changes)).build_model()


def params_of(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def detector(
    name: str,
    dtype: torch.dtype = torch.float32,
    model: nn.Module | None = None,
    workload: Workload | None = None,
    world: int = 1,
    **params: Any,
) -> Detector:
    """A real detector on rank 0 of a world of `world` ranks, one per node.

    Without a model, a one-parameter stand-in of `dtype` (the sketch reads its tolerance off
    the model's dtype); replay needs the real model and workload.
    """
    cls = detector_class(name)
    model = model if model is not None else nn.Linear(1, 1).to(dtype)
    data = tuple((r,) for r in range(world))  # each rank trains on its own micro-batches
    ctx = DetectorContext(RankInfo(0, world, 1), model, workload, steps=1, data=data)
    return cls(cls.configure(name, params, None), ctx, EventLog(0, 0))


def bucket(numel: int, dtype: torch.dtype, tensors: int = 16, index: int = 0) -> Bucket:
    """A flat gradient bucket as DDP hands it to the comm hook: one buffer, named views.

    Gradient-like values (small, finite). The names are the same for every bucket built with
    the same shape, so detectors that cache per-name state (the sketch's signs) reuse it, as
    they do from one step to the next.
    """
    buffer = (torch.randn(numel) * 1e-3).to(dtype)
    bounds = torch.linspace(0, numel, tensors + 1).long().tolist()
    spans = zip(bounds[:-1], bounds[1:], strict=True)
    views = [(f"layer{i}.weight", buffer[a:b]) for i, (a, b) in enumerate(spans)]
    return Bucket(index=index, buffer=buffer, tensors=views, is_last=True)


class Rotation:
    """Hands out copies of one thing in turn, enough of them to exceed the cache: every call
    then reads its data from memory, not from what the previous call left in the cache.

    At most MAX_COPIES: the smallest tensors then stay partly cached, as small gradients fresh
    from the backward pass are, and building thousands of copies would take longer than
    timing them.
    """

    MAX_COPIES = 512

    def __init__(self, make, nbytes: int, min_copies: int = 2):
        copies = max(min_copies, min(self.MAX_COPIES, -(-COLD_BYTES // max(1, nbytes))))
        self.items = [make() for _ in range(copies)]
        self.at = 0

    def next(self):
        self.at = (self.at + 1) % len(self.items)
        return self.items[self.at]
