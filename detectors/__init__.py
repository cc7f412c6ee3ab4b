"""Detectors: one module per check, each exporting `DETECTOR`, plus one config in
experiments/detectors/; and the checks installed packages register under the entry-point group
`sdc_bench.detectors` (harness/core/registry.py), whose defaults are their `Config`'s. Nothing
here may import `injectors` or read injection events: a check that could see the fault plan
would make every catch rate worthless.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from harness.core import registry
from harness.core.checks import CheckConfig
from harness.core.plugins import Detector, DetectorContext, EventLog


@functools.cache  # the package's modules do not change in a process; build() asks per trial
def built_in() -> tuple[str, ...]:
    names = (m.name for m in pkgutil.iter_modules(__path__))
    return tuple(
        sorted(n for n in names if hasattr(importlib.import_module(f"detectors.{n}"), "DETECTOR"))
    )


def available() -> tuple[str, ...]:
    return tuple(sorted({*built_in(), *registry.installed(registry.DETECTORS)}))


def detector_class(name: str) -> type[Detector]:
    if name in built_in():
        return importlib.import_module(f"detectors.{name}").DETECTOR
    return registry.installed(registry.DETECTORS)[name].load()


def build(configs: dict[str, CheckConfig], ctx: DetectorContext, log: EventLog) -> list[Detector]:
    return [detector_class(name)(config, ctx, log) for name, config in configs.items()]
