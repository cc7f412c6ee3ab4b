"""Where a spawned world's ranks come from: one server process that imported torch and the
trainer once, and forks every rank of every world from there.

A rank started from a fresh interpreter imports torch again, seconds of CPU each; four of them
on a loaded 2-core machine took 18 s to start a world, and a campaign starts a fresh world after
every crash. A rank forked from the server starts in milliseconds, with torch already loaded.

torch reads its CPU kernel choice (harness.runtime.environment's pins) once, when it loads: in the
server. So the server starts inside the pinned environment, and starts again when a world asks
for another one. It imports harness.launch.stacks first, so a server stuck in its imports can show
where, like any rank (harness/launch/stacks.py).

multiprocessing's forkserver is the server; it exposes no way to stop or signal it, so `stop`
reaches its two private fields (Python 3.11-3.13 alike).
"""

from __future__ import annotations

import contextlib
import os
import signal
from multiprocessing import forkserver, get_context
from multiprocessing.context import BaseContext
from pathlib import Path

from harness.launch import stacks
from harness.runtime import environment

# The main module first, for the Pythons whose forkserver imports it (3.11-3.13.7 look for its
# path under a key their own preparation data lacks, CPython gh-126631, and every rank runs the
# main script again: for sdc-bench's, a tenth of a second of CPU a rank), then stacks, whose
# import registers the server's stack dump before torch loads. torch._dynamo last: every
# optimizer's add_param_group imports it on first use (torch._disable_dynamo), about a second of
# CPU in each rank of each world, which made up most of a small campaign's time on 2 cores.
PRELOAD = ["__main__", "harness.launch.stacks", "harness.launch.world", "torch._dynamo"]
# What to import for a package whose root module is lazy: transformers loads modeling_utils, most
# of its import time, at the first model class a rank builds.
_LOADED_BY = {"transformers": "transformers.modeling_utils"}

# Variables that may differ from the running server's without starting another: the stack
# folder, set only while a server starts, and the one pytest rewrites at every phase of every
# test, which no rank reads. Compared, it started a server (seconds of CPU) for each test of a
# suite that runs campaigns in its own process: this project's, or a user's for their detector.
_NOT_COMPARED = (stacks.FOLDER_ENV, "PYTEST_CURRENT_TEST")

_environment: dict[str, str] | None = None  # what the running server started with
_preloaded: frozenset[str] = frozenset()  # the workload packages it imported


def context(cpu_kernels: str, folder: Path, preload: tuple[str, ...] = ()) -> BaseContext:
    """A context whose processes fork from a server that runs the `cpu_kernels` pin and has
    imported `preload` too (a workload's own packages: transformers takes seconds of CPU per
    rank); a server that runs anything else, or lacks one of them, is stopped first. A server
    that imported more than a world needs serves it as it is: an imported package a world never
    uses changes none of its numbers, and a campaign or a test run that goes from a transformers
    workload back to the mlp keeps its server. A new one imports what the old one had as well,
    when its environment is the same. A new server writes its stack file in `folder`."""
    global _environment, _preloaded
    # torch._dynamo's first import in a process writes its disk cache's folder into the
    # environment (TORCHINDUCTOR_CACHE_DIR): the server's preload imports it, the parent at its
    # first optimizer, after its first world. Written here first, as torch would write it, the
    # parent's later import changes nothing; read as a changed environment, it started a
    # second server (seconds of CPU) for every process's second world. Imported here, where a
    # world starts: at the module's import, every command's start took a second longer.
    from torch._inductor.runtime import cache_dir_utils

    cache_dir_utils.cache_dir()
    with environment.pinned(cpu_kernels):
        wanted = {k: v for k, v in os.environ.items() if k not in _NOT_COMPARED}
        if wanted != _environment or not _preloaded.issuperset(preload):
            keep = _preloaded if wanted == _environment else frozenset()
            stop()
            loaded = keep.union(preload)
            modules = [_LOADED_BY.get(p, p) for p in sorted(loaded)]
            forkserver.set_forkserver_preload(PRELOAD + modules)
            with stacks.written_by_ranks_into(folder), _deaf_to_ctrl_c():
                forkserver.ensure_running()
            _environment, _preloaded = wanted, loaded
    return get_context("forkserver")


@contextlib.contextmanager
def _deaf_to_ctrl_c():
    """The server starts ignoring SIGINT, as do the ranks it forks (a disposition to ignore
    outlives exec and fork; a blocked mask does not reach it): Ctrl-C reaches the terminal's
    whole process group, and the parent, which stops the world, answers it. The server's
    imports (seconds) and each rank printed a KeyboardInterrupt traceback of their own. The
    parent blocks SIGINT meanwhile, which Linux keeps pending though ignored: a Ctrl-C while
    the server starts is answered once it has, not lost."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def pid() -> int | None:
    return forkserver._forkserver._forkserver_pid  # noqa: SLF001 - see the module docstring


def stop() -> None:
    """Kill the server, hung or not (its ranks are the worlds' to end); the next `context`
    starts a fresh one."""
    global _environment, _preloaded
    server = pid()
    if server is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGKILL)
        forkserver._forkserver._stop()  # noqa: SLF001 - closes its pipe and reaps it
    _environment, _preloaded = None, frozenset()
