"""One config value checked against what is allowed: each failure is one `ConfigError` naming
the dotted key, which the commands print as one line before exiting 2."""

from __future__ import annotations

import numbers
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from harness.errors import ConfigError


def plain(value: Any) -> Any:
    """`value` as the checks read values: any mapping as a dict and any sequence but text as a
    list, all the way down (a Hydra config's DictConfig and ListConfig, a MappingProxyType)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [plain(v) for v in value]
    return value


def choice(key: str, value: Any, allowed: tuple[str, ...] | list[str]) -> str:
    if value not in allowed:
        raise ConfigError(key, f"'{value}' is not allowed; allowed: {', '.join(allowed)}")
    return value


def integer(key: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """`value` as an int: any integer type (numpy's, as a script computes one), not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(key, f"'{value}' is not an integer")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"{low if low is not None else '-inf'}..{high if high is not None else 'inf'}"
        raise ConfigError(key, f"{value} is out of range; allowed: {bounds}")
    return value


def positive(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(key, f"'{value}' must be a positive number")
    return float(value)


def int_list(key: str, value: Any, low: int, high: int) -> tuple[int, ...]:
    """A list of integers; an item "A:B" or "A:B:S" stands for range(A, B, S)."""
    items = [value] if isinstance(value, int | str) else value
    if not isinstance(items, list | tuple) or not items:
        raise ConfigError(key, f"'{value}' must be a non-empty list of integers in {low}..{high}")
    found: set[int] = set()
    for i, item in enumerate(items):
        # Errors name the user's item, even after ranges before it expanded.
        if isinstance(item, str):
            parts = item.split(":")
            try:
                if not 2 <= len(parts) <= 3:
                    raise ValueError
                span = range(*(int(part) for part in parts))
            except (TypeError, ValueError):
                raise ConfigError(f"{key}[{i}]", f"'{item}' is not a range A:B or A:B:S") from None
            if not span:
                raise ConfigError(f"{key}[{i}]", f"'{item}' is an empty range")
            found.update(integer(f"{key}[{i}]", v, low, high) for v in span)
        else:
            found.add(integer(f"{key}[{i}]", item, low, high))
    return tuple(sorted(found))


def known_keys(prefix: str, raw: dict[str, Any], known: list[str]) -> None:
    for key in raw:
        if key not in known:
            raise ConfigError(f"{prefix}{key}", f"unknown key; allowed: {', '.join(known)}")


def flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"'{value}' is not allowed; allowed: true, false")
    return value


def fraction(key: str, value: Any, what: str = "") -> float:
    """A number strictly between 0 and 1 (a relative tolerance, a share)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise ConfigError(key, f"'{value}' must be in (0, 1){what}")
    return float(value)


def above(key: str, value: Any, low: float) -> float:
    """A number strictly greater than `low` (a threshold, a ratio)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > low:
        raise ConfigError(key, f"'{value}' must be a number > {low:g}")
    return float(value)


def writable(folder: Path) -> bool:
    """Whether a folder can be made in `folder`, tried (and removed): permission bits do not
    say so for root, whom they never stop, on a read-only or pseudo file system (/proc)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".sdc-bench-probe-", dir=folder))
    except OSError:
        return False
    return True
