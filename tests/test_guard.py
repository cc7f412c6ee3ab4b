"""The guard in a plain, hand-written DDP loop under torchrun (tests/loops/plain_ddp.py)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import subprocess
import weakref
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import detectors
from detectors import allreduce_sketch as sketch
from harness.campaign.recovery import earliest_suspect
from harness.core import inflight
from harness.core.events import Alert
from harness.guard import Guard, SDCAlarm, selection
from harness.guard.alarm import quarantine
from harness.runtime import checkpoint
from harness.runtime.replica import unsharded_copy
from tests.conftest import BIN, compose_run, forked_ranks

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
    """Default-run twin: tests/test_guarded_example.py, the GPT-2 clean run."""
    plain = _loop(tmp_path / "plain")
    guarded = _loop(tmp_path / "guarded", "--guard", "--mode", "act")
    assert len({r["digest"] for r in plain}) == 1
    assert [r["digest"] for r in guarded] == [r["digest"] for r in plain]
    assert all(r["alarm"] is None and r["alerts"] == [] for r in guarded)


@pytest.mark.slow
def test_a_user_comm_hook_is_wrapped_not_replaced(tmp_path):
    """Default-run twin: tests/test_guarded_example.py, the GPT-2 clean run."""
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


def _forward_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture
def one_rank(tmp_path):
    """A world of one gloo rank in this process: enough for the guard's refusals."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield DDP(nn.Linear(4, 2))
    _ended()


def _ended() -> None:
    """The group destroyed once gloo's thread is done with the last collective: it drops a
    comm hook's Python callback after the collective's waiters wake, and the group's last owner
    (the DDP module, freed after the test) joins that thread while holding the GIL the thread
    waits for: a hang, one run in four, where a test ended right after a backward."""
    inflight.quiesce()
    dist.destroy_process_group()


def test_the_group_outlives_the_ddp_module_until_the_guard_lets_go_at_exit(tmp_path):
    """DDP's C++ reducer destroys the group it holds the last reference to with the GIL held,
    joining a gloo worker that may still wait for the GIL (harness/core/inflight.py): a guarded
    loop that destroyed the group and then left the function holding its model hung 3 runs in
    90. The guard keeps the group for Python to free, after the worker's last frees."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = DDP(nn.Linear(4, 2))
    group = weakref.ref(model.process_group)
    guard = Guard(model, detectors=["nan_inf"])
    model(torch.ones(3, 4)).sum().backward()
    guard.close()
    dist.destroy_process_group()
    del model, guard
    gc.collect()
    assert group() is not None, "the reducer would have destroyed it"
    inflight.at_exit()
    gc.collect()
    assert group() is None


def test_the_sketch_refuses_a_hook_it_cannot_verify_and_names_the_checks_allowed(one_rank):
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1)
    with pytest.raises(ValueError, match="cannot verify the comm hook powerSGD_hook") as error:
        Guard(one_rank, ["allreduce_sketch"], comm_hook=(state, powerSGD_hook.powerSGD_hook))
    allowed = str(error.value).split("; allowed here: ")[1].split(", ")
    assert "nan_inf" in allowed and "grad_stats" in allowed
    assert "allreduce_sketch" not in allowed, "not with this hook"
    assert "replay" not in allowed, "no replay_fn, and one node"


def test_a_check_of_sharded_collectives_is_refused_in_a_ddp_loop(one_rank):
    with pytest.raises(ValueError, match="'gather_consensus' is derived for fsdp and hsdp"):
        Guard(one_rank, ["gather_consensus"])


def test_replay_in_a_guard_needs_the_users_loss_function(one_rank):
    with pytest.raises(ValueError, match="replay_fn"):
        Guard(one_rank, ["replay"])


def test_all_runs_what_applies_and_says_why_it_left_the_rest_out(one_rank):
    """One rank of a DDP loop: no sharded collective to check, no peer to replay on or to vote
    with; every check left out says why, every one kept runs."""
    guard = Guard(one_rank, "all", replay_fn=lambda model, batch: model(batch).sum())
    assert {"nan_inf", "grad_stats", "allreduce_sketch", "matmul_checksum"} <= set(guard.checks)
    assert "derived for fsdp and hsdp" in guard.left_out["gather_consensus"]
    assert "3 nodes" in guard.left_out["replay"]
    assert "3 replicas" in guard.left_out["weight_consensus"]
    assert set(guard.checks) | set(guard.left_out) == set(detectors.available())
    without = Guard(DDP(nn.Linear(4, 2)), "all")
    assert "needs Guard(..., replay_fn=fn)" in without.left_out["titan_replay"]


@pytest.mark.parametrize("mapping", [MappingProxyType, OmegaConf.create], ids=["proxy", "hydra"])
def test_check_settings_in_any_mapping_are_the_ones_that_run(one_rank, mapping):
    """A Hydra config's DictConfig, or any mapping but a dict: its settings were validated, then
    dropped for the defaults (matmul_checksum every step), with no word; a rehearsal's list in
    one (a ListConfig) was refused as no list."""
    fault = mapping({**SCALED, "site": "grad", "steps": mapping({"at": [2]})["at"]})
    guard = Guard(one_rank, mapping({"matmul_checksum": {"interval": 7}, "nan_inf": {}}),
                  inject=fault)  # fmt: skip
    assert set(guard.checks) == {"matmul_checksum", "nan_inf"}
    assert guard.checks["matmul_checksum"].interval == 7
    guard.close()


def test_a_seed_of_any_integer_type_is_taken(one_rank):
    """A numpy integer, as a script computes a seed, seeds the rehearsal as an int does: the
    same element and bit drawn (it was refused as no integer)."""
    flip = {"site": "grad", "model": "bitflip", "bit": "mantissa", "ranks": [0], "steps": [1]}
    optimizer = torch.optim.SGD(one_rank.parameters(), lr=0.0)
    drawn = []
    for seed in (3, np.int64(3)):
        guard = Guard(one_rank, inject=flip, seed=seed)
        try:
            for step in range(2):
                _guarded_step(guard, one_rank, optimizer, step, 0)
            drawn.append([(i.tensor, i.index, i.bit) for i in guard.injections])
        finally:
            guard.close()
    assert len(drawn[0]) == 1 and drawn[0] == drawn[1], drawn


def test_a_rehearsal_that_can_never_strike_is_refused(one_rank):
    """A target the model does not have: the campaigns' own check of fault targets."""
    fault = {"site": "matmul", "model": "scale", "factor": 2.0, "ranks": [0], "steps": [1],
             "tensor": "nothing"}  # fmt: skip
    with pytest.raises(ValueError, match="^inject.tensor: 'nothing' matches nothing at site"):
        Guard(one_rank, inject=fault)


def test_a_rehearsal_on_a_float64_model_is_refused(one_rank):
    """Lightning's "64-true": a fault's bit, factor and value were bounded as float32's (bit 62
    of a float64 gradient refused: "allowed: 0..31"), where the injector strikes the tensor's
    own dtype. A rehearsal strikes the dtypes a campaign's workloads train in."""
    fault = {"site": "grad", "model": "bitflip", "bit": 62, "ranks": [0], "steps": [1]}
    double = DDP(nn.Linear(4, 2).double())
    with pytest.raises(ValueError, match="^inject: a rehearsal strikes a model in float32, "):
        Guard(double, inject=fault)


class Blocks(nn.Module):
    """Layers in a container, whose own forward never runs, then a head."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


@pytest.mark.parametrize(
    ("fault", "bf16", "error"),
    [
        (
            {"site": "matmul", "model": "bitflip", "bit": 25, "tensor": "blocks.0"},
            True,
            "^inject.bit: 25 is outside bfloat16, the dtype of the product 1 of 'blocks.0'",
        ),
        (
            {"site": "activation", "model": "value", "value": "nan", "tensor": "blocks"},
            False,
            "^inject.tensor: 'blocks' matches nothing at site activation",
        ),
        (
            {"site": "matmul", "model": "scale", "factor": 2.0, "tensor": "head", "product": 50},
            False,
            "^inject.product: 50 is never reached: 'head' makes 1 product per forward",
        ),
    ],
    ids=["bit-past-autocast", "container", "product-past"],
)
def test_a_module_rehearsal_is_checked_on_the_loops_first_forward(one_rank, fault, bf16, error):
    """What a module fault names only a forward shows: bit 25 of a bfloat16 product crashed the
    rank at its step (an int16 overflow), and a container's output or a 50th product was never
    struck, the loop training on as if the checks had missed them. The first forward raises,
    before the fault's first step; a guard with nothing watching the products removes the
    watch it traced with."""
    model = DDP(Blocks())
    hooks = _forward_hooks(model.module)
    guard = Guard(model, inject={**fault, "ranks": [0], "steps": [1]})
    try:
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
        with autocast, pytest.raises(ValueError, match=error) as refused:
            model(torch.randn(3, 4))
        assert "\n" not in str(refused.value) and guard.injections == []
    finally:
        guard.close()
    assert _forward_hooks(model.module) == hooks


SCALED = {"model": "scale", "factor": 2.0, "ranks": [0]}


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        (
            {"detectors": {"nan_inf": {"mode": "observe"}}, "mode": "act"},
            re.escape("detectors.nan_inf.mode: the guard's own, Guard(mode='act'); got 'observe'"),
        ),
        ({"ranks_per_node": 0}, "^ranks_per_node: 0 is out of range; allowed: 1..inf$"),
        ({"ranks_per_node": 3}, "^ranks_per_node: 3 does not divide the world of 1 rank"),
        (
            {"comm_hook": powerSGD_hook.powerSGD_hook},
            "^comm_hook: a \\(state, hook\\) pair as DDP's register_comm_hook takes them",
        ),
        # A rehearsal that could never strike: before a resumed loop's first step; at a module
        # site on the first step, whose forward the guard traces to check what it names.
        (
            {"inject": {**SCALED, "site": "grad", "steps": [2]}, "start_step": 10},
            "^inject.steps: 2 is before the guard's start_step 10: never reached",
        ),
        (
            {"inject": {**SCALED, "site": "matmul", "steps": [0]}},
            "^inject.steps: 0: a fault at site matmul strikes from the guard's second step on",
        ),
        (
            {"inject": {**SCALED, "site": "grad", "schedule": [
                {"step": 2, "rank": 0, "tensor": "weight", "index": 0},
                {"step": 12, "rank": 0, "tensor": "weight", "index": 0}]}, "start_step": 10},
            "^inject.schedule: 2 is before the guard's start_step 10: never reached",
        ),  # fmt: skip
        # The rider region holds zeros where no check rides on the reduction.
        (
            {"inject": {**SCALED, "site": "allreduce", "scope": "rank", "tensor": "riders",
                        "steps": [2]}},
            "^inject.tensor: riders: no check beside it rides on the reduction",
        ),  # fmt: skip
        # What a script parses from JSON: a traceback, or a message that named no key.
        ({"inject": "grad"}, "^inject: 'grad' is not a fault: a mapping of fault keys"),
        ({"detectors": {"nan_inf": 5}}, "^detectors.nan_inf: 5 is not a check's settings"),
        ({"detectors": None}, "^detectors: None names no check"),
        # A step past the loop's end, where the loop gives it: a rehearsal that never struck
        # ended the fit clean, which read as "nothing found".
        (
            {"inject": {**SCALED, "site": "grad", "steps": [10]}, "steps": 6},
            re.escape("inject.steps[0]: 10 is out of range; allowed: 0..5"),
        ),
        ({"steps": 0}, re.escape("steps: 0 is out of range; allowed: 1..inf")),
        # A restart from the last step's checkpoint: "12 is out of range; allowed: 13..inf".
        ({"steps": 12, "start_step": 12}, "^steps: 12: a loop resumed at step 12 has no step left"),
        # Raw numpy errors, or failures at step 0 or at the first save, none naming the key.
        ({"seed": "abc"}, "^seed: 'abc' is not an integer"),
        ({"seed": -5}, re.escape("seed: -5 is out of range; allowed: 0..inf")),
        ({"replay_fn": "loss_of"}, "^replay_fn: a function; got str 'loss_of'"),
        ({"checkpoints": 5}, re.escape("checkpoints: a folder's path (str or Path); got int 5")),
    ],
    ids=["mode", "no-ranks-per-node", "ranks-per-node", "bare-comm-hook", "before-start",
         "first-step-module", "schedule-before-start", "riders-unridden", "inject-not-a-mapping",
         "settings-not-a-mapping", "no-checks", "inject-past-the-end", "no-steps", "complete",
         "seed-text",
         "seed-negative", "replay-fn-text", "checkpoints-number"],
)  # fmt: skip
def test_a_setting_the_guard_would_ignore_or_trip_over_later_is_refused(one_rank, settings, error):
    """A check's own `mode` (the guard's decides), a node size that is no size or does not
    divide the world (nodes then name the wrong ranks), a comm hook without its state (it
    failed in the first backward): one line naming the key, before any hook is placed."""
    with pytest.raises(ValueError, match=error) as refused:
        Guard(one_rank, **settings)
    assert "\n" not in str(refused.value)
    assert _forward_hooks(one_rank) == 0 and not one_rank._comm_hooks


def test_a_launchers_ranks_per_node_that_is_no_number_is_refused_naming_it(one_rank, monkeypatch):
    monkeypatch.setenv("SDC_RANKS_PER_NODE", "abc")
    with pytest.raises(ValueError, match="^SDC_RANKS_PER_NODE: 'abc' is not an integer$"):
        Guard(one_rank)


def test_a_replay_step_past_the_loops_end_is_refused_where_the_loop_gives_its_length():
    """The campaigns' bound on a check's listed steps, in a job of three nodes."""
    topology = replace(compose_run().topology, nodes=3, ranks_per_node=1)
    job = selection.Job(topology, "observe", lambda model, batch: 0, None, steps=6)
    with pytest.raises(ValueError, match=re.escape("detectors.replay.steps: 10 is past the run")):
        selection.select({"replay": {"steps": [10]}}, job)
    assert selection.select({"replay": {"steps": [5]}}, job).checks["replay"].steps == (5,)
    unbounded = replace(job, steps=None)
    assert selection.select({"replay": {"steps": [10]}}, unbounded).checks["replay"].steps == (10,)


def test_a_check_that_never_looks_in_the_loops_steps_is_left_out_or_refused():
    """megatron_hash every 10 steps of a 6-step fit ran under "all" and compared nothing;
    consensus every 50 may still look before a checkpoint, and is kept (its warnings say
    whether it looked)."""
    topology = replace(compose_run().topology, nodes=3, ranks_per_node=1)
    job = selection.Job(topology, "observe", None, None, steps=6)
    chosen = selection.select("all", job)
    assert "megatron_hash" not in chosen.checks
    assert chosen.left_out["megatron_hash"].startswith("'megatron_hash' never looks in a loop "
                                                       "of steps 0..5")  # fmt: skip
    with pytest.raises(ValueError, match="'megatron_hash' never looks in a loop of steps 0..5"):
        selection.select(["megatron_hash"], job)
    assert (
        "weight_consensus" in selection.select({"weight_consensus": {"interval": 50}}, job).checks
    )
    assert "megatron_hash" in selection.select("all", replace(job, steps=None)).checks


def test_a_module_neither_ddp_nor_sharded_is_refused(one_rank):
    with pytest.raises(ValueError, match="^model: a DistributedDataParallel module or a module"):
        Guard(one_rank.module)


def test_a_second_guard_on_one_ddp_is_refused(one_rank):
    Guard(one_rank)
    with pytest.raises(ValueError, match="^model: this DDP module has a comm hook already"):
        Guard(one_rank)


def test_a_guard_left_open_on_a_module_is_closed_by_the_next_one(one_rank):
    """A fit that raised past the trainer's callbacks (an error in the user's step: the HF
    Trainer has no event for it) leaves its guard open and its watch on the module; the next
    guard on that module (a retry's fresh DDP wrapper) closes it, and the products are watched
    once, not by a guard whose verdicts nobody reads."""
    before = _forward_hooks(one_rank.module)
    first = Guard(one_rank, ["nan_inf", "matmul_checksum"])
    once = _forward_hooks(one_rank.module) - before
    second = Guard(DDP(one_rank.module), ["nan_inf", "matmul_checksum"])
    assert first.closed and not second.closed
    assert _forward_hooks(one_rank.module) - before == once


def test_a_step_that_changes_its_batch_replays_the_batch_it_was_handed(one_rank):
    """The guard keeps a copy of each micro-batch: a step that takes a key out of its batch or
    changes it in place (MLM masking, a normalisation in place) replays what it was handed
    (the kept reference crashed the replay or alarmed on a clean step)."""

    def loss_of(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch.pop("x")
        return model(x.mul_(2)).square().mean()

    optimizer = torch.optim.SGD(one_rank.parameters(), lr=0.1)
    guard = Guard(one_rank, {"titan_replay": {"num_steps": -1}}, replay_fn=loss_of)
    for step in range(2):
        batch = {"x": torch.randn(3, 4, generator=torch.Generator().manual_seed(step))}
        optimizer.zero_grad()
        guard.audit_batch(batch)
        guard.loss(loss_of(one_rank, batch)).backward()
        guard.before_step()
        optimizer.step()
        guard.after_step(optimizer)
    assert guard.alerts == [] and guard.warnings == []


def test_accumulation_that_reduces_every_micro_batch_is_refused_where_a_check_recomputes(
    one_rank,
):
    """Two micro-batches a step: reduced once (no_sync on the first) titan_replay finds the step
    clean; reduced twice, the step's gradient is no sum a recomputation knows, and a clean loop
    alarmed (exit 87): RuntimeError naming the way to reduce once."""

    def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).square().mean()

    optimizer = torch.optim.SGD(one_rank.parameters(), lr=0.1)
    guard = Guard(one_rank, {"titan_replay": {"num_steps": -1}}, replay_fn=loss_of)
    for once in (True, False):
        optimizer.zero_grad()
        for micro in range(2):
            batch = torch.randn(3, 4, generator=torch.Generator().manual_seed(micro))
            guard.audit_batch(batch)
            synced = contextlib.nullcontext() if micro == 1 or not once else one_rank.no_sync()
            with synced:
                (guard.loss(loss_of(one_rank, batch)) / 2).backward()
        if once:
            guard.before_step()
            optimizer.step()
            guard.after_step(optimizer)
            assert guard.alerts == [], guard.alerts
        else:
            with pytest.raises(RuntimeError, match="^accumulation: step 1 reduced a gradient bu"):
                guard.before_step()
    guard.close()


def test_a_ddp_module_whose_guard_closed_takes_a_new_one(one_rank):
    """DDP takes one comm hook for its life, and the HF Trainer reuses its DDP wrapper for a
    second `train()`: a new guard takes the closed one's place (it was refused: "a comm hook
    already"), and checks: a NaN gradient alerts."""
    Guard(one_rank, ["nan_inf"]).close()
    guard = Guard(one_rank, ["nan_inf"])
    one_rank(torch.full((2, 4), float("nan"))).sum().backward()
    guard.before_step()
    assert guard.alerts and {(a.detector, a.step) for a in guard.alerts} == {("nan_inf", 0)}
    guard.close()


def test_a_loop_that_skips_before_step_or_saves_mid_step_is_refused(one_rank, tmp_path):
    """after_step without before_step (replay never audited, and an act-mode alarm came after
    the update it should have stopped), and a checkpoint before a job's first step ended or
    before after_step (it was labelled the step before: step_-00001.pt held step 0's weights):
    RuntimeError naming the call to make."""
    optimizer = torch.optim.SGD(one_rank.parameters(), lr=0.1)
    guard = Guard(one_rank, ["nan_inf"], checkpoints=tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="^checkpoint: after guard.after_step"):
        guard.save({"model": one_rank.module.state_dict()})
    one_rank(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"^after_step: guard.before_step\(\) was not called"):
        guard.after_step(optimizer)
    guard.before_step()
    optimizer.step()
    with pytest.raises(RuntimeError, match="^checkpoint: after guard.after_step"):
        guard.save({"model": one_rank.module.state_dict()})
    guard.after_step(optimizer)
    assert guard.save({"model": one_rank.module.state_dict()}).name == "step_000000.pt"
    guard.close()
    # Resumed after step 4, the weights are step 4's: a trainer may save them again at once
    # (Lightning's ModelCheckpoint does, mid-accumulation, after a resume).
    resumed = Guard(one_rank, ["nan_inf"], checkpoints=tmp_path / "ckpt", start_step=5)
    assert resumed.save({"model": one_rank.module.state_dict()}).name == "step_000004.pt"
    resumed.close()


@pytest.mark.parametrize("start_step", ["3", 2.5, -2])
def test_a_start_step_that_is_no_step_is_refused(one_rank, start_step):
    with pytest.raises(ValueError, match="^start_step: "):
        Guard(one_rank, start_step=start_step)
    assert not one_rank._comm_hooks


def test_the_costs_are_refused_until_the_warmup_is_over(one_rank):
    guard = Guard(one_rank, ["nan_inf"], warmup_steps=2)
    with pytest.raises(RuntimeError, match="the first 2 steps are a warm-up"):
        guard.costs()


def test_a_rehearsal_at_the_optimizer_of_a_loop_without_moments_is_refused_at_its_first_step(
    one_rank,
):
    """Plain SGD keeps no Adam moments: the fault never struck (no event) while the loop
    trained on. The guard first sees the optimizer at after_step."""
    optimizer = torch.optim.SGD(one_rank.parameters(), lr=0.1)
    fault = {"site": "optimizer", "model": "scale", "factor": 2.0, "ranks": [0], "steps": [3]}
    guard = Guard(one_rank, ["nan_inf"], inject=fault)
    try:
        with pytest.raises(
            ValueError,
            match="^inject.site: optimizer strikes Adam's moments "
            r"\(exp_avg, exp_avg_sq\), and the loop's SGD keeps none",
        ):
            _guarded_step(guard, one_rank, optimizer, 0, 0)
    finally:
        guard.close()


def test_a_resumed_loops_permanent_module_fault_strikes_from_its_second_step(one_rank):
    """Accepted where it strikes from before start_step (it was refused), unarmed in the first
    forward, which the guard traces to check what it names, and striking in each after it;
    a fault with no site is nothing to rehearse (it raised "max() arg is an empty sequence")."""
    Guard(one_rank, inject={"site": "none"}).close()
    model = DDP(Blocks())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fault = {"site": "matmul", "model": "scale", "factor": 2.0, "ranks": [0], "steps": [3],
             "persistence": "permanent", "tensor": "head"}  # fmt: skip
    guard = Guard(model, ["nan_inf"], start_step=100, inject=fault)
    try:
        for step in (100, 101, 102):
            _guarded_step(guard, model, optimizer, step, 0)
        assert sorted({i.step for i in guard.injections}) == [101, 102]
    finally:
        guard.close()


def test_a_rehearsed_module_fault_strikes_the_training_forward_not_an_evaluation(one_rank):
    """A Trainer's evaluation runs its forwards inside a step, under no_grad: the rehearsed
    NaN struck the first of them, the training forward ran clean, and the loop ended with no
    alert (exit 0 where the same fault without evaluation alarmed). A forward that builds a
    graph is struck, the model in eval mode or not (this loop trains on in eval mode)."""
    model = DDP(Blocks())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    nan = {"site": "activation", "model": "value", "value": "nan", "ranks": [0], "steps": [1],
           "tensor": "head"}  # fmt: skip
    guard = Guard(model, ["nan_inf"], inject=nan)
    try:
        _guarded_step(guard, model, optimizer, 0, 0)
        model.eval()
        with torch.no_grad():
            assert torch.isfinite(model(torch.randn(3, 4))).all()
        _guarded_step(guard, model, optimizer, 1, 0)
        assert [i.step for i in guard.injections] == [1]
        assert [a.step for a in guard.alerts] and {a.step for a in guard.alerts} == {1}
    finally:
        guard.close()


def test_titan_replay_of_the_first_steps_does_not_run_in_a_loop_resumed_after_them(one_rank):
    """It replays the first num_steps of the run: a loop resumed at step 5 listed it among its
    checks, under "all" too, and it never looked."""
    loss_of = _square_loss
    resumed = Guard(one_rank, "all", replay_fn=loss_of, start_step=5)
    try:
        assert "titan_replay" not in resumed.checks
        assert "never looks in a loop that starts at step 5" in resumed.left_out["titan_replay"]
    finally:
        resumed.close()
    with pytest.raises(ValueError, match="'titan_replay' never looks in a loop that starts at"):
        Guard(one_rank, ["titan_replay"], replay_fn=loss_of, start_step=5)
    every = Guard(one_rank, {"titan_replay": {"num_steps": -1}}, replay_fn=loss_of, start_step=5)
    assert "titan_replay" in every.checks
    every.close()
    # Replay at listed steps all before the loop's start likewise (it needs three nodes: its
    # own rule, which the guard applies as it does titan_replay's).
    replay = detectors.detector_class("replay")
    assert not replay.looks_from(replay.Config.parse("replay", {"steps": [1, 3]}), 5)
    assert replay.looks_from(replay.Config.parse("replay", {"steps": [1, 5]}), 5)
    assert replay.looks_from(replay.Config.parse("replay", {"interval": 5}), 5)


def test_megatron_hash_needs_a_replica_to_compare_with(one_rank):
    """One replica (a one-rank world, or a user's HSDP mesh of one replica group): each rank
    compared its digests with its own, under "all" too."""
    guard = Guard(one_rank, "all")
    try:
        assert "compares replicas, and this world of 1 has 1" in guard.left_out["megatron_hash"]
    finally:
        guard.close()
    with pytest.raises(ValueError, match="megatron_hash compares replicas"):
        Guard(one_rank, ["megatron_hash"])


def test_the_costs_after_an_alarm_count_whole_steps_only(one_rank):
    """The step an alarm cuts short has no step time: its charges (the check's, the rehearsed
    NaN's injection) were counted over the steps before it, inflating each part. After the
    alarm the costs are those of the steps before it, as read before it."""
    optimizer = torch.optim.SGD(one_rank.parameters(), lr=0.1)
    nan = {"site": "grad", "model": "value", "value": "nan", "ranks": [0], "steps": [3]}
    guard = Guard(one_rank, ["nan_inf"], mode="act", warmup_steps=1, inject=nan)
    try:
        for step in range(3):
            _guarded_step(guard, one_rank, optimizer, step, 0)
        before = guard.costs()
        with pytest.raises(SDCAlarm):
            _guarded_step(guard, one_rank, optimizer, 3, 0)
        assert guard.costs() == before and before.steps == 2
    finally:
        guard.close()


def test_a_closed_guard_leaves_the_loop_as_it_was(one_rank):
    """After close() the forward hooks are gone, the reduction is DDP's own, and a NaN that
    would have alerted raises nothing: training may go on unguarded."""
    model = one_rank.module
    before = _forward_hooks(model)
    guard = Guard(one_rank, ["nan_inf", "matmul_checksum"])
    assert _forward_hooks(model) > before
    guard.close()
    assert _forward_hooks(model) == before
    one_rank(torch.full((2, 4), float("nan"))).sum().backward()
    assert guard.alerts == [] and guard.closed


class PartlyFrozen(nn.Module):
    """A fine-tuned model's shape: a frozen first layer (a backbone, LoRA's base weights) and a
    branch its forward takes only for wide inputs (DDP with find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.base, self.head, self.branch = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 2)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.base(x))
        return self.head(h) + (self.branch(h) if x.shape[0] > 8 else 0)


FROZEN_WORLD = 3


def _forked_world(tmp_path: Path, rank_main, *args: object) -> dict[int, object]:
    """Each of FROZEN_WORLD forked ranks runs `rank_main(rank, store, *args, results)` and puts
    (rank, what it found) in `results`: what each found, by rank."""
    ctx = forked_ranks(tmp_path)
    results = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=rank_main, args=(r, store, *args, results))
             for r in range(FROZEN_WORLD)]  # fmt: skip
    for proc in procs:
        proc.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    return got


def _joined(rank: int, store: str) -> None:
    """This forked rank in the FROZEN_WORLD-rank gloo world, on one thread, seeded alike."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=FROZEN_WORLD)  # fmt: skip
    torch.set_num_threads(1)
    torch.manual_seed(0)


def _square_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def _guarded_step(guard: Guard, model: nn.Module, optimizer, step: int, rank: int) -> None:
    """One step of a plain guarded loop on this rank's own batch of `step`."""
    batch = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
    optimizer.zero_grad()
    guard.audit_batch(batch)
    guard.loss(_square_loss(model, batch)).backward()
    guard.before_step()
    optimizer.step()
    guard.after_step(optimizer)


def _partly_frozen_rank(rank: int, store: str, results) -> None:
    """Three steps of PartlyFrozen under both replays, a x1000 on rank 1's largest local
    gradient at step 2: the steps each check alerted at, by check."""
    _joined(rank, store)
    model = DDP(PartlyFrozen(), find_unused_parameters=True)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    fault = {"site": "grad", "model": "scale", "factor": 1000.0, "select": "largest",
             "ranks": [1], "steps": [2]}  # fmt: skip
    checks = {"replay": {"interval": 1}, "titan_replay": {"num_steps": -1}}
    guard = Guard(model, checks, mode="observe", replay_fn=_square_loss,
                  ranks_per_node=1, inject=fault)  # fmt: skip
    _steps_reported(guard, model, optimizer, rank, 3, results, lambda g: sorted(
        (a.detector, a.step, tuple(a.suspect_ranks)) for a in g.alerts
    ))  # fmt: skip


def _steps_reported(guard: Guard, model, optimizer, rank: int, steps: int, results, found) -> None:
    """`steps` guarded steps on this forked rank, then (rank, found(guard)) in `results`, or the
    error: the guard closed and the group destroyed either way."""
    try:
        for step in range(steps):
            _guarded_step(guard, model, optimizer, step, rank)
        results.put((rank, found(guard)))
    except Exception as error:  # the test reports it, not a rank's traceback
        results.put((rank, f"{type(error).__name__}: {error}"))
    finally:
        guard.close()
        dist.destroy_process_group()


def test_the_replays_recompute_a_step_with_frozen_and_unused_parameters(tmp_path):
    """Autograd refuses to differentiate by a frozen parameter or one the step did not use; the
    replays recompute the trainable ones, an unused one's gradient zero as in DDP's bucket: on
    3 ranks, clean steps replay clean and a x1000 on rank 1's local gradient is caught by both,
    naming rank 1 (replay on its peer, titan_replay on the rank itself)."""
    got = _forked_world(tmp_path, _partly_frozen_rank)
    # replay's verdict is the world's, every rank records it; titan_replay's the rank's own.
    assert got == {
        rank: [("replay", 2, (1,))] + ([("titan_replay", 2, (1,))] if rank == 1 else [])
        for rank in range(FROZEN_WORLD)
    }, got


def _trainer_checkpoints_rank(rank: int, store: str, folder: str, results) -> None:
    """A loop whose trainer writes its own checkpoints, as Lightning's ModelCheckpoint does under
    SDCGuard (no `checkpoints` folder of the guard's): replay every 3 steps, x1000 on rank 1's
    local gradient at step 3. The alarm's step and first suspect step."""
    _joined(rank, store)
    model = DDP(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    fault = {"site": "grad", "model": "scale", "factor": 1000.0, "select": "largest",
             "ranks": [1], "steps": [3]}  # fmt: skip
    guard = Guard(model, {"replay": {"interval": 3}}, mode="act",
                  replay_fn=_square_loss, ranks_per_node=1, inject=fault)  # fmt: skip
    try:
        for step in range(5):
            _guarded_step(guard, model, optimizer, step, rank)
            if guard.before_checkpoint():
                path = Path(folder) / f"step={step}.ckpt"
                if rank == 0:
                    path.write_text("state")
                guard.checkpoint_written(path)
        results.put((rank, None))
    except SDCAlarm as alarm:
        results.put((rank, (alarm.step, alarm.first_suspect_step)))
    finally:
        guard.close()
        dist.destroy_process_group()


def test_a_trainers_own_checkpoints_of_the_suspect_interval_are_set_aside(tmp_path):
    """Without a folder of the guard's, the checkpoints the trainer wrote after the last step the
    checks vouch for are moved into suspect/ beside them, and quarantine.json is written there
    too (they were left as they were: a resume from "last" took weights the alarm had put in
    doubt)."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    got = _forked_world(tmp_path, _trainer_checkpoints_rank, str(folder))
    # Replay vouched for the weights step 0 began with and what it computed from them, not for
    # step 0's update; the fault's step 3 is where it looked next.
    assert got == {rank: (3, 0) for rank in range(FROZEN_WORLD)}, got
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["quarantine.json", "suspect"], names
    aside = ["step=0.ckpt", "step=1.ckpt", "step=2.ckpt"]
    assert sorted(p.name for p in (folder / "suspect").iterdir()) == aside
    record = json.loads((folder / "quarantine.json").read_text())
    assert record["set_aside"] == aside
    assert record["first_suspect_step"] == 0 and record["suspect_ranks"] == [1]


def _checkpointing_rank(rank: int, store: str, start: int, results) -> None:
    """Consensus every 4 steps, and replay at two listed steps (one in the warm-up), in a loop
    from step `start` that checkpoints every 2: the costs' interval and looks."""
    _joined(rank, store)
    model = DDP(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checks = {"nan_inf": {}, "weight_consensus": {"interval": 4},
              "replay": {"steps": [start + 1, start + 5]}}  # fmt: skip
    guard = Guard(model, checks, ranks_per_node=1, start_step=start, replay_fn=_square_loss)
    try:
        for step in range(start, start + 8):
            _guarded_step(guard, model, optimizer, step, rank)
            if step % 2 == 1:
                assert guard.before_checkpoint()
        checks = guard.costs().checks
        results.put((rank, {name: (cost.interval, cost.looks) for name, cost in checks.items()}))
    finally:
        guard.close()
        dist.destroy_process_group()


@pytest.mark.parametrize("start", [0, 100])
def test_the_costs_state_the_interval_consensus_looked_at(tmp_path, start):
    """Consensus also looks before every checkpoint: in a job checkpointing every 2 steps it
    looked every 2, which its costs file states (at 4 sdc-plan priced each look at twice what it
    cost), counted from the step a resumed job began at; and how many looks fell in the 5 steps
    measured after the 3-step warm-up, where they are not one per interval: consensus's 3, and
    replay's 1 of its listed steps (given no interval, it was priced as if it looked every
    step: at 5 steps measured, 5 times low)."""
    got = _forked_world(tmp_path, _checkpointing_rank, start)
    looked = {"nan_inf": (None, None), "weight_consensus": (2, 3), "replay": (None, 1)}
    assert got == {r: looked for r in range(FROZEN_WORLD)}


@pytest.fixture
def one_shard(tmp_path):
    """A one-rank world and its device mesh, for fully_shard in this process."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    _ended()


def _guards_in_turn_rank(rank: int, store: str, results) -> None:
    """A guard after a closed one, then one in place of one left open, on a sharded Linear;
    the last rehearses a NaN on rank 1: what each rank's guards saw."""
    _joined(rank, store)
    model = fully_shard(nn.Linear(4, 6), mesh=init_device_mesh("cpu", (FROZEN_WORLD,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = Guard(model, ["nan_inf"], ranks_per_node=1)
    _guarded_step(first, model, optimizer, 0, rank)
    first.close()
    left_open = Guard(model, ["nan_inf"], ranks_per_node=1, start_step=1)
    _guarded_step(left_open, model, optimizer, 1, rank)
    nan = {"site": "grad", "model": "value", "value": "nan", "ranks": [1], "steps": [2]}
    last = Guard(model, ["nan_inf"], ranks_per_node=1, start_step=2, inject=nan)
    try:
        _guarded_step(last, model, optimizer, 2, rank)
        seen = [(a.detector, a.step, a.suspect_ranks) for a in last.alerts]
        results.put((rank, (left_open.closed, seen)))
    finally:
        last.close()
        dist.destroy_process_group()


def test_a_new_guard_on_a_sharded_module_takes_over_from_a_closed_or_open_one(tmp_path):
    """Each was refused, "a custom collective ... already": the earlier guard's own sites taken
    for a user's, and the open guard already closed, so the loop went on unguarded. Now the
    last guard's nan_inf names rank 1 at the step it rehearses a NaN there."""
    got = _forked_world(tmp_path, _guards_in_turn_rank)
    assert all(closed for closed, _ in got.values())
    assert got[1][1][0] == ("nan_inf", 2, [1]), got


def test_a_mixed_precision_policy_is_refused_in_one_line_leaving_the_module_as_it_was(one_shard):
    """The refusal comes once the checks' forward hooks are on the module: a loop that goes on
    unguarded after it trains without them (every product had gone through the refused guard's
    watch)."""
    model = fully_shard(
        nn.Linear(4, 2), mesh=one_shard, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    )
    before = _forward_hooks(model)
    with pytest.raises(ValueError, match="MixedPrecisionPolicy.*use torch.autocast") as error:
        Guard(model, ["nan_inf", "matmul_checksum"])
    assert "\n" not in str(error.value)
    assert _forward_hooks(model) == before


def test_the_replica_of_a_sharded_module_is_the_module_without_fsdp(one_shard):
    """A transformers model with tied embeddings, each layer and the root sharded: the copy has
    the original classes, no FSDP state or hook, the tie kept, and computes what the sharded
    model computes once the weights are copied in."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=one_shard)
    fully_shard(model, mesh=one_shard)
    copy = unsharded_copy(model)
    assert type(copy) is transformers.Qwen2ForCausalLM
    assert not any(isinstance(m, FSDPModule) for m in copy.modules())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in copy.modules())
    assert copy.lm_head.weight is copy.model.embed_tokens.weight
    with torch.no_grad():
        for p, q in zip(model.parameters(), copy.parameters(), strict=True):
            q.copy_(p.full_tensor())
    tokens = torch.randint(64, (2, 8))
    assert torch.equal(copy(tokens).logits, model(tokens).logits)


@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16])
def test_the_sketch_bounds_a_compressed_reduction_from_the_wire_dtypes_rounding(wire):
    """What torch's compress hooks do to 4 ranks' buckets (cast, divide, sum with rounding at
    every addition) stays within the derived bound at every step's weights; in a small bucket
    the float32 bound alone is exceeded at some of them (float16: about 4 draws in 10), so the
    wire term is needed, not a loosening."""
    world, n = 4, 8192  # a small bucket: float32 rounding alone is bounded tightly there
    gen = torch.Generator().manual_seed(0)
    buckets = [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 0, (n,), generator=gen)
               for _ in range(world)]  # fmt: skip
    total = torch.zeros(n, dtype=wire)
    for g in buckets:
        total += g.to(wire).div_(world)  # every partial sum rounds to the wire dtype
    rho, alpha = sketch.sum_rounding(wire, world, per_rank=2)  # the cast and the division
    beyond_float32 = 0
    for step in range(10):
        weights = sketch.step_weights(step, 0, n)
        riders = sum(sketch.rider_of(g, weights) / world for g in buckets)
        expected, norms = float(riders[0]), float(riders[1])
        error = abs(float(sketch.project(total.float(), weights)) - expected)
        assert error <= sketch.tolerance(norms, n, 1e-6, rho, alpha), step
        beyond_float32 += error > 4 * 1e-6 * n**0.5 * norms
    assert beyond_float32 > 0


def _alarm(step: int, first_suspect: int) -> SDCAlarm:
    alert = Alert(step=step, detector="replay", phase="pre_allreduce", suspect_ranks=[1],
                  suspect_nodes=[1], evidence={}, rank=0, node=0)  # fmt: skip
    return SDCAlarm([alert], ["host0", "host1"], first_suspect)


def test_an_alarm_on_megatron_hash_names_no_machine():
    """megatron_hash reports the ranks whose weights differ from rank 0's, as Megatron does:
    with rank 0 corrupt at 2 ranks, rank 1 reports, and the alarm named host1 (exit 86,
    "restart without the suspect machines"), the healthy one; at 4 ranks three healthy ones.
    Its reports attribute nothing: exit 87, no machine named, and recovery suspects no rank on
    its word; a check that attributes, alarming beside it, names its own, in the guard's alarm
    too where it alerted after megatron_hash in the same step."""
    from harness.campaign.recovery import attributed_ranks
    from harness.guard.alarm import EXIT_UNATTRIBUTED, first_check

    reports = [
        Alert(step=3, detector="megatron_hash", phase="consensus", suspect_ranks=[r],
              suspect_nodes=[r], evidence={"versus": 0}, rank=r, node=r)
        for r in (1, 2, 3)
    ]  # fmt: skip
    for alerts, machines in (
        (reports[:1], ["host0", "host1"]),
        (reports, [f"host{r}" for r in range(4)]),
    ):
        alarm = SDCAlarm(alerts, machines, 0)
        assert (alarm.exit_code, alarm.suspect_machines) == (EXIT_UNATTRIBUTED, []), machines
    assert attributed_ranks(reports) == set()
    replay = Alert(step=3, detector="replay", phase="pre_allreduce", suspect_ranks=[0],
                   suspect_nodes=[0], evidence={}, rank=0, node=0)  # fmt: skip
    assert attributed_ranks([*reports, replay]) == {0}
    # Consensus looks at the steps megatron_hash does, and alerted after it: the alarm was
    # megatron_hash's, no machine named, where consensus's majority named rank 1.
    consensus = Alert(step=3, detector="weight_consensus", phase="consensus", suspect_ranks=[1],
                      suspect_nodes=[1], evidence={}, rank=0, node=0)  # fmt: skip
    alarm = SDCAlarm(first_check([*reports[:1], consensus]), ["host0", "host1"], 0)
    assert (alarm.detector, alarm.suspect_machines) == ("weight_consensus", ["host1"])
    assert first_check(reports) == reports
    # The first alert that names any decides, not the union of every alert's suspects.
    assert attributed_ranks([replay, consensus]) == {0}


def test_a_sharded_wrong_sum_names_its_receivers_machines_only_when_it_strikes_again(tmp_path):
    """HSDP on four machines, two replica groups of two: a wrong received sum of shard 1, seen
    by its receivers in both groups (ranks 1 and 3), named host1 and host3 (exit 86, "restart
    without" them), where a campaign's recovery rolls back without quarantine: no machine
    explains it. Now exit 87 the first time at its step; after the restart, struck again at
    that step (quarantine.json's earlier incident), its receivers' machines are named. A DDP
    job re-runs a wrong reduction in its step, and names them at once; so does a sharded one
    whose receivers share a machine."""
    from harness.guard.alarm import EXIT_SUSPECT_HARDWARE, EXIT_UNATTRIBUTED, earlier_incidents

    machines = [f"host{r}" for r in range(4)]
    alerts = [
        Alert(step=6, detector="allreduce_sketch", phase="post_allreduce", suspect_ranks=[r],
              suspect_nodes=[r], evidence={}, rank=r, node=r)
        for r in (1, 3)
    ]  # fmt: skip
    first = SDCAlarm(alerts, machines, 6, sharded=True)
    assert (first.exit_code, first.suspect_machines) == (EXIT_UNATTRIBUTED, ["host1", "host3"])
    quarantine(tmp_path, first, [])
    assert earlier_incidents(tmp_path) == ((6, "post_allreduce"),)
    again = SDCAlarm(alerts, machines, 6, sharded=True, earlier=earlier_incidents(tmp_path))
    assert again.exit_code == EXIT_SUSPECT_HARDWARE
    assert again.again().exit_code == EXIT_SUSPECT_HARDWARE
    later = SDCAlarm(
        [replace(a, step=7) for a in alerts], machines, 7, True, ((6, "post_allreduce"),)
    )
    assert later.exit_code == EXIT_UNATTRIBUTED
    assert SDCAlarm(alerts, machines, 6).exit_code == EXIT_SUSPECT_HARDWARE
    shared = SDCAlarm(alerts, ["a", "b", "a", "b"], 6, sharded=True)
    assert (shared.exit_code, shared.suspect_machines) == (EXIT_SUSPECT_HARDWARE, ["b"])


def test_the_alarms_suspect_interval_is_the_earliest_any_alert_puts_in_doubt():
    """Consensus every step on weights and moments alarms first at step 5, vouching for step
    4's checkpoint; nan_inf, in the same step, cannot tell the fault from weights step 4's
    update broke or moments step 3's left. The alarm took the first alert's bound (5), leaving
    the checkpoints of steps 3 and 4 in place; as campaign recovery does, it takes the
    earliest."""
    consensus = detectors.detector_class("weight_consensus").Config(
        interval=1, optimizer_state=True
    )
    checks = {"weight_consensus": consensus,
              "nan_inf": detectors.detector_class("nan_inf").Config()}  # fmt: skip
    alerts = [
        Alert(step=5, detector=name, phase=phase, suspect_ranks=[1], suspect_nodes=[1],
              evidence={}, rank=1, node=1)
        for name, phase in (("weight_consensus", "consensus"), ("nan_inf", "pre_allreduce"))
    ]  # fmt: skip
    assert earliest_suspect(alerts[:1], checks, lambda s: True) == 5
    assert earliest_suspect(alerts, checks, lambda s: True) == 3


def test_a_second_incident_sets_aside_a_checkpoint_of_the_same_step_beside_the_first(tmp_path):
    """A job restarted from the restore point alarms again on a checkpoint of the same step: it
    is moved beside the first incident's (with its checksum), not over it, and the restore
    point stays before both (the move raised on a sharded folder, leaving the new suspect
    checkpoint where restore_point took it)."""
    state = {"w": torch.ones(2)}
    for incident in (1, 2):
        for step in (3, 5):
            checkpoint.save(checkpoint.step_path(tmp_path, step), {**state, "incident": incident})
        quarantine(tmp_path, _alarm(6, 4), [])
        assert Guard.restore_point(tmp_path) == (3, str(checkpoint.step_path(tmp_path, 3)))
    aside = tmp_path / "suspect"
    assert sorted(p.name for p in aside.iterdir()) == [
        "step_000005.pt",
        "step_000005.pt.2",
        "step_000005.pt.2.sha256",
        "step_000005.pt.sha256",
    ]
    assert checkpoint.load(aside / "step_000005.pt")["incident"] == 1
    record = json.loads((tmp_path / "quarantine.json").read_text())
    assert record["set_aside"] == ["step_000005.pt"]
    assert record["moved_to"] == ["suspect/step_000005.pt.2"]
    # The first incident is kept in the second's record (it was replaced: nothing said which
    # machine the first had suspected).
    assert [i["moved_to"] for i in record["earlier"]] == [["suspect/step_000005.pt"]]


def test_a_checkpoint_a_trainer_saved_under_one_name_several_times_is_set_aside_once(tmp_path):
    """Lightning's save_last writes last.ckpt at every save: its second move raised, and every
    later suspect checkpoint (step=4.ckpt) was left where the documented resume takes it."""
    for name in ("last.ckpt", "step=3.ckpt", "step=4.ckpt"):
        (tmp_path / name).write_text(name)
    written = [(3, tmp_path / "last.ckpt"), (3, tmp_path / "step=3.ckpt"),
               (4, tmp_path / "last.ckpt"), (4, tmp_path / "step=4.ckpt")]  # fmt: skip
    quarantine(tmp_path, _alarm(5, 3), written)
    assert sorted(p.name for p in (tmp_path / "suspect").iterdir()) == [
        "last.ckpt",
        "step=3.ckpt",
        "step=4.ckpt",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quarantine.json", "suspect"]


def test_a_link_a_trainer_keeps_to_a_suspect_checkpoint_goes_beside_it(tmp_path):
    """Lightning's ModelCheckpoint(save_last="link") keeps last.ckpt as a link it makes itself,
    not through the strategy's save: the move left it in place, pointing at nothing, where a
    user resuming from the newest *.ckpt took it. It goes beside its file, still to it."""
    for step in (3, 4):
        (tmp_path / f"step={step}.ckpt").write_text(f"{step}")
    (tmp_path / "last.ckpt").symlink_to("step=4.ckpt")
    written = [(3, tmp_path / "step=3.ckpt"), (4, tmp_path / "step=4.ckpt")]
    quarantine(tmp_path, _alarm(5, 4), written)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "quarantine.json",
        "step=3.ckpt",
        "suspect",
    ]
    link = tmp_path / "suspect" / "last.ckpt"
    assert link.is_symlink() and link.read_text() == "4"
    record = json.loads((tmp_path / "quarantine.json").read_text())
    assert record["set_aside"] == ["step=4.ckpt", "last.ckpt"]
    assert record["moved_to"] == ["suspect/step=4.ckpt", "suspect/last.ckpt"]


def test_a_set_aside_that_fails_still_records_the_incident_and_restore_point_passes_it(
    tmp_path,
):
    """A folder that cannot be moved (here `suspect` is a file): quarantine.json was not
    written, and restore_point returned the suspect checkpoint left in place. A checkpoint of
    the same step that the restarted job writes after the alarm is vouched for again."""
    for step in (2, 4):
        checkpoint.save(checkpoint.step_path(tmp_path, step), {"w": torch.ones(2)})
    (tmp_path / "suspect").write_text("in the way\n")
    with pytest.raises(OSError):
        quarantine(tmp_path, _alarm(5, 3), [])
    record = json.loads((tmp_path / "quarantine.json").read_text())
    assert record["first_suspect_step"] == 3 and record["set_aside"] == []
    assert Guard.restore_point(tmp_path) == (2, str(checkpoint.step_path(tmp_path, 2)))
    checkpoint.save(checkpoint.step_path(tmp_path, 4), {"w": torch.zeros(2)})  # retrained
    assert Guard.restore_point(tmp_path) == (4, str(checkpoint.step_path(tmp_path, 4)))
    # A second incident over the same interval, its set-aside failing again: the retrained
    # step 4 is suspect too (the first incident's record of the file hid the second's).
    with pytest.raises(OSError):
        quarantine(tmp_path, _alarm(5, 3), [])
    assert Guard.restore_point(tmp_path) == (2, str(checkpoint.step_path(tmp_path, 2)))


def test_a_link_to_a_suspect_checkpoint_leaves_the_checkpoint_moved(tmp_path):
    """A loop that reports a "latest" link beside the file: the link was moved in the file's
    place, and the suspect file stayed where a resume takes it."""
    (tmp_path / "step=4.ckpt").write_text("weights")
    (tmp_path / "latest.ckpt").symlink_to(tmp_path / "step=4.ckpt")
    written = [(4, tmp_path / "step=4.ckpt"), (4, tmp_path / "latest.ckpt")]
    quarantine(tmp_path, _alarm(5, 3), written)
    assert (tmp_path / "suspect" / "step=4.ckpt").read_text() == "weights"
    assert not (tmp_path / "step=4.ckpt").exists()


def _unlooked_rank(rank: int, store: str, results) -> None:
    """Consensus every 50 steps of a 4-step loop with no checkpoint: this rank's warnings."""
    _joined(rank, store)
    model = DDP(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, {"weight_consensus": {"interval": 50}, "nan_inf": {}})
    _steps_reported(guard, model, optimizer, rank, 4, results,
                    lambda g: [(w.detector, w.what) for w in g.warnings])  # fmt: skip


def test_a_check_that_has_not_looked_says_so_among_the_warnings(tmp_path):
    """A plan's interval longer than the job: consensus was listed as running, with no word
    that it never compared anything (sdc-bench refuses such a setting; the guard, whose loop
    may checkpoint where consensus also looks, says so instead)."""
    got = _forked_world(tmp_path, _unlooked_rank)
    said = [("weight_consensus", "has not looked in steps 0..3")]
    assert got == dict.fromkeys(range(FROZEN_WORLD), said), got
