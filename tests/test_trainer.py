"""The trainer on a real 2-rank gloo world, against a single-process reference."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from harness.config.schema import FaultConfig, TrialSpec
from harness.core.bus import PluginBus
from harness.core.plugins import EventLog, RankInfo
from harness.launch.world import World
from harness.results.schema import RankResult
from harness.runtime.comm import HookState
from harness.runtime.trainer import StopPoint
from harness.runtime.workloads import Workload
from tests.conftest import compose_run, forked_ranks


def _reference_final_loss(run, seed: int) -> float:
    """Plain single-process training on the same data: the mean gradient over every rank's
    every micro-batch, then AdamW, which is what DDP with accumulation must compute."""
    cfg = replace(run.workload, seed=seed)
    workload = Workload(cfg)
    model = workload.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    world, micro = run.topology.world_size, cfg.micro_batches
    for step in range(cfg.steps):
        optimizer.zero_grad()
        for rank in range(world):
            for m in range(micro):
                loss = workload.loss(model, workload.batch(step, rank, m))
                (loss / (micro * world)).backward()
        optimizer.step()
    with torch.no_grad():
        return float(workload.loss(model, workload.eval_batch()))


def test_ddp_with_gradient_accumulation_matches_the_single_process_reference(tmp_path):
    run = compose_run(
        "campaign=single", "topology.nodes=2", "workload.steps=4", "workload.micro_batches=3"
    )
    world = World(run.topology, tmp_path / "world", tmp_path / "store")
    try:
        outcome = world.run(run, TrialSpec("t", 0, FaultConfig()))
    finally:
        world.close()
    assert outcome.crash is None, outcome.crash
    losses = {p.final_loss for p in outcome.parts}
    digests = {p.weights_digest for p in outcome.parts}
    assert len(losses) == 1 and len(digests) == 1, "replicas must stay identical"
    reference = _reference_final_loss(run, 0)
    # Only the order of floating-point sums differs (DDP averages per bucket across ranks).
    assert abs(losses.pop() - reference) <= 1e-5 * abs(reference)
    # Every step's loss is recorded; training makes progress.
    steps = outcome.parts[0].losses
    assert len(steps) == 4 and steps[-1] < steps[0]


def test_batches_are_a_pure_function_of_seed_step_rank_micro_batch():
    for name in ("mlp", "gpt"):
        workload = Workload(compose_run(f"workload={name}").workload)
        again = Workload(compose_run(f"workload={name}").workload)
        x, y = workload.batch(3, 2, 1)
        x2, y2 = again.batch(3, 2, 1)
        assert torch.equal(x, x2) and torch.equal(y, y2)
        other, _ = workload.batch(3, 1, 1)
        assert not torch.equal(x, other), "ranks must see different data"


def test_workloads_build_in_every_dtype_and_gpt_has_a_few_hundred_thousand_parameters():
    for dtype in ("float32", "bfloat16", "float16"):
        run = compose_run("workload=gpt", f"workload.dtype={dtype}")
        workload = Workload(run.workload)
        model = workload.build_model()
        assert all(p.dtype == getattr(torch, dtype) for p in model.parameters())
        loss = workload.loss(model, workload.batch(0, 0, 0))
        loss.backward()
        assert torch.isfinite(loss)
    params = sum(p.numel() for p in model.parameters())
    assert 200_000 <= params <= 900_000
    # The reference workload for overhead: at least 1024 tokens per rank per step.
    cfg = run.workload
    assert cfg.micro_batch_size * cfg.micro_batches * cfg.context >= 1024


def test_float16_training_stays_finite_where_a_gradient_element_is_zero():
    """AdamW's eps is added in the weights' dtype: in float16 the default 1e-8 is 0, and an
    element with a zero gradient (the mlp has one at step 0) became 0/0 = NaN in its first
    update, so every float16 golden run ended NaN and every trial was judged against it."""
    for name in ("mlp", "gpt"):
        workload = Workload(compose_run(f"workload={name}", "workload.dtype=float16").workload)
        model = workload.build_model()
        optimizer = workload.build_optimizer(model)
        for step in range(5):
            loss = workload.loss(model, workload.batch(step, 0, 0))
            assert torch.isfinite(loss), (name, step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert all(torch.isfinite(p).all() for p in model.parameters()), name


def _approvals(rank: int, store: str, results) -> None:
    """Rank 0 approves the checkpoint, rank 1 does not; what the stop point hands each back,
    observing and acting."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    bus, info = PluginBus([]), RankInfo(rank, 2, 1)
    state = HookState(bus, nn.Linear(2, 2), 2)
    got = []
    for acting in (False, True):
        point = StopPoint(bus, acting, RankResult("t", rank), state, EventLog(rank, rank), info)
        got.append(point.reached(3, extra=torch.tensor(rank == 0)))
    results.put((rank, got))
    dist.destroy_process_group()


def test_a_checkpoint_is_approved_by_every_rank_or_by_none(tmp_path):
    """A check's approval is its rank's (`Plugin.approves_checkpoint`): weight_consensus's is
    the same everywhere, a plug-in's may not be. Each rank took its own, so DDP's rank 0 wrote
    a checkpoint rank 1 refused, and FSDP's ranks would have entered the sharded save apart
    (one waiting in its collective forever). The stop point sums them over the world."""
    ctx = forked_ranks(tmp_path)
    results = ctx.Queue()
    procs = [ctx.Process(target=_approvals, args=(r, str(tmp_path / "store"), results))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == {0: [[1.0], [1.0]], 1: [[1.0], [1.0]]}
