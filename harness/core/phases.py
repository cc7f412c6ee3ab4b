"""The step's phases, which events, alerts and checks name."""

from __future__ import annotations

# The step's points, in the order they happen (docs/design.md, section 3). The index orders alerts
# within a step, which `contained` relies on.
PHASES = (
    "forward",
    "loss",
    "pre_allreduce",
    "post_allreduce",
    "audit",
    "optimizer",
    "post_update",
    "consensus",
    "checkpoint",
)
PHASE_ORDER = {name: i for i, name in enumerate(PHASES)}
