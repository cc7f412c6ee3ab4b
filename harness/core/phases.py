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

# The first phase whose checks can see a fault at each site, by where the step meets it
# (docs/design.md section 3): a forward value, the loss, a gradient of backward (a backward
# product's too: the first check after backward is pre_allreduce), the received sum, Adam's
# state, the updated weights. An alert in an earlier phase of the injection step came first.
STRIKE_PHASE = {
    "activation": "forward",
    "gather": "forward",
    "matmul": "forward",
    "matmul backward": "pre_allreduce",
    "loss": "loss",
    "grad": "pre_allreduce",
    "allreduce": "post_allreduce",
    "optimizer": "optimizer",
    "weight": "post_update",
}
