"""A campaign's fault mix: scenarios may carry `fault_class: NAME` and `weight: W`, the class's
share of the SDC a fleet sees (experiments/campaign/field_mix.yaml gives each its source). The
report and `sdc-plan` then weigh each class's fired trials by its weight, spread evenly over them,
instead of counting every trial once (harness/analysis/mix.py).

A mix is all or nothing: when one fault scenario is weighed, every fault scenario must be (a
trial without a weight would silently count as nothing), a clean scenario takes none (it has no
fault to weigh), and scenarios naming the same class give it the same weight.
"""

from __future__ import annotations

import math
from typing import Any

from harness.config.schema import FaultClass
from harness.errors import ConfigError

KEYS = ("fault_class", "weight")


def scenario_class(key: str, scenario: dict[str, Any]) -> FaultClass | None:
    """Pop the scenario's mix keys; its class, or None when it names none."""
    name, weight = scenario.pop("fault_class", None), scenario.pop("weight", None)
    if name is None and weight is None:
        return None
    if name is None or weight is None:
        missing = "fault_class" if name is None else "weight"
        raise ConfigError(f"{key}.{missing}", "a weighed scenario names its class and its "
                          "weight together")  # fmt: skip
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{key}.fault_class", f"'{name}' must be a class name")
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not (math.isfinite(weight) and weight > 0)
    ):
        raise ConfigError(f"{key}.weight", f"'{weight}' must be a number > 0")
    if str(scenario.get("site", "none")) == "none":
        raise ConfigError(f"{key}.weight", "a clean scenario (site none) has no fault to weigh; "
                          "leave fault_class and weight unset")  # fmt: skip
    return FaultClass(name.strip(), float(weight))


def check_mix(scenarios: list[tuple[str, bool, FaultClass | None]]) -> None:
    """(key, has a fault, class) per scenario: all fault scenarios weighed or none, one weight
    per class."""
    weighed = [(k, c) for k, _, c in scenarios if c is not None]
    if not weighed:
        return
    for key, fault, mix in scenarios:
        if fault and mix is None:
            raise ConfigError(f"{key}.weight", "the campaign weighs its other faults; give this "
                              "scenario a fault_class and a weight")  # fmt: skip
    first: dict[str, tuple[str, float]] = {}
    for key, mix in weighed:
        seen = first.setdefault(mix.name, (key, mix.weight))
        if seen[1] != mix.weight:
            raise ConfigError(f"{key}.weight", f"{mix.weight:g}: class '{mix.name}' has weight "
                              f"{seen[1]:g} in {seen[0]}; one weight per class")  # fmt: skip
