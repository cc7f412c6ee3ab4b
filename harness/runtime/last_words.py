"""What a rank recorded before a fault took it down (injectors/crash.py): a rank that raised,
exited, hung or was killed returns no events, so it keeps its strikes in the trial's folder of
the store first (harness/runtime/trainer.py), and the row of the crashed trial reads them there
(harness/campaign/run.py) to state that the fault struck: a record states what ran."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.core.events import Event, from_record, to_record

SUFFIX = ".last_words.jsonl"


def path(store: Path, trial_id: str, rank: int) -> Path:
    return store / trial_id / f"rank{rank}{SUFFIX}"


def keep(to: Path, events: list[Event]) -> None:
    """Write `events` whole and fsynced before the rank goes: a kill comes next."""
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = to.with_name(f".{to.name}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(to_record(e)) + "\n" for e in events)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(to)


def read(folder: Path) -> list[Event]:
    """Every rank's kept events in a trial's folder, by rank."""
    kept = sorted(folder.glob(f"rank*{SUFFIX}"), key=lambda p: int(p.name[4 : -len(SUFFIX)]))
    return [from_record(json.loads(line)) for p in kept for line in p.read_text().splitlines()]


def forget(folder: Path) -> None:
    """Drop what an interrupted run of the trial kept, before it runs again."""
    for kept in folder.glob(f"rank*{SUFFIX}"):
        kept.unlink(missing_ok=True)
