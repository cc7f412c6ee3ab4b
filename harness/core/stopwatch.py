"""Where a step's time goes: seconds charged to named parts (each check, the guard's own hook),
each part exclusive of the parts it calls (a check run inside the hook is the check's time, not
the hook's), from any thread (a gloo callback runs a check off the main thread).

On the CPU a mark is a `time.perf_counter()` reading. On an accelerator it is a timing event
recorded on the current stream, so a part is charged the device time of the work it queued,
and nothing waits inside the step: events are read when `read` is asked, or folded once done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

Mark = float | torch.Event
# The part the harness's own work at the sites is charged to: the guard's comm hook or shard
# sites around the checks, and its stop point.
HOOK = "hook"


class Stopwatch:
    def __init__(self, device: torch.device):
        self.device = device
        self._timed_by_events = device.type != "cpu"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._spans: list[tuple[str, Mark, Mark]] = []  # events not yet read
        self._totals: dict[str, float] = {}
        self._closed: tuple[dict[str, float], list[tuple[str, Mark, Mark]]] = ({}, [])

    def mark(self) -> Mark:
        if not self._timed_by_events:
            return time.perf_counter()
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    @contextmanager
    def charged(self, part: str) -> Iterator[None]:
        """The time inside, less that of parts charged within it, goes to `part`."""
        stack = self._stack()
        start = self.mark()
        if stack:
            outer, since = stack[-1]
            self.add(outer, since, start)
        entry = [part, start]
        stack.append(entry)
        try:
            yield
        finally:
            end = self.mark()
            stack.remove(entry)  # the innermost but where an exception left a frame open
            self.add(part, entry[1], end)
            if stack:
                stack[-1][1] = end

    def add(self, part: str, start: Mark, end: Mark) -> None:
        """Charge `part` the time from mark `start` to mark `end`."""
        with self._lock:
            if self._timed_by_events:
                self._spans.append((part, start, end))
            else:
                self._totals[part] = self._totals.get(part, 0.0) + (end - start)

    def fold(self) -> None:
        """Read the events that are done (no waiting): keeps memory flat over a long run."""
        with self._lock:
            pending = []
            for part, start, end in self._spans:
                if end.query():
                    seconds = start.elapsed_time(end) / 1000
                    self._totals[part] = self._totals.get(part, 0.0) + seconds
                else:
                    pending.append((part, start, end))
            self._spans = pending

    def close_step(self) -> None:
        """What is charged so far, kept as a whole step's end: `read(whole_steps=True)` leaves
        out a step cut short after it (an alarm raised in it)."""
        with self._lock:
            self._closed = (dict(self._totals), list(self._spans))

    def read(self, whole_steps: bool = False) -> dict[str, float]:
        """Seconds charged to each part since the last `reset`, or up to the last
        `close_step` (waits for events recorded)."""
        if whole_steps:
            totals, spans = self._closed
            found = dict(totals)
            for part, start, end in spans:
                end.synchronize()
                found[part] = found.get(part, 0.0) + start.elapsed_time(end) / 1000
            return found
        for _, _, end in self._spans:
            end.synchronize()
        self.fold()
        with self._lock:
            return dict(self._totals)

    def reset(self) -> None:
        with self._lock:
            self._spans, self._totals, self._closed = [], {}, ({}, [])

    def _stack(self) -> list[list]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack
