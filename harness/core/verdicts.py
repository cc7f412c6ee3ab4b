"""The checks' verdicts while they are still on the device: a check defers its flag and the few
numbers that explain it, and the trainer reads every pending verdict of a step in one
device-to-host transfer (docs/design.md, section 6: at most one per step), counting each read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Pending:
    """A check's verdict while it is still on the device: `flag` (a 0-d bool tensor) says
    whether it alarms; `explain(values)` runs only if it does, with `detail` (a few numbers, read
    in the same pass) as floats, and raises the alerts. `stops` is "pre" or "post" (on the
    received sum alone) for a check in act mode, None for one that cannot stop the step."""

    flag: torch.Tensor
    explain: Callable[[list[float]], None]
    detail: torch.Tensor | None
    stops: str | None
    at: float  # when the check ran: the time its alerts carry


@dataclass
class Verdicts:
    """The verdicts of one rank's checks that have not been read yet, and the count of every
    device-to-host read they cost (docs/design.md, section 6: at most one per step)."""

    pending: list[Pending] = field(default_factory=list)
    reads: int = 0
    # While a pending verdict is explained: the time its events carry.
    clock: float | None = None

    def read(self, tensor: torch.Tensor) -> Any:
        """The tensor's values on the host: the one way a check reads, so that it is counted."""
        self.reads += 1
        return tensor.tolist()

    def stop_flags(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Whether a pending act-mode verdict alarms on evidence before the collective, and
        whether one alarms on the received sum: two 0-d bool tensors, unread (None: none
        pending)."""
        stopping = [p for p in self.pending if p.stops is not None]
        if not stopping:
            return None
        false = torch.zeros((), dtype=torch.bool, device=stopping[0].flag.device)

        def any_of(kind: str) -> torch.Tensor:
            flags = [p.flag.reshape(()).to(torch.bool) for p in stopping if p.stops == kind]
            return torch.stack(flags).any() if flags else false

        return any_of("pre"), any_of("post")

    def resolve(self, extra: torch.Tensor | None = None) -> list[float]:
        """Read every pending verdict (and `extra`, in the same read) and explain those that
        alarm, in the order they were taken; `extra`'s values."""
        pending, self.pending = self.pending, []
        parts = [] if extra is None else [extra.reshape(-1).double()]
        for p in pending:
            parts.append(p.flag.reshape(1).double())
            if p.detail is not None:
                parts.append(p.detail.reshape(-1).double())
        if not parts:
            return []
        values = self.read(torch.cat([t.to(parts[0].device) for t in parts]))
        at = 0 if extra is None else extra.numel()
        head = values[:at]
        for p in pending:
            fired = values[at]
            n = 0 if p.detail is None else p.detail.numel()
            detail = values[at + 1 : at + 1 + n]
            at += 1 + n
            if fired:
                self.clock = p.at
                try:
                    p.explain(detail)
                finally:
                    self.clock = None
        return head
