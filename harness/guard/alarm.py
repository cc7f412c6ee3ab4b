"""What an alarm in act mode tells the loop and the scheduler: the exception every rank raises,
its exit code, and quarantine.json beside the checkpoints."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.campaign.recovery import attributes
from harness.core.events import Alert
from harness.runtime import checkpoint

EXIT_SUSPECT_HARDWARE = 86
EXIT_UNATTRIBUTED = 87
MEANING = {
    EXIT_SUSPECT_HARDWARE: "suspect hardware: restart without the suspect machines",
    EXIT_UNATTRIBUTED: "could not attribute: restart from the restore point, on any machines",
}
QUARANTINE = "quarantine.json"
# Where the checkpoints of a suspect interval go, beside them.
SUSPECT = "suspect"


def first_check(found: list[Alert]) -> list[Alert]:
    """The alerts an alarm reports, of `found` (in the order they were raised): those of the
    first check at its step, the first whose alerts attribute where one alarmed at that step
    (megatron_hash looks at the steps weight_consensus does, and was first to alert there,
    its reports hiding the majority's culprit)."""
    step = found[0].step
    first = next((a for a in found if a.step == step and attributes(a.detector)), found[0])
    return [a for a in found if (a.step, a.detector) == (first.step, first.detector)]


class SDCAlarm(RuntimeError):
    """A check in act mode found silent data corruption; every rank raises it together."""

    def __init__(
        self,
        alerts: list[Alert],
        machines: list[str],
        first_suspect: int,
        sharded: bool = False,
        earlier: tuple[tuple[int, str], ...] = (),
    ):
        """`sharded`: an FSDP2 or HSDP job's; `earlier`: the (step, phase) of the incidents
        recorded before this one (quarantine.json's)."""
        first = alerts[0]
        self.alerts = alerts
        self.machines = machines
        self.sharded, self.earlier = sharded, earlier
        self.detector = first.detector
        self.step = first.step
        self.phase = first.phase
        # One check's alerts at one step, from every rank: a wrong reduction alarms everyone.
        # Those of a check whose alerts attribute nothing (megatron_hash's) name no suspect.
        named = [a for a in alerts if attributes(a.detector)]
        self.suspect_ranks = sorted({r for a in named for r in a.suspect_ranks})
        self.suspect_nodes = sorted({n for a in named for n in a.suspect_nodes})
        self.suspect_machines = sorted({machines[r] for r in self.suspect_ranks})
        self.first_suspect_step = first_suspect
        self.evidence = first.evidence
        attributed = 0 < len(self.suspect_machines) < len(set(machines))
        # A sharded reduction's wrong sum, seen after it by the receivers of one shard in
        # several replica groups: their machines are no culprit the sum can be laid on, and a
        # sharded job keeps no contributions to re-run it from. Not named the first time at its
        # step, as a campaign's recovery rolls it back without quarantine
        # (harness/campaign/recovery.py); struck there again after the restart, they are.
        received_sum = sharded and self.phase == "post_allreduce" and len(self.suspect_machines) > 1
        if received_sum and (self.step, self.phase) not in earlier:
            attributed = False
        self.exit_code = EXIT_SUSPECT_HARDWARE if attributed else EXIT_UNATTRIBUTED
        super().__init__(
            f"{self.detector} at step {self.step}: suspect ranks {self.suspect_ranks} "
            f"(nodes {self.suspect_nodes}, machines {self.suspect_machines}); "
            f"{MEANING[self.exit_code]}"
        )

    def again(self) -> SDCAlarm:
        """The same alarm as a fresh exception. The guard keeps one it never raises: a raised
        one carries the loop's frames in its traceback, and kept by the guard those would keep
        the loop's model and process group alive past its end."""
        return SDCAlarm(
            self.alerts, self.machines, self.first_suspect_step, self.sharded, self.earlier
        )

    def record(self) -> dict[str, Any]:
        """What quarantine.json holds."""
        return {
            "detector": self.detector, "step": self.step, "phase": self.phase,
            "first_suspect_step": self.first_suspect_step, "suspect_ranks": self.suspect_ranks,
            "suspect_nodes": self.suspect_nodes, "suspect_machines": self.suspect_machines,
            "evidence": self.evidence, "exit_code": self.exit_code,
            "meaning": MEANING[self.exit_code],
        }  # fmt: skip


def quarantine(folder: Path, alarm: SDCAlarm, written: list[tuple[int, Path]]) -> None:
    """quarantine.json for the scheduler, and the suspect interval's checkpoints set aside: the
    guard's own in `folder`, and those a trainer wrote elsewhere (`written`: step, path), each
    moved into `SUSPECT` beside it with its checksum, under its own name (`NAME.2`, `.3`, ...
    where an earlier incident's is there: a job restarted from the restore point can alarm on
    a checkpoint of the same step again). Moved, not renamed in place: a trainer's rotation
    matches its checkpoints by their names' prefix (the HF Trainer's `checkpoint-*`) and would
    count a renamed one among them, and delete it or keep it in place of one the checks vouch
    for."""
    folder.mkdir(parents=True, exist_ok=True)
    earlier = _incidents(folder)
    # Each file once: a trainer saves some under one name again and again (Lightning's
    # last.ckpt), and a second move of it failed, leaving every later one in place. A link to
    # one is not it: the file itself is moved.
    files: dict[Path, Path] = {}
    for step, path in [*checkpoint.saved(folder), *written]:
        if step >= alarm.first_suspect_step and path.exists():
            if path.is_symlink() and path.resolve() in files:
                continue
            files[path.resolve()] = path.resolve() if path.is_symlink() else path
    suspects = list(files.values())
    # Each as it was written: a file of the same name the restarted job writes later is
    # another. Its size and the modification time its file system gave it, not the clock's (a
    # mount's server keeps its own), by its place in `folder` (the job may run elsewhere).
    found = {_place(folder, path): _identity(path) for path in suspects}
    set_aside, moved = [], []
    # The links a trainer keeps to one of them (Lightning's last.ckpt with save_last="link"),
    # which the move would leave pointing at nothing: each goes beside its file, to it.
    links = _links_to(suspects)
    try:
        for path in suspects:
            aside = path.parent / SUSPECT
            aside.mkdir(exist_ok=True)
            into = _free(aside / path.name)
            digest = path.with_name(path.name + ".sha256")
            path.rename(into)
            if digest.exists():
                digest.rename(into.with_name(into.name + ".sha256"))
            placed = [(path.name, into)]
            for link in links[path]:
                beside = _free(aside / link.name)
                beside.symlink_to(into.name)
                link.unlink()
                placed.append((link.name, beside))
            for name, at in placed:
                set_aside.append(name)
                moved.append(str(at.relative_to(folder) if at.is_relative_to(folder) else at))
    finally:
        # Written whatever the moves did (a folder that cannot be renamed on an object store's
        # mount): set_aside, the checkpoints' names; moved_to, where each went (from this
        # folder where it lies within it); suspects, every checkpoint of the suspect interval
        # with its modification time, so that restore_point passes over one left in place;
        # earlier, the incidents before this one.
        record = dict(alarm.record(), set_aside=set_aside, moved_to=moved, suspects=found,
                      earlier=earlier)  # fmt: skip
        tmp = folder / f".{QUARANTINE}.tmp"
        tmp.write_text(json.dumps(record, indent=1, default=str))
        os.replace(tmp, folder / QUARANTINE)


def _links_to(paths: list[Path]) -> dict[Path, list[Path]]:
    """Each of `paths` with the links beside it, in its folder, that lead to it (each folder
    listed once)."""
    found: dict[Path, list[Path]] = {path: [] for path in paths}
    by_target = {path.resolve(): path for path in paths}
    for folder in {path.parent for path in paths}:
        for entry in folder.iterdir():
            if entry.is_symlink() and entry.resolve() in by_target:
                found[by_target[entry.resolve()]].append(entry)
    return found


def earlier_incidents(folder: Path | None) -> tuple[tuple[int, str], ...]:
    """The (step, phase) of each incident quarantine.json in `folder` records."""
    if folder is None:
        return ()
    return tuple((i.get("step"), i.get("phase")) for i in _incidents(folder) if isinstance(i, dict))


def _incidents(folder: Path) -> list[dict[str, Any]]:
    """The incidents quarantine.json in `folder` records, newest first; none where it is
    missing or unreadable."""
    try:
        last = json.loads((folder / QUARANTINE).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(last, dict):
        return []
    return [{k: v for k, v in last.items() if k != "earlier"}, *last.get("earlier", [])]


def suspected(folder: Path) -> Callable[[int, Path], bool]:
    """Whether a checkpoint (step, path) in `folder` is one an incident there suspected and left
    in place: the same file, unchanged since (a job restarted from the restore point writes
    those steps again, vouched for)."""
    found: dict[str, list[list[int]]] = {}
    for incident in _incidents(folder):  # every incident's: each named the file it saw
        for place, identity in (incident.get("suspects") or {}).items():
            found.setdefault(place, []).append(identity)

    def suspect(step: int, path: Path) -> bool:
        return _identity(path) in found.get(_place(folder, path), [])

    return suspect


def _place(folder: Path, path: Path) -> str:
    """Where a checkpoint lies: from `folder` when within it, else its whole path."""
    whole, base = path.resolve(), folder.resolve()
    return str(whole.relative_to(base) if whole.is_relative_to(base) else whole)


def _identity(path: Path) -> list[int]:
    """The file as written: its size and modification time (a list: as JSON reads it back)."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _free(path: Path) -> Path:
    """`path`, or the first of `path.2`, `path.3`, ... that nothing holds yet (nor its
    checksum)."""
    found, n = path, 1
    while found.exists() or found.with_name(found.name + ".sha256").exists():
        n += 1
        found = path.with_name(f"{path.name}.{n}")
    return found
