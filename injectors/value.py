"""`value`: set the element to a number, `nan`, `inf`, `-inf`, `max` (largest finite), `zero`,
or `random` (uniform over the tensor's current range, seeded: a fault that persists repeats
its first draw, `FaultInjector._redraw`, placed in the range at each strike)."""

from __future__ import annotations

import math

import torch

from harness.errors import ConfigError
from injectors.model import FaultModel

NAMED = ("nan", "inf", "-inf", "max", "zero", "random")


def unstored(value: str | None, dtype: str) -> tuple[float, str] | None:
    """A finite, nonzero value that `dtype` writes as an infinity or zero: what it writes, and
    what is allowed (the record would say a value no run wrote); None for one it keeps, or a
    name (nan, inf, max, zero, random)."""
    try:
        number = float(value) if value is not None else math.nan
    except ValueError:
        return None
    if not math.isfinite(number) or number == 0:
        return None
    stored = torch.tensor(number, dtype=torch.float64).to(getattr(torch, dtype)).item()
    if math.isfinite(stored) and stored != 0:
        return None
    limit = torch.finfo(getattr(torch, dtype))
    return stored, f"{limit.tiny * limit.eps:g} <= |value| <= {limit.max:g}, or {', '.join(NAMED)}"


class Value(FaultModel):
    name = "value"

    @classmethod
    def validate(cls, key: str, fault) -> None:
        if fault.value in NAMED:
            return
        try:
            number = float(fault.value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise ConfigError(
                f"{key}.value",
                f"'{fault.value}' is not allowed; allowed: a number, {', '.join(NAMED)}",
            )

    def corrupt(self, flat: torch.Tensor, index: int, bit: int | None = None) -> None:
        choice = self.fault.value
        if choice == "max":
            new = torch.finfo(flat.dtype).max
        elif choice == "zero":
            new = 0.0
        elif choice == "random":
            low, high = float(flat.min()), float(flat.max())
            new = self.rng.uniform(low, high)
        else:
            new = float(choice)
        flat[index] = new


MODEL = Value
