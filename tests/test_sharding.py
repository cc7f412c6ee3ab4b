"""Sharded training (harness/runtime/sharding.py) on a real 4-rank gloo world: FSDP over the
world and HSDP as 2 replicas x 2 shards, every rank's result compared. One spawn runs every
case; the tests below each assert on its part of what the ranks reported."""

from __future__ import annotations

import hashlib
import queue
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from detectors.allreduce_sketch import AllreduceSketch
from detectors.gather_consensus import GatherConsensus
from detectors.nan_inf import NanInf
from harness.config.schema import WorkloadConfig
from harness.core.bus import PluginBus
from harness.core.events import Alert, Sensitivity
from harness.core.plugins import DetectorContext, EventLog, RankInfo
from harness.runtime import numerics
from harness.runtime.replica import unsharded_copy
from harness.runtime.shard_sites import ShardedBuckets
from harness.runtime.sharding import GroupLayout, ShardSites, blocks, mesh, shard
from harness.runtime.workloads import Workload
from tests.conftest import compose_run, forked_ranks

WORLD = 4
STEPS = 3
RESTART = 2
MESHES = {"fsdp": WORLD, "hsdp": 2}


def _noop(*_args: object) -> None:
    """A site that only looks: installed, it makes the custom comms run."""


NOOP = ShardSites(local_gradients=_noop, received=_noop, gathered=_noop)


def _digest(model: torch.nn.Module) -> str:
    """SHA-256 of the whole (gathered) parameters: a collective, every rank calls it."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode())
        h.update(full.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _model(workload: Workload, device_mesh, sites: ShardSites | None) -> torch.nn.Module:
    model = workload.build_model()
    if sites is not None:
        return shard(model, device_mesh, sites)
    # Plain fully_shard, torch's defaults, the same groups.
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh)
    return fully_shard(model, mesh=device_mesh)


def _state(model, optimizer) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def _train(
    workload: Workload,
    device_mesh,
    sites: ShardSites | None,
    steps: range,
    save: Path | None = None,
    load: Path | None = None,
    buckets: ShardedBuckets | None = None,
) -> torch.nn.Module:
    """AdamW steps on every rank's own micro-batch; a DCP save of model and optimizer after
    step RESTART - 1 when `save`, a start from one when `load`; `buckets` told each step, as
    the trainer tells them."""
    model = _model(workload, device_mesh, sites)
    optimizer = workload.build_optimizer(model)
    if load is not None:
        state = _state(model, optimizer)
        dcp.load(state, checkpoint_id=str(load))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
    for step in steps:
        if buckets is not None:
            buckets.step = step
        optimizer.zero_grad(set_to_none=True)
        workload.loss(model, workload.batch(step, dist.get_rank(), 0)).backward()
        workload.prepare_update(model, optimizer, step)
        optimizer.step()
        if save is not None and step == RESTART - 1:
            dcp.save(_state(model, optimizer), checkpoint_id=str(save))
    return model


def _checked(workload: Workload, parallel: str) -> tuple[ShardedBuckets, PluginBus, EventLog]:
    """The campaigns' sites (harness/runtime/shard_sites.py), as the trainer installs them,
    with every check that applies at a world of 2 replica groups on the bus, each looking at
    every step: every bucket copied out, checked and written back, the riders summed."""
    info = RankInfo(dist.get_rank(), WORLD, 1)
    log = EventLog(info.rank, info.rank)
    ctx = DetectorContext(info, None, workload, STEPS, tuple((r,) for r in range(WORLD)))
    checks = [kind(kind.Config(), ctx, log) for kind in (NanInf, AllreduceSketch, GatherConsensus)]
    bus = PluginBus(checks, log.verdicts)
    buckets = ShardedBuckets(parallel == "hsdp", WORLD)
    buckets.groups = len(blocks(workload.build_model())) + 1
    buckets.bind(bus)
    return buckets, bus, log


def _bit_identity(cfgs: dict[str, WorkloadConfig], meshes: dict, folder: Path) -> dict:
    """(a) plain fully_shard against the harness's comms with no-op sites and with the
    campaigns' sites and checks, and (c) the float32 run restarted from its DCP save at step
    RESTART, per mesh and dtype: weight digests, and the checks' alerts."""
    out = {}
    for parallel, device_mesh in meshes.items():
        for dtype, cfg in cfgs.items():
            workload = Workload(cfg)
            plain = _digest(_train(workload, device_mesh, None, range(STEPS)))
            save = folder / f"{parallel}-{dtype}" if dtype == "float32" else None
            custom = _digest(_train(workload, device_mesh, NOOP, range(STEPS), save=save))
            buckets, bus, log = _checked(workload, parallel)
            checked = _train(workload, device_mesh, buckets.sites(), range(STEPS), buckets=buckets)
            checked = _digest(checked)
            bus.resolve()
            alerts = sum(isinstance(e, Alert) for e in log.events)
            # The sketch's record of its bound, once per group it verified at step 0.
            verified = sum(isinstance(e, Sensitivity) for e in log.events)
            out[parallel, dtype] = {"plain": plain, "custom": custom, "checked": checked,
                                    "alerts": alerts, "verified": verified}  # fmt: skip
            if save is not None:
                restarted = _train(workload, device_mesh, NOOP, range(RESTART, STEPS), load=save)
                out[parallel, dtype]["restarted"] = _digest(restarted)
    return out


def _sums(workload: Workload, meshes: dict) -> dict:
    """(b) One step, recording each group's local gradients and received shards: the received
    shards against the float64 mean of every rank's local gradients, against a float32
    all-reduce of the same inputs, and against the gradients the optimizer steps on."""
    out = {}
    for parallel, device_mesh in meshes.items():
        local: dict[int, torch.Tensor] = {}
        received: dict[tuple[int, str], torch.Tensor] = {}
        layouts: dict[int, GroupLayout] = {}

        def keep_local(layout, flat, _averaged, local=local, layouts=layouts):
            local[layout.index], layouts[layout.index] = flat.clone(), layout

        def keep_received(layout, stage, shard_, received=received):
            received[layout.index, stage] = shard_.clone()

        sites = ShardSites(local_gradients=keep_local, received=keep_received)
        model = _train(workload, device_mesh, sites, range(1))
        shard_group = device_mesh["shard"].get_group() if device_mesh.ndim > 1 else None
        params = dict(model.named_parameters())
        worst, exact, stepped = 0.0, True, True
        for index, flat in sorted(local.items()):
            layout = layouts[index]
            mean = flat.double()
            dist.all_reduce(mean)
            mean /= WORLD
            total = flat.double().abs()
            dist.all_reduce(total)
            final = received[index, "all_reduce" if device_mesh.ndim > 1 else "reduce_scatter"]
            mine = mean.view(layout.world, -1)[layout.rank]
            scale = total.view(layout.world, -1)[layout.rank] / WORLD
            # The float32 sum of 4 terms, then a divide: within 4 units of roundoff of the
            # terms' magnitude (an unrounded sum would need 3).
            error = (final.double() - mine).abs() - 4 * torch.finfo(flat.dtype).eps * scale
            worst = max(worst, float(error.max()))
            # Gloo's reduce-scatter is an all-reduce of the whole input, this rank's chunk kept.
            again = flat.clone()
            dist.all_reduce(again, op=dist.ReduceOp.AVG, group=shard_group)
            scattered = received[index, "reduce_scatter"]
            exact &= torch.equal(again.view(layout.world, -1)[layout.rank], scattered)
            for span in layout.spans:
                grad = params[span.name].grad.to_local().reshape(-1)
                stepped &= torch.equal(grad, layout.shard(final, span.name)[: grad.numel()])
        out[parallel] = {"worst": worst, "exact": exact, "stepped": stepped, "groups": len(local)}
    return out


def _received_fault(workload: Workload, device_mesh) -> list[int]:
    """(b) x1000 on one element of group 0's received shard on rank 1 at step 1 (step 0's
    AdamW update is sign(g) times lr, which a scale leaves alone): the elements of this rank's
    weight shards that differ from the clean run's after the step."""

    at = {"step": 0}

    def strike(layout, stage, shard_):
        if dist.get_rank() == 1 and layout.index == 0 and stage == "reduce_scatter" and at["step"]:
            shard_[0] *= 1000

    clean = _train(workload, device_mesh, NOOP, range(2))
    model = workload.build_model()
    model = shard(model, device_mesh, ShardSites(received=strike))
    optimizer = workload.build_optimizer(model)
    for step in range(2):
        at["step"] = step
        optimizer.zero_grad(set_to_none=True)
        workload.loss(model, workload.batch(step, dist.get_rank(), 0)).backward()
        workload.prepare_update(model, optimizer, step)
        optimizer.step()
    theirs = dict(clean.named_parameters())
    return [
        int((p.to_local() != theirs[name].to_local()).sum()) for name, p in model.named_parameters()
    ]


def _gathered_fault(workload: Workload, device_mesh) -> dict:
    """(b) x1000 on one element of rank 0's shard as gathered into rank 2's unsharded weights,
    group 0, forward: every rank's forward loss, the clean one, whether the stored shards
    changed, and whether the gathered buffer's spans rebuild the whole parameters."""
    seen: dict[str, object] = {}

    def look(layout, backward, flat):
        if layout.index == 0 and not backward and "rebuilt" not in seen:
            seen["rebuilt"] = {s.name: layout.unsharded(flat, s.name).clone() for s in layout.spans}

    def strike(layout, backward, flat):
        if dist.get_rank() == 2 and layout.index == 0 and not backward:
            flat.view(layout.world, -1)[0, 0] *= 1000

    batch = workload.batch(0, dist.get_rank(), 0)
    losses = {}
    for label, gathered in (("clean", look), ("struck", strike)):
        model = shard(workload.build_model(), device_mesh, ShardSites(gathered=gathered))
        before = [p.to_local().clone() for p in model.parameters()]
        with torch.no_grad():
            losses[label] = float(workload.loss(model, batch))
        model.reshard()  # the root keeps its parameters unsharded after forward
        kept = all(
            torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters(), strict=True)
        )
        if label == "clean":
            params = dict(model.named_parameters())
            rebuilt = all(
                torch.equal(tensor, params[name].full_tensor())
                for name, tensor in seen["rebuilt"].items()
            )
    return {**losses, "kept": kept, "rebuilt": rebuilt}


def _prefetched(workload: Workload, device_mesh) -> dict:
    """An explicit asynchronous prefetch of every block (`unshard(async_op=True)`, the
    all-gather FSDP issues with async_op): `gathered` runs once the forward waits on the
    collective, not when it is issued, and the forward's loss is the unprefetched one's."""
    batch = workload.batch(0, dist.get_rank(), 0)
    seen: list[str] = []
    losses = []
    for prefetch in (False, True):
        seen.clear()
        sites = ShardSites(gathered=lambda layout, _backward, _flat: seen.append(str(layout.index)))
        model = shard(workload.build_model(), device_mesh, sites)
        if prefetch:
            for block in model.blocks:
                block.unshard(async_op=True)
            seen.append("issued")
        with torch.no_grad():
            losses.append(float(workload.loss(model, batch)))
    return {"same": losses[0] == losses[1], "seen": seen}


def _replica_per_step(workload: Workload, device_mesh) -> dict:
    """The replica the replays recompute on (DetectorContext.replica): gathered whole once per
    step, so that two replays of one step share the gather (a collective per parameter); the next
    step's call gathers the weights as they are then. The shards change here between two calls of
    one step, which training never does, so that a second gather would show."""
    model = _model(workload, device_mesh, None)
    ctx = DetectorContext(RankInfo(dist.get_rank(), WORLD, 1), model, workload, 2, ((0,),) * WORLD)
    ctx.unsharded_copy = lambda: unsharded_copy(model)
    first = _digest(ctx.replica(0))
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)
    again, later = _digest(ctx.replica(0)), _digest(ctx.replica(1))
    return {"same_step": again == first, "next_step": later == _digest(model) != first}


def _rank(rank: int, store: str, folder: str, cfgs: dict, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    torch.set_num_threads(1)
    meshes = {p: mesh(p, WORLD, size, "cpu") for p, size in MESHES.items()}
    workload = Workload(cfgs["float32"])
    parts = {
        "identity": lambda: _bit_identity(cfgs, meshes, Path(folder)),
        "sums": lambda: _sums(workload, meshes),
        "received": lambda: _received_fault(workload, meshes["fsdp"]),
        "gathered": lambda: _gathered_fault(workload, meshes["fsdp"]),
        "prefetched": lambda: _prefetched(workload, meshes["fsdp"]),
        "replica": lambda: _replica_per_step(workload, meshes["fsdp"]),
    }
    report, seconds = {}, {}
    # 16-bit products as the trainer's ranks compute them (`topology.cpu_numerics` unset).
    with numerics.installed(None, "cpu"):
        for name, part in parts.items():
            started = time.perf_counter()
            report[name] = part()
            seconds[name] = round(time.perf_counter() - started, 1)
    print(f"rank {rank} seconds {seconds}", flush=True)
    results.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Every rank's report, in rank order."""
    folder = tmp_path_factory.mktemp("sharding")
    base = ["workload=gpt", "workload.micro_batch_size=4"]
    cfgs = {
        dtype: compose_run(*base, f"workload.dtype={dtype}").workload
        for dtype in ("float32", "bfloat16")
    }
    ctx = forked_ranks(folder)
    results = ctx.Queue()
    args = (str(folder / "store"), str(folder), cfgs, results)
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = []
    while len(got) < WORLD:
        try:
            got.append(results.get(timeout=2))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a rank failed (exit codes {dead})"
    got.sort(key=lambda r: r[0])
    for p in procs:
        p.join(timeout=30)
    return [report for _, report in got]


@pytest.mark.parametrize("parallel", list(MESHES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_harness_sites_train_bit_identically_to_plain_fully_shard(ranks, parallel, dtype):
    digests = [r["identity"][parallel, dtype] for r in ranks]
    assert all(d["custom"] == d["plain"] == d["checked"] for d in digests), digests
    assert all(d["alerts"] == 0 for d in digests), "a check alarmed on a clean run"
    groups = len(blocks(Workload(compose_run("workload=gpt").workload).build_model())) + 1
    assert all(d["verified"] == groups for d in digests), "the sketch verified every group"
    assert len({d["custom"] for d in digests}) == 1, "every rank gathers the same weights"


@pytest.mark.parametrize("parallel", list(MESHES))
def test_a_run_restarted_from_its_dcp_save_ends_bit_identical(ranks, parallel):
    for r in ranks:
        identity = r["identity"][parallel, "float32"]
        assert identity["restarted"] == identity["custom"]


@pytest.mark.parametrize("parallel", list(MESHES))
def test_the_received_shards_are_the_mean_of_every_ranks_local_gradients(ranks, parallel):
    for r in ranks:
        sums = r["sums"][parallel]
        assert sums["groups"] == 3, "gpt's two blocks and the root"
        assert sums["worst"] <= 0, "beyond the collective's rounding"
        assert sums["exact"], "bit for bit the float32 all-reduce of the same inputs, sliced"
        assert sums["stepped"], "the received shard is the gradient the optimizer steps on"


def test_a_fault_in_one_received_shard_changes_only_that_ranks_weights(ranks):
    changed = [sum(r["received"]) for r in ranks]
    assert changed == [0, 1, 0, 0], "one element of rank 1's shard (AdamW is elementwise)"


def test_a_fault_in_a_gathered_shard_changes_only_that_ranks_forward(ranks):
    for rank, r in enumerate(ranks):
        got = r["gathered"]
        assert got["rebuilt"], "the gathered buffer's spans are the whole parameters"
        assert got["kept"], "the stored shards are untouched"
        assert (got["struck"] != got["clean"]) == (rank == 2), got
    assert len({r["gathered"]["clean"] for r in ranks}) == WORLD, "each rank's own batch"


def test_an_async_prefetch_runs_gathered_once_its_all_gather_is_waited_on(ranks):
    for r in ranks:
        assert r["prefetched"]["same"], "prefetched, the forward is the same"
        seen = r["prefetched"]["seen"]
        assert seen[0] == "issued", "no block's gathered runs before the forward waits on it"
        assert sorted(seen[1:]) == ["0", "1", "2"], "each group's all-gather, once"


def test_shard_refuses_a_frozen_parameter():
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"^sharding trains every parameter, and bias is frozen"):
        shard(model, None, NOOP)


def test_mesh_refuses_a_shard_size_that_does_not_divide_the_world():
    with pytest.raises(ValueError, match=r"^topology.shard_size=3 does not divide the world of 4"):
        mesh("hsdp", 4, 3, "cpu")
    with pytest.raises(ValueError, match=r"between 2 and the world size 4"):
        mesh("hsdp", 4, 8, "cpu")


def test_the_replays_of_one_step_share_one_gather_of_the_replica(ranks):
    assert [r["replica"] for r in ranks] == [{"same_step": True, "next_step": True}] * WORLD
