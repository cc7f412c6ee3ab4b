"""Plug-ins from outside the repository: an installed package names its detectors under the
entry-point group `sdc_bench.detectors` and its fault models under `sdc_bench.faults`, each
`NAME = "module:Class"`. The built-in ones (this repository's `detectors/` and `injectors/`) are
found by module and win a clash of names, so an installed package cannot replace a published
check's behaviour under its name."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

DETECTORS = "sdc_bench.detectors"
FAULTS = "sdc_bench.faults"


def installed(group: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}
