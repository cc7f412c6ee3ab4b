"""What a run leaves behind, as the rest of the harness and every reader of its tables see it:
what each rank reports about a trial, the golden runs, recovery's record and overhead.csv's
columns (docs/design.md, section 4; trials.csv's row is harness/results/trial_row.py).
Analysis reads runs through these two modules and harness.core alone; it imports neither torch
nor the rest of the harness.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.core.events import Event


@dataclass
class RankResult:
    """What one rank reports about one trial."""

    trial_id: str
    rank: int
    # The rank's events; the first part also holds recovery's, from the trial's earlier runs.
    events: list[Event] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    final_loss: float = math.nan
    weights_digest: str = ""
    weights_finite: bool = True
    # Non-finite elements in the optimizer state: an Adam moment that overflowed to inf freezes
    # its weight for the rest of the run (its update is m / inf = 0).
    optimizer_nonfinite: int = 0
    stopped_step: int | None = None
    stopped_by: str = ""
    # Device-to-host reads of the checks' results in each step (docs/design.md, section 6).
    host_reads: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Golden:
    """The fault-free reference for one seed."""

    seed: int
    final_loss: float
    weights_digest: str
    # The golden store's entry it came from (harness/campaign/golden_store.py); None: it ran in
    # this campaign. Where a result comes from never makes it another result.
    reused_from: str | None = field(default=None, compare=False)


def read_goldens(path: Path) -> list[Golden]:
    """golden.jsonl's golden runs, in the order they were written (none without the file)."""
    if not path.exists():
        return []
    return [Golden(**json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines()]


@dataclass
class RecoveryRecord:
    """What harness.campaign.recovery did for one trial, as trials.csv's recovery columns say it:
    each stop's step and suspect nodes, each recovery ("KIND at step S ...", RECOVERY_KINDS),
    where each rollback restored, the steps and seconds lost, and the verdict when it gave up."""

    stops: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    recoveries: list[str] = field(default_factory=list)
    restores: list[int] = field(default_factory=list)
    steps_lost: int = 0
    seconds: float = 0.0
    verdict: str = ""
    quarantined: tuple[int, ...] = ()
    final_nodes: int = 0
    completed: bool = False

    def fields(self) -> dict[str, Any]:
        """The recovery fields of the trial's TrialRow (`recovered` None where nothing was
        recovered)."""
        acted = bool(self.stops or self.recoveries)
        return dict(
            recovered=(not self.verdict and self.completed) if acted else None,
            recoveries=len(self.recoveries),
            restore_step=tuple(self.restores),
            steps_lost=self.steps_lost,
            recovery_s=round(self.seconds, 3) if self.stops else None,
            quarantined_nodes=tuple(self.quarantined),
            final_nodes=self.final_nodes,
            recovery_verdict="; ".join(
                [*self.recoveries, self.verdict] if self.verdict else self.recoveries
            )
            or None,
        )


@dataclass
class TrialResult:
    """What a trial returned: one part per rank, or the cause of its crash (the world's answer;
    harness/results/judgement.py judges it)."""

    parts: list[RankResult] | None = None
    crash: str | None = None
    recovery: RecoveryRecord | None = None  # what harness.campaign.recovery did, when it ran
    stacks: dict[int, str] = field(default_factory=dict)  # hung ranks' full stack dumps
    # Every rank raised the same error on the same line: a bad workload, which a fresh world
    # would only raise again.
    workload_error: bool = False


# The ways a run gets back, as `recovery_verdict` names each recovery ("KIND at step S ...",
# `;`-joined in order): the step's reduction re-run in the step itself, a rollback to a
# checkpoint, and a rollback that also quarantined the suspect nodes.
RECOVERY_KINDS = ("retry", "rollback", "rollback+quarantine")


def recovery_kinds(verdict: str) -> list[str]:
    """The kind of each recovery a `recovery_verdict` lists, in order (a failure's verdict,
    the last entry when recovery gave up, is none of them)."""
    kinds = [entry.split(" ", 1)[0] for entry in verdict.split("; ") if entry]
    return [k for k in kinds if k in RECOVERY_KINDS]


OVERHEAD_FILE = "overhead.csv"
HOOK = "hook"  # overhead.csv's row for the harness's hook itself, against plain DDP
OVERHEAD_COLUMNS = [
    "detector", "interval", "overhead_pct", "floor_pct", "overhead_vs_ddp_pct",
    "overhead_low_pct", "overhead_high_pct",
]  # fmt: skip
# The contract's (docs/design.md, section 4); older tables lack the others.
OVERHEAD_REQUIRED = OVERHEAD_COLUMNS[:4]
