"""An example's ranks as torchrun starts them, forked from one parent that imported the example
(and with it torch, Lightning or transformers) once: four ranks that each import those libraries
cost a 2-core machine about 20 s of CPU before the first step.

    python tests/loops/forked_ranks.py NPROC SCRIPT [ARGS...]

Each rank gets the environment torchrun's agent gives its workers (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT on loopback, TORCHELASTIC_RUN_ID, one thread) and
runs the script's `main()` with ARGS; its exit code is what main returns or exits with. The
parent waits for every rank, whatever the others did (torchrun's agent stops the rest once one
fails), and prints their exit codes as one JSON list, in rank order: a signal is its negative.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import socket
import sys
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(script: dict, rank: int, nproc: int, port: int, args: list[str]) -> int:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
        WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="forked", OMP_NUM_THREADS="1",
    )  # fmt: skip
    sys.argv = [script["__file__"], *args]
    try:
        code = script["main"]()
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        return 1
    return code if isinstance(code, int) else int(code is not None)


def warm_lazy_models(args: list[str]) -> None:
    """The transformers models train_guarded.py imports only when `--model` names one (its `hf`
    extra): imported here once, not by every rank (about 4 s of CPU each on a 2-core machine)."""
    model = args[args.index("--model") + 1] if "--model" in args[:-1] else None
    if model in ("gpt2", "llama"):
        import transformers

        _ = transformers.GPT2LMHeadModel if model == "gpt2" else transformers.LlamaForCausalLM


def main() -> None:
    nproc, path, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    script = runpy.run_path(path, run_name="forked_example")
    warm_lazy_models(args)
    port = free_port()
    children = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            code = rank_main(script, rank, nproc, port, args)
            # The rank ends as a process does, its atexit handlers (the guard's) run and its
            # output flushed; the interpreter's teardown of torch skipped, as the harness's own
            # ranks skip it (harness/launch/world.py): 3 to 12 s a run, on a 2-core machine.
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children.append(pid)
    codes = []
    for pid in children:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    print(json.dumps(codes))


if __name__ == "__main__":
    main()
