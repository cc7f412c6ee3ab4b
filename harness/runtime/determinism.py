"""What bit-exact recomputation on GPUs needs (`detectors.replay.compare=exact` on cuda).

Replay compares a rank's gradient with a replica's recomputation bit for bit, and the harness
compares whole trajectories with their golden runs. On a GPU three things can change bits
between two runs of the same step:
- kernels that are nondeterministic by design (atomics): torch.use_deterministic_algorithms;
- cuBLAS's split reductions, which depend on its workspace: CUBLAS_WORKSPACE_CONFIG=:4096:8
  (or :16:8), read when cuBLAS creates a handle;
- NCCL's choice of algorithm and protocol per message size and topology, which sets the order
  in which a reduction adds: NCCL_ALGO and NCCL_PROTO fixed to one each, read when NCCL starts.
The ranks set them before either starts (`apply`, from harness.launch.world.init_rank); `settings`
is the preflight: it refuses, in one line, an environment that already fixed them otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from harness.errors import ConfigError

CUBLAS = ("CUBLAS_WORKSPACE_CONFIG", (":4096:8", ":16:8"))
# One algorithm and one protocol: a list or an exclusion ("^Tree") leaves NCCL a choice.
NCCL = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
KEY = "detectors.replay.compare"


def settings(env: Mapping[str, str], backend: str) -> dict[str, str]:
    """The variables exact replay needs, given the environment `env` the ranks inherit; a
    ConfigError naming the variable when `env` sets one to a value that cannot hold."""
    name, allowed = CUBLAS
    needed = {name: env.get(name, allowed[0])}
    if needed[name] not in allowed:
        raise ConfigError(
            KEY,
            f"'exact' on cuda needs {name} in {', '.join(allowed)}; the environment sets "
            f"'{needed[name]}' (unset it, or use compare=tolerant)",
        )
    if backend == "nccl":
        for var, default in NCCL.items():
            value = env.get(var, default)
            if not value or "," in value or value.startswith("^"):
                raise ConfigError(
                    KEY,
                    f"'exact' on cuda needs {var} fixed to one choice (say {default}); the "
                    f"environment sets '{value}'",
                )
            needed[var] = value
    return needed


def apply(backend: str) -> None:
    """Fix this rank's settings before NCCL and cuBLAS start; a RuntimeError when they cannot
    hold here (CUDA already started in this process)."""
    if torch.cuda.is_initialized():
        raise RuntimeError(f"{KEY}: 'exact' needs its settings before CUDA starts in the rank")
    for var, value in settings(os.environ, backend).items():
        os.environ[var] = value
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
