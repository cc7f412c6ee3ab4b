"""A check's settings, typed: every detector declares a frozen dataclass, its nested `Config`
(subclassing `CheckConfig`), whose `__post_init__` validates each field with the value checks of
harness/core/values.py; a bad value is one `ConfigError` naming the dotted key.

Campaign configs, a scenario's `checks:` grid and the guard all make a check's settings through
`Config.parse(key, params)`, so one value reads and fails the same wherever it came from (the
pattern of torchtitan's nested, validated component configs). Settings are plain data: they
pickle to the ranks and `dataclasses.asdict` writes them into campaign.json.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from harness.core.values import choice, integer
from harness.errors import ConfigError

# observe: record alerts and train on (campaigns measure coverage and effect in one run);
# act: also stop the step before its optimizer step or checkpoint.
MODES = ("observe", "act")


@dataclass(frozen=True)
class CheckConfig:
    """The settings every check has; a detector's `Config` adds its own fields after `mode`."""

    mode: str = "observe"

    def __post_init__(self) -> None:
        choice("mode", self.mode, MODES)

    @classmethod
    def parse(cls, key: str, params: Mapping[str, Any]) -> Self:
        """Settings from a mapping (missing keys take the defaults); `key` is the check's dotted
        config key, which every error is named under."""
        allowed = [f.name for f in dataclasses.fields(cls)]
        for name in params:
            if name not in allowed:
                raise ConfigError(f"{key}.{name}", f"unknown key; allowed: {', '.join(allowed)}")
        try:
            return cls(**params)
        except ConfigError as error:
            raise ConfigError(f"{key}.{error.key}", error.message) from None

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

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
