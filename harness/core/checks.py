"""A check's settings, typed: every detector declares a frozen dataclass, its nested `Config`
(subclassing `CheckConfig`, itself harness/core/settings.py's `Settings`), whose `__post_init__`
validates each field; campaign configs, a scenario's `checks:` grid and the guard all make a
check's settings through `Config.parse(key, params)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from harness.core.settings import Settings
from harness.core.values import choice, integer

# observe: record alerts and train on (campaigns measure coverage and effect in one run);
# act: also stop the step before its optimizer step or checkpoint.
MODES = ("observe", "act")


@dataclass(frozen=True)
class CheckConfig(Settings):
    """The settings every check has; a detector's `Config` adds its own fields after `mode`."""

    # The run's settings that a scenario's own setting of a field resets to their defaults,
    # unless it sets them too: replay's listed steps stand in place of its interval, and its
    # comparison decides whether a tolerance is read.
    resets: ClassVar[dict[str, tuple[str, ...]]] = {}
    mode: str = "observe"

    def __post_init__(self) -> None:
        if self.mode is None:
            # Unset in experiments/detectors/: observe, which recovery makes act; a given observe
            # recovery refuses (harness/config/load.py), as it would be overridden.
            self._normalise("mode", "observe")
        choice("mode", self.mode, MODES)

    @property
    def every(self) -> int | None:
        """Its audit interval in steps; None for a check without one (it looks every step, or
        at listed steps)."""
        return None

    @property
    def acts(self) -> bool:
        return self.mode == "act"

    def in_mode(self, mode: str) -> Self:
        """The same check in another mode: a golden run's and a stopped trial's twin observe,
        recovery's act."""
        return dataclasses.replace(self, mode=mode)

    def _normalise(self, name: str, value: Any) -> None:
        """Store a validated field in its canonical form (a list as a tuple, an int as a float):
        the dataclass is frozen once made."""
        object.__setattr__(self, name, value)


def looks_at_multiples(every: int, steps: range) -> int:
    """How many of `steps` are multiples of `every`: the looks of a check that looks at step 0
    and every `every`-th after (replay's audits, matmul_checksum's checked steps). A cost
    measured over steps 3..29 at every 5 holds 5 looks, not 27 / 5."""
    return sum(s % every == 0 for s in steps)


@dataclass(frozen=True)
class IntervalConfig(CheckConfig):
    """A check that looks every `interval` steps (a subclass sets its own default)."""

    interval: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        integer("interval", self.interval, 1)

    @property
    def every(self) -> int:
        return self.interval
