"""A plug-in's settings, typed: a frozen dataclass whose `__post_init__` validates each field with
the value checks of harness/core/values.py, so a bad value is one `ConfigError` naming the dotted
key. A detector's `Config` (harness/core/checks.py) and a fault model's `Config`
(injectors/model.py) both derive from `Settings`.

Campaign configs, a scenario's keys and the guard make settings through
`Config.parse(key, params)`, so one value reads and fails the same wherever it came from (the
pattern of torchtitan's nested, validated component configs). Settings are plain data: they
pickle to the ranks and `dataclasses.asdict` writes them into campaign.json.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from harness.errors import ConfigError


@dataclass(frozen=True)
class Settings:
    """No settings: a plug-in that declares none takes no keys of its own."""

    @classmethod
    def names(cls) -> list[str]:
        """The keys these settings take."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def parse(cls, key: str, params: Mapping[str, Any]) -> Self:
        """Settings from a mapping (missing keys take the defaults); `key` is the plug-in's
        dotted config key, which every error is named under."""
        allowed = cls.names()
        for name in params:
            if name not in allowed:
                listed = ", ".join(allowed) if allowed else "none"
                raise ConfigError(f"{key}.{name}", f"unknown key; allowed: {listed}")
        try:
            return cls(**params)
        except ConfigError as error:
            raise ConfigError(f"{key}.{error.key}", error.message) from None

    def params(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
