"""Plug-ins from outside the repository: an installed package names its detectors under the
entry-point group `sdc_bench.detectors` and its fault models under `sdc_bench.faults`, each
`NAME = "module:Class"`. The built-in ones (this repository's `detectors/` and `injectors/`) are
found by module and win a clash of names, so an installed package cannot replace a published
check's behaviour under its name."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType

DETECTORS = "sdc_bench.detectors"
FAULTS = "sdc_bench.faults"


@functools.cache
def installed(group: str) -> Mapping[str, EntryPoint]:
    """Read once per process: each read scans every installed distribution's metadata (about
    10 ms here), and validation asks once per scenario's fault. A package installed while a
    process runs is seen by the processes started after it."""
    return MappingProxyType({ep.name: ep for ep in entry_points(group=group)})
