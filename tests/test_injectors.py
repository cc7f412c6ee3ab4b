"""Every site and fault model through the public command, checked against the events."""

from __future__ import annotations

import math
import multiprocessing as mp
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.comm import HookState, comm_hook
from harness.config import FaultConfig
from harness.plugins import EventLog, PluginBus, RankInfo
from injectors.injector import FaultInjector
from tests.conftest import events, rows

SITES = "[grad,allreduce,weight,optimizer,activation,loss]"
ONE = "ranks:[1],steps:[3],grid:{site:" + SITES + "}"
MODELS = {
    "bitflip": "model:bitflip,bit:30",
    "value": "model:value,value:nan",
    "scale": "model:scale,factor:1000",
    "stuck": "model:stuck,stuck_at:0,bit:sign",
}


def _campaign(tmp_path, run_ok, scenarios: list[str], *extra: str) -> Path:
    out = tmp_path / "run"
    listed = ",".join("{" + s + "}" for s in scenarios)
    run_ok(
        "workload.steps=8",
        "campaign.seeds=1",
        "campaign.noise_seeds=2",
        f"campaign.scenarios=[{listed}]",
        *extra,
        f"out={out}",
        cwd=tmp_path,
    )
    return out


def _by_trial(out: Path) -> dict[str, list[dict]]:
    grouped = defaultdict(list)
    for e in events(out):
        if e["kind"] == "inject":
            grouped[e["trial_id"]].append(e)
    return grouped


def test_every_site_and_model_injects_exactly_what_it_records(tmp_path, run_ok):
    out = _campaign(tmp_path, run_ok, [f"{m},{ONE}" for m in MODELS.values()])
    table, injected = rows(out), _by_trial(out)
    assert len(table) == 6 * 4
    for row in table:
        site, model = row["site"], row["model"]
        records = injected[row["trial_id"]]
        assert records, f"no injection in {row['trial_id']}"
        assert all(e["site"] == site and e["rank"] == 1 and e["step"] == 3 for e in records)
        assert row["fired"] == str(any(e["fired"] for e in records))
        for e in records:
            old, new = int(e["old_bits"], 16), int(e["new_bits"], 16)
            assert e["fired"] == (old != new)
            if model == "bitflip":
                assert old ^ new == 1 << 30
            elif model == "value":
                assert e["new"] == "nan"
            elif model == "scale":
                assert math.isclose(e["new"], e["old"] * 1000, rel_tol=1e-6)
            else:
                assert new == old & ~(1 << 31) and e["bit"] == 31
        if site == "optimizer":
            assert records[0]["tensor"].endswith((".exp_avg", ".exp_avg_sq"))
        if site == "loss":
            assert records[0]["tensor"] == "loss"
    # A NaN reaches every replica's update from every site but the loss value, which backward
    # never reads.
    nan_rows = {r["site"]: r for r in table if r["model"] == "value"}
    assert {s for s, r in nan_rows.items() if r["effect"] == "harmful"} == {
        "grad",
        "allreduce",
        "weight",
        "optimizer",
        "activation",
    }
    assert nan_rows["loss"]["effect"] == "masked"


def test_reduction_scope_keeps_replicas_identical_and_rank_scope_splits_one(tmp_path, run_ok):
    out = _campaign(
        tmp_path,
        run_ok,
        [
            "site:allreduce,model:scale,factor:1000,scope:reduction,ranks:[0],steps:[2]",
            "site:allreduce,model:scale,factor:1000,scope:rank,ranks:[2],steps:[2]",
        ],
    )
    reduction, rank = rows(out)
    assert reduction["replicas_agree"] == "True" and reduction["golden_match"] == "False"
    assert reduction["injected_ranks"] == "0;1;2;3" and reduction["divergent_ranks"] == ""
    assert rank["replicas_agree"] == "False" and rank["divergent_ranks"] == "2"
    assert rank["injected_ranks"] == "2"
    same = {(e["tensor"], e["index"], e["new_bits"]) for e in _by_trial(out)[reduction["trial_id"]]}
    assert len(same) == 1, "every receiver got the same wrong value"


def test_persistence_schedules_and_bit_error_rate(tmp_path, run_ok):
    out = _campaign(
        tmp_path,
        run_ok,
        [
            "site:grad,model:scale,factor:2,ranks:[1],steps:[4],persistence:permanent",
            "site:grad,model:scale,factor:2,ranks:[1],steps:[1],persistence:intermittent,"
            "probability:0.5",
            "site:weight,model:bitflip,schedule:[{step:2,rank:3,tensor:fc1.bias,index:5,bit:3},"
            "{step:6,rank:0,tensor:head.weight,index:0,bit:31}]",
            "site:grad,model:bitflip,ber:0.00005,ranks:[2],steps:[3],tensor:fc2.weight",
        ],
    )
    permanent, intermittent, scheduled, ber = (_by_trial(out)[r["trial_id"]] for r in rows(out))
    assert sorted({e["step"] for e in permanent}) == [4, 5, 6, 7]
    assert len({(e["tensor"], e["index"]) for e in permanent}) == 1, "the same unit every step"
    steps = sorted({e["step"] for e in intermittent})
    assert steps and set(steps) < set(range(1, 8))
    assert [(e["step"], e["rank"], e["tensor"], e["index"], e["bit"]) for e in scheduled] == [
        (2, 3, "fc1.bias", 5, 3),
        (6, 0, "head.weight", 0, 31),
    ]
    # 65,536 fc2.weight values x 32 bits x 5e-5: about 105 flips expected.
    assert 60 < len(ber) < 160
    assert all(e["tensor"] == "fc2.weight" and e["rank"] == 2 for e in ber)
    assert all(int(e["old_bits"], 16) ^ int(e["new_bits"], 16) == 1 << e["bit"] for e in ber)


def test_a_schedule_built_from_recorded_events_replays_them_exactly(tmp_path, run_ok):
    first = _campaign(
        tmp_path,
        run_ok,
        ["site:grad,model:bitflip,ranks:[1,2],steps:[2,5],elements:2,bit:exponent"],
    )
    recorded = _by_trial(first)[rows(first)[0]["trial_id"]]
    schedule = ",".join(
        f"{{step:{e['step']},rank:{e['rank']},tensor:{e['tensor']},index:{e['index']},"
        f"bit:{e['bit']}}}"
        for e in recorded
    )
    replay = tmp_path / "replay"
    run_ok(
        "workload.steps=8",
        "campaign=single",
        "fault.site=grad",
        "fault.model=bitflip",
        f"fault.schedule=[{schedule}]",
        f"out={replay}",
        cwd=tmp_path,
    )
    replayed = _by_trial(replay)[rows(replay)[0]["trial_id"]]
    keys = ("step", "rank", "tensor", "index", "bit", "old_bits", "new_bits")
    assert len(recorded) == 8
    assert sorted(tuple(e[k] for k in keys) for e in replayed) == sorted(
        tuple(e[k] for k in keys) for e in recorded
    )
    assert rows(replay)[0]["final_loss"] == rows(first)[0]["final_loss"]


def test_largest_selects_the_largest_magnitudes_across_the_matched_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.linspace(-0.5, 0.5, p.numel()).view_as(p))
        model[1].weight[1, 3] = -9.0
        model[0].weight[2, 1] = 7.0
        model[0].bias[3] = 8.0
    fault = FaultConfig(
        site="weight",
        model="value",
        value="zero",
        select="largest",
        elements=3,
        ranks=(0,),
        steps=(0,),
        tensor="*",
    )
    log = EventLog(0, 0)
    FaultInjector(fault, 0, RankInfo(0, 1, 1), log, model).on_update(0, model)
    hit = sorted((e["tensor"], e["index"], e["old"]) for e in log.events)
    assert hit == [("0.bias", 3, 8.0), ("0.weight", 9, 7.0), ("1.weight", 7, -9.0)]
    assert model[1].weight[1, 3] == 0 and model[0].bias[3] == 0


def _published_example(rank: int, store: str, results) -> None:
    """One parameter whose local gradient is 0.20, 0.40, 0.30 on ranks 0, 1, 2."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=3,
        timeout=timedelta(seconds=30),
    )
    torch.set_num_threads(1)
    w = torch.nn.Linear(1, 1, bias=False)
    w.weight.data.fill_(1.0)
    info = RankInfo(rank, 3, 1)
    log = EventLog(rank, rank)
    fault = FaultConfig(site="grad", model="scale", factor=10.0, ranks=(1,), steps=(0,))
    bus = PluginBus([FaultInjector(fault, 0, info, log, w)])
    ddp = DDP(w)
    ddp.register_comm_hook(HookState(bus, w, 3), comm_hook)
    grad = (0.20, 0.40, 0.30)[rank]
    ddp(torch.tensor([[grad]])).sum().backward()
    results.put((rank, float(w.weight.grad), [e["new"] for e in log.events]))
    dist.barrier()
    dist.destroy_process_group()


def test_published_example_one_scaled_gradient_poisons_every_replica_alike(tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_published_example, args=(r, str(tmp_path / "store"), results))
        for r in range(3)
    ]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    averaged = [g for _, g, _ in got]
    assert all(math.isclose(g, 1.50, rel_tol=1e-6) for g in averaged), averaged
    assert len(set(averaged)) == 1, "the replicas still agree with each other"
    assert math.isclose(got[1][2][0], 4.0, rel_tol=1e-6), "rank 1's 0.40 became 4.00"
    assert got[0][2] == [] and got[2][2] == []
