"""The campaign's tables on disk, written so that an interrupted campaign loses nothing.

A trial's events are appended first and its row last, each as whole lines, flushed and fsynced:
a row in trials.csv means the trial is complete. On resume a torn last line is dropped, and the
events of trials that have no row are discarded, so nothing is counted twice.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from harness.core.events import Event, to_record
from harness.results.folder import RunFolder
from harness.results.schema import Golden, read_goldens
from harness.results.trial_row import Column, TrialRow, header_line, row_line


def _append_lines(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _drop_torn_tail(path: Path) -> None:
    """A line without its newline was cut mid-write: truncate it away."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


class Records:
    """trials.csv, events.jsonl and golden.jsonl of one campaign folder."""

    def __init__(self, out: Path):
        folder = RunFolder(out)
        self.trials, self.events, self.golden_file = folder.trials, folder.events, folder.goldens

    def resume(self) -> set[str]:
        """Make the files consistent after an interruption; return the finished trial ids."""
        done: set[str] = set()
        if self.trials.exists():
            _drop_torn_tail(self.trials)
            with open(self.trials, newline="", encoding="utf-8") as f:
                done = {row[Column.trial_id] for row in csv.DictReader(f)}
        if self.events.exists():
            _drop_torn_tail(self.events)
            kept = [
                line
                for line in self.events.read_text(encoding="utf-8").splitlines(keepends=True)
                if json.loads(line)[Column.trial_id]
                in done  # an event names its trial as a row does
            ]
            tmp = self.events.with_name(".events.jsonl.tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.events)
        if self.golden_file.exists():
            _drop_torn_tail(self.golden_file)
        return done

    def goldens(self) -> dict[int, Golden]:
        return {g.seed: g for g in read_goldens(self.golden_file)}

    def add_golden(self, golden: Golden) -> None:
        _append_lines(self.golden_file, json.dumps(golden.__dict__) + "\n")

    def add_trial(self, row: TrialRow, events: list[Event]) -> None:
        if events:
            lines = "".join(json.dumps(to_record(e)) + "\n" for e in events)
            _append_lines(self.events, lines)
        fresh = not self.trials.exists() or self.trials.stat().st_size == 0
        _append_lines(self.trials, (header_line() if fresh else "") + row_line(row))
