"""Python stacks of a world's ranks on request, so that a hang explains itself.

A rank registers faulthandler on SIGUSR1, writing to its own file in the world's folder, as it
starts. The rank server that ranks fork from (harness/launch/rank_server.py) registers as soon as it
imports this module, before torch, so even a server stuck in its imports can show where. When
the parent judges a rank hung it signals it, reads the dump, puts the innermost frames of the
rank's main thread in the crash cause and the whole dump in the run's crashes.log.
This module imports only the standard library.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

# The folder that a starting rank server writes its stack file to; set only while it starts.
FOLDER_ENV = "SDC_BENCH_STACKS"
SIGNAL = signal.SIGUSR1
_MAIN = "main thread "
_FRAME = re.compile(r'^\s+File "(?P<path>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(?:Current thread|Thread) (?P<id>0x[0-9a-fA-F]+)")

_PROJECT = Path(__file__).resolve().parents[2]
_registered: IO[str] | None = None  # kept open for faulthandler for the life of the rank


def stack_file(folder: Path, pid: int) -> Path:
    return folder / f"stack-{pid}.txt"


def reached(folder: Path, pid: int) -> bool:
    """Whether the rank with this pid got as far as registering its stack dump."""
    return stack_file(folder, pid).exists()


def register(folder: Path) -> None:
    """Dump every thread's stack to this process's file in `folder` on SIGUSR1, replacing any
    registration inherited from the process it was forked from.

    The file gets its final name only once the handler is in place, so a parent that sees the
    file can signal the process without killing it (SIGUSR1's default action)."""
    global _registered
    final = stack_file(folder, os.getpid())
    partial = final.with_suffix(".partial")
    _registered = open(partial, "w")  # noqa: SIM115 - open for the life of the process
    faulthandler.register(SIGNAL, file=_registered, all_threads=True)
    _registered.write(f"{_MAIN}0x{threading.get_ident():x}\n")
    _registered.flush()
    partial.rename(final)


def register_from_env() -> None:
    """In the rank server as it starts (harness/launch/rank_server.py): register in the folder that
    FOLDER_ENV names, before its imports, once."""
    folder = os.environ.get(FOLDER_ENV)
    if folder and _registered is None:
        register(Path(folder))


@contextlib.contextmanager
def written_by_ranks_into(folder: Path) -> Iterator[None]:
    """A rank server started inside this block registers its stack file in `folder`."""
    before = os.environ.get(FOLDER_ENV)
    os.environ[FOLDER_ENV] = str(folder)
    try:
        yield
    finally:
        if before is None:
            del os.environ[FOLDER_ENV]
        else:
            os.environ[FOLDER_ENV] = before


def collect(folder: Path, pids: dict[int, int], wait_s: float = 2.0) -> dict[int, str]:
    """Ask each rank (rank -> pid) for its stack; return rank -> dump for those that answered.

    A rank without a stack file has not reached the harness (interpreter start or imports) and
    is not signalled. A dump is complete once its file stops growing."""
    files = {r: stack_file(folder, pid) for r, pid in pids.items()}
    offsets = {r: f.stat().st_size for r, f in files.items() if f.exists()}
    for rank in list(offsets):
        try:
            os.kill(pids[rank], SIGNAL)
        except ProcessLookupError:
            del offsets[rank]
    sizes: dict[int, int] = {}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = {r: files[r].stat().st_size for r in offsets}
        if all(now[r] > offsets[r] and now[r] == sizes.get(r) for r in offsets):
            break
        sizes = now
    dumps = {}
    for rank, offset in offsets.items():
        data = files[rank].read_bytes()
        if len(data) > offset:
            header = data.split(b"\n", 1)[0]
            dumps[rank] = (header + b"\n" + data[offset:]).decode(errors="replace")
    return dumps


def innermost(dump: str, frames: int = 3) -> str:
    """The innermost frames of the main thread, 'file.py:LINE function <- ...', and the
    innermost frame of this project's own code when those are all in libraries."""
    lines = dump.splitlines()
    main = int(lines[0].removeprefix(_MAIN), 16) if lines and lines[0].startswith(_MAIN) else None
    stack: list[re.Match] = []
    in_main = False
    for line in lines[1:]:
        thread = _THREAD.match(line)
        if thread:
            if stack:
                break
            in_main = main is None or int(thread["id"], 16) == main
        elif in_main and (frame := _FRAME.match(line)):
            stack.append(frame)
    shown = [_short(f) for f in stack[:frames]]
    ours = next((f for f in stack if _ours(Path(f["path"]))), None)
    if ours is not None and ours not in stack[:frames]:
        shown.append(f"... {_short(ours)}")
    return " <- ".join(shown)


def _ours(path: Path) -> bool:
    return path.is_relative_to(_PROJECT) and "site-packages" not in path.parts


def _short(frame: re.Match) -> str:
    return f"{Path(frame['path']).name}:{frame['line']} {frame['func']}"


def append_log(path: Path, message: str, dumps: dict[int, str] | None = None) -> None:
    """Append a line, and the full stack dumps behind it, to the run's crashes.log."""
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    text = f"{stamp} {message}\n"
    for rank, dump in sorted((dumps or {}).items()):
        text += f"--- rank {rank}: Python stacks, most recent call first ---\n{dump.rstrip()}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


register_from_env()
