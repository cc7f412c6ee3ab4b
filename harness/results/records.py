"""The campaign's tables on disk, written so that an interrupted campaign loses nothing.

A trial's events are appended first and its row last, each as whole lines, flushed and fsynced:
a row in trials.csv means the trial is complete. On resume a torn last line is dropped, and the
events of trials that have no row are discarded, so nothing is counted twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.core.events import Event, to_record
from harness.errors import ConfigError
from harness.results.folder import RunFolder
from harness.results.schema import Golden, read_goldens
from harness.results.trial_row import (
    Column,
    TrialRow,
    TrialRowError,
    header_line,
    read_trials,
    row_line,
)


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


DAMAGED = "a damaged record; restore the file, or choose a new out"


def _damaged(path: Path, n: int) -> ConfigError:
    return ConfigError("out", f"{path}, line {n}: not a whole JSON record: {DAMAGED}")


def _record(path: Path, n: int, line: str) -> dict:
    """Line `n` of a JSON-lines file as its record; a damaged one is refused."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        raise _damaged(path, n) from None
    if not isinstance(record, dict):
        raise _damaged(path, n)
    return record


def _event_trial(path: Path, n: int, line: str) -> str:
    """The trial an event names, as a row does."""
    trial = _record(path, n, line).get(Column.trial_id)
    if trial is None:
        raise _damaged(path, n)
    return trial


class Records:
    """trials.csv, events.jsonl and golden.jsonl of one campaign folder."""

    def __init__(self, out: Path):
        folder = RunFolder(out)
        self.trials, self.events, self.golden_file = folder.trials, folder.events, folder.goldens

    def resume(self) -> set[str]:
        """Make the files consistent after an interruption; return the finished trial ids.
        A line damaged before the last (not cut by an interruption, which only tears the
        last) is refused, naming its file and line: a row read as a finished trial would
        never run again."""
        done: set[str] = set()
        if self.trials.exists():
            _drop_torn_tail(self.trials)
        if self.trials.exists() and self.trials.stat().st_size:  # a torn header: no row yet
            try:
                _, rows = read_trials(self.trials)
            except TrialRowError as exc:
                raise ConfigError("out", f"{exc}: {DAMAGED}") from None
            done = {row.trial_id for row in rows}
        if self.events.exists():
            _drop_torn_tail(self.events)
            lines = self.events.read_text(encoding="utf-8").splitlines(keepends=True)
            kept = [line for n, line in enumerate(lines, 1)
                    if _event_trial(self.events, n, line) in done]  # fmt: skip
            tmp = self.events.with_name(".events.jsonl.tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.events)
        if self.golden_file.exists():
            _drop_torn_tail(self.golden_file)
            lines = self.golden_file.read_text(encoding="utf-8").splitlines()
            for n, line in enumerate(lines, 1):
                try:
                    Golden(**_record(self.golden_file, n, line))
                except TypeError:
                    raise _damaged(self.golden_file, n) from None
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
