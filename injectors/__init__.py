"""Fault injectors: one module per fault model, each exporting `MODEL`; and the models installed
packages register under the entry-point group `sdc_bench.faults` (harness/core/registry.py).

`injector.FaultInjector` places a model's corruption at a site of the step; the trainer only
calls `build` and never names a concrete injector.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from harness.core import registry
from harness.core.vocabulary import STEP_SITES, Site
from injectors.model import FaultModel

# The sites every parallelism has; sharded training's all-gather (topology.parallel=fsdp|hsdp)
# is a site a replicated step has not (harness/core/vocabulary.py).
SITES = tuple(s.value for s in STEP_SITES)
GATHER = Site.GATHER.value
_NOT_MODELS = {"bits", "model", "injector", "contribution", "strikes"}


@functools.cache  # the package's modules do not change in a process
def built_in_models() -> tuple[str, ...]:
    names = (m.name for m in pkgutil.iter_modules(__path__) if m.name not in _NOT_MODELS)
    return tuple(
        sorted(n for n in names if hasattr(importlib.import_module(f"injectors.{n}"), "MODEL"))
    )


def available_models() -> tuple[str, ...]:
    return tuple(sorted({*built_in_models(), *registry.installed(registry.FAULTS)}))


def model_class(name: str) -> type[FaultModel]:
    if name in built_in_models():
        return importlib.import_module(f"injectors.{name}").MODEL
    return registry.installed(registry.FAULTS)[name].load()
