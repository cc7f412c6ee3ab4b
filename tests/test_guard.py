"""The guard in a plain, hand-written DDP loop under torchrun (tests/loops/plain_ddp.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from detectors import allreduce_sketch as sketch
from harness.guard import Guard
from tests.conftest import BIN

LOOP = Path(__file__).parent / "loops" / "plain_ddp.py"


def _loop(out: Path, *args: str) -> list[dict]:
    env = dict(os.environ, SDC_NODE_NAME="machine-a")
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=4", str(LOOP), str(out), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
def test_a_clean_loop_with_the_guard_trains_bit_identically_to_one_without(tmp_path):
    """Default-run twin: tests/test_guarded_example.py, the fp16 clean run."""
    plain = _loop(tmp_path / "plain")
    guarded = _loop(tmp_path / "guarded", "--guard", "--mode", "act")
    assert len({r["digest"] for r in plain}) == 1
    assert [r["digest"] for r in guarded] == [r["digest"] for r in plain]
    assert all(r["alarm"] is None and r["alerts"] == [] for r in guarded)


@pytest.mark.slow
def test_a_user_comm_hook_is_wrapped_not_replaced(tmp_path):
    """Default-run twin: tests/test_guarded_example.py, the fp16 clean run."""
    compressed = _loop(tmp_path / "fp16", "--fp16-hook")
    guarded = _loop(tmp_path / "fp16-guarded", "--fp16-hook", "--guard")
    assert [r["digest"] for r in guarded] == [r["digest"] for r in compressed]
    # A clean run: no check may alarm (the sketch once expected world-size times what arrived).
    assert [r["alerts"] for r in guarded] == [[]] * 4
    plain = _loop(tmp_path / "plain")
    assert compressed[0]["digest"] != plain[0]["digest"], "the fp16 hook really ran"


# Slow set; the default-run twin is tests/test_guarded_example.py's act-mode replay
# rehearsal (stops at its step, names the machine, quarantines it).
@pytest.mark.slow
def test_a_rehearsed_fault_raises_at_its_step_naming_its_rank(tmp_path):
    fault = {"site": "grad", "model": "scale", "factor": 1000.0, "ranks": [1], "steps": [5],
             "select": "largest"}  # fmt: skip
    results = _loop(tmp_path / "rehearsal", "--guard", "--mode", "act", "--inject",
                    json.dumps(fault))  # fmt: skip
    alarms = [r["alarm"] for r in results]
    assert all(a == alarms[0] for a in alarms), "every rank raises the same alarm"
    assert alarms[0]["step"] == 5 and alarms[0]["suspect_ranks"] == [1]
    assert alarms[0]["detector"] == "grad_stats" and alarms[0]["machines"] == ["machine-a"]
    wrong_receiver = {"site": "allreduce", "model": "scale", "factor": 1000.0, "scope": "rank",
                      "ranks": [2], "steps": [3]}  # fmt: skip
    results = _loop(tmp_path / "receiver", "--guard", "--mode", "act", "--inject",
                    json.dumps(wrong_receiver))  # fmt: skip
    alarm = results[0]["alarm"]
    assert alarm["detector"] == "allreduce_sketch" and alarm["step"] == 3
    assert alarm["suspect_ranks"] == [2]


@pytest.fixture
def one_rank(tmp_path):
    """A world of one gloo rank in this process: enough for the guard's refusals."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield DDP(nn.Linear(4, 2))
    dist.destroy_process_group()


def test_the_sketch_refuses_a_hook_it_cannot_verify_and_names_the_alternatives(one_rank):
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1)
    with pytest.raises(ValueError, match="cannot verify the comm hook powerSGD_hook") as error:
        Guard(one_rank, ["allreduce_sketch"], comm_hook=(state, powerSGD_hook.powerSGD_hook))
    assert str(error.value).endswith(
        "use grad_stats, matmul_checksum, megatron_hash, nan_inf, replay, spiky_loss, "
        "titan_replay, weight_consensus"
    )


def test_a_check_of_sharded_collectives_is_refused_in_a_ddp_loop(one_rank):
    with pytest.raises(ValueError, match="'gather_consensus' checks sharded training's"):
        Guard(one_rank, ["gather_consensus"])


def test_replay_in_a_guard_needs_the_users_loss_function(one_rank):
    with pytest.raises(ValueError, match="replay_fn"):
        Guard(one_rank, ["replay"])


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_the_sketch_bounds_a_compressed_reduction_from_the_wire_dtypes_rounding(wire):
    """What torch's compress hooks do to 4 ranks' buckets (cast, divide, sum with rounding at
    every addition) stays within the derived bound; in a small bucket the float32 bound alone is
    exceeded, so the wire term is needed, not a loosening."""
    world, n = 4, 8192  # a small bucket: float32 rounding alone is bounded tightly there
    gen = torch.Generator().manual_seed(0)
    buckets = [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 0, (n,), generator=gen)
               for _ in range(world)]  # fmt: skip
    total = torch.zeros(n, dtype=wire)
    for g in buckets:
        total += g.to(wire).div_(world)  # every partial sum rounds to the wire dtype
    weights = sketch.step_weights(0, 0, n)
    riders = sum(sketch.rider_of(g, weights) / world for g in buckets)
    expected, norms = float(riders[0]), float(riders[1])
    error = abs(float(sketch.project(total.float(), weights)) - expected)
    rho, alpha = sketch.sum_rounding(wire, world, per_rank=2)  # the cast and the division
    assert error <= sketch.tolerance(norms, n, 1e-6, rho, alpha)
    assert error > 4 * 1e-6 * n**0.5 * norms
