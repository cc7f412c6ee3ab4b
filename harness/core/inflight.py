"""Tensors a collective may still hold: kept referenced from Python until the backend lets go.

A collective's backend thread (gloo's workers, NCCL's watchdog) keeps its work, and the tensors
in it, a little after the caller's wait returns: on a 2-core machine with 4 gloo ranks, a
quarter of synchronous all-gathers were still held when the call returned. If Python dropped a
tensor meanwhile, that thread drops the last reference and must take the GIL to free the
tensor's Python object. At the end of a job that is fatal: a thread that wants the GIL while
the interpreter finalises is ended with pthread_exit, which unwinds through C++ frames that
cannot unwind ("terminate called without an active exception", SIGABRT); and while the main
thread holds the GIL joining the group's workers (a DDP freed after destroy_process_group), it
deadlocks. So every tensor the harness hands to a collective is `hold`-ed, and is freed on the
main thread once the backend has let go of it (its use count is back to Python's one reference):
at the next `hold`, or by `drain` before a job ends. Tensors that other code hands to a
collective and drops (FSDP's own, DTensor's, the loop's) cannot be held from here: `quiesce`,
which the guard runs when it closes and at exit (before the interpreter finalises), sleeps a
moment with the GIL released so that a backend thread that waits to free one can.

The join itself is the last hazard. A group freed from Python is destroyed with the GIL
released (torch binds it so), but DDP's C++ reducer frees it with the GIL held: a loop that
calls destroy_process_group and then leaves the function holding its DDP module (a return, or
`sys.exit` unwinding it) destroys the group there, joining a gloo worker that still waits for
the GIL to free the last collective's tensors. It hung 3 runs in 90 of the guarded example on
a loaded 2-core machine. So the guard `keep`s its module's group referenced from Python, and
`at_exit` lets go of it there, after `quiesce`: never the reducer's to destroy.

`gather_objects` is `all_gather_object` over held tensors.
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

_held: list[torch.Tensor] = []
_kept: list[dist.ProcessGroup] = []
_lock = threading.Lock()


def _settled(t: torch.Tensor) -> bool:
    return t._use_count() <= 1


def hold(*tensors: torch.Tensor) -> None:
    """Keep `tensors` (just handed to a collective) until the backend lets go of them; free those
    it has let go of since."""
    with _lock:
        _held[:] = [t for t in _held if not _settled(t)]
        _held.extend(tensors)


def drain(timeout_s: float = 10.0) -> bool:
    """Wait, without the GIL, until the backend has let go of every held tensor, and free them
    here; whether it did within `timeout_s` (those it still holds then stay held)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _lock:
            _held[:] = [t for t in _held if not _settled(t)]
            if not _held or time.monotonic() > deadline:
                return not _held
        time.sleep(0.001)


def quiesce(seconds: float = 0.1) -> None:
    """`drain`, then sleep with the GIL released: a backend thread that still holds a tensor
    that other code handed it and dropped (FSDP's, DTensor's, the loop's own) frees it now,
    while it can take the GIL. Registered to run at exit, before the interpreter finalises."""
    drain(timeout_s=2.0)
    time.sleep(seconds)


def keep(group: dist.ProcessGroup) -> None:
    """Keep `group` referenced from Python until `at_exit`, so that no C++ owner (DDP's reducer)
    holds the last reference and destroys it with the GIL held."""
    with _lock:
        if not any(g is group for g in _kept):
            _kept.append(group)


def at_exit() -> None:
    """`quiesce`, then let go of the groups `keep` held: one that is freed here is destroyed
    with the GIL released, so a backend thread that still frees a tensor can take it."""
    quiesce()
    with _lock:
        kept = _kept[:]
        _kept.clear()
    del kept


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order; every rank of `group` calls it."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    device = wire_device(group)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    hold(size, *sizes)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload.to(device)
    table = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(table, padded, group=group)
    hold(padded, *table)
    return [
        pickle.loads(row[: int(n.item())].cpu().numpy().tobytes())
        for row, n in zip(table, sizes, strict=True)
    ]


def wire_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """NCCL moves device memory only; gloo host memory."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
