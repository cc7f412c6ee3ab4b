"""Every site and fault model through the public command, checked against the events."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.config.schema import FaultConfig
from harness.core.bus import PluginBus
from harness.core.events import ElementInject
from harness.core.plugins import Bucket, EventLog, RankInfo
from harness.errors import ConfigError
from harness.launch.world import shutdown
from harness.runtime import last_words
from harness.runtime.comm import HookState, comm_hook
from injectors import bits
from injectors.crash import InjectedCrash
from injectors.injector import FaultInjector
from tests.conftest import compose_run, events, forked_ranks, rows, run_here, sdc_bench
from tests.test_matmul_checksum import Rank

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


def test_a_transient_forward_fault_strikes_its_step_once_and_a_permanent_one_every_forward(
    tmp_path, run_ok
):
    """Two micro-batches and replay auditing the fault's step: a transient upset strikes the
    step's first forward only, not the second micro-batch nor a recomputation (which would carry
    it into the evidence); a broken unit (permanent) strikes every forward the rank trains or
    audits with."""
    where = "model:scale,factor:1000,tensor:fc2,ranks:[1],steps:[3]"
    out = _campaign(
        tmp_path,
        run_ok,
        [f"site:activation,{where}", f"site:loss,{where.replace(',tensor:fc2', '')}",
         f"site:activation,{where},persistence:permanent"],
        "workload.micro_batches=2", "detectors=[replay]", "detectors.replay.steps=[3]",
        "workload.steps=4",
    )  # fmt: skip
    activation, loss, permanent = (_by_trial(out)[r["trial_id"]] for r in rows(out))
    for transient in (activation, loss):
        assert [(e["step"], e["rank"]) for e in transient] == [(3, 1)], transient
    # Its two micro-batches, then on the audit its replays of a peer's two and its
    # recomputation of its own two, struck again alike; not the final evaluation, which
    # measures the weights the trial left (a strike there judged the trial by a loss no step
    # made).
    assert {(e["step"], e["rank"]) for e in permanent} == {(3, 1)} and len(permanent) == 6
    trained = [e["old"] for e in permanent[:2]]
    assert all([e["old"] for e in permanent].count(old) == 2 for old in trained), permanent
    assert all(r["detected"] == "True" and r["suspect_ranks"] == "1" for r in rows(out))


# Slow set; the default-run twin for schedules is test_persistence_schedules_and_bit_error_rate.
@pytest.mark.slow
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
    hit = sorted((e.tensor, e.index, e.old) for e in log.events)
    assert hit == [("0.bias", 3, 8.0), ("0.weight", 9, 7.0), ("1.weight", 7, -9.0)]
    assert model[1].weight[1, 3] == 0 and model[0].bias[3] == 0


@pytest.mark.parametrize("persistence", ["permanent", "intermittent"])
def test_a_persisting_largest_fault_keeps_the_elements_of_its_first_strike(persistence):
    """A broken unit strikes the same elements every time: the largest of the moment, taken
    anew at each strike, broke a new cell at every step (each zeroed weight left the next
    largest to the next strike)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fault = FaultConfig(site="weight", model="value", value="zero", select="largest", elements=2,
                        persistence=persistence, probability=0.6, ranks=(0,), steps=(0,),
                        tensor="*")  # fmt: skip
    log = EventLog(0, 0)
    injector = FaultInjector(fault, 0, RankInfo(0, 1, 1), log, model)
    for step in range(8):
        injector.on_update(step, model)
    struck = [e for e in log.events if isinstance(e, ElementInject)]
    assert len({e.step for e in struck}) >= 3
    assert len({(e.tensor, e.index) for e in struck}) == 2, struck


@pytest.mark.parametrize("persistence", ["transient", "permanent", "intermittent"])
def test_a_persisting_bit_error_rate_keeps_the_cells_of_its_first_strike(persistence):
    """A broken unit at a bit error rate is its cells: they are struck again, and at a weight
    the bits its first strike left are held (a strike fires only where the update changed
    them). Fresh bits drawn at every step broke 250 new cells a step and compounded the
    damage. A transient fault at several steps is a soft error at each: drawn anew."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    fault = FaultConfig(site="weight", model="bitflip", ber=1e-3, persistence=persistence,
                        probability=0.6, ranks=(0,), steps=(0, 1, 2, 3, 4, 5, 6, 7),
                        tensor="*")  # fmt: skip
    log = EventLog(0, 0)
    injector = FaultInjector(fault, 0, RankInfo(0, 1, 1), log, model)
    for step in range(8):
        with torch.no_grad():  # the update: every weight moves, so a held bit may change
            for p in model.parameters():
                p.mul_(0.5)
        injector.on_update(step, model)
    struck = [e for e in log.events if isinstance(e, ElementInject)]
    cells = {(e.tensor, e.index, e.bit) for e in struck}
    first = {(e.tensor, e.index, e.bit) for e in struck if e.step == struck[0].step}
    assert len({e.step for e in struck}) >= 3 and len(first) > 2
    if persistence == "transient":
        assert len(cells) > 2 * len(first)
    else:
        assert cells == first, len(cells)


@pytest.mark.parametrize("persistence", ["transient", "permanent"])
def test_a_rate_striking_one_element_twice_makes_one_event_with_both_bits(persistence):
    """Two bits of a rate landing in one element made two events, each naming one bit with
    both flips in its patterns: the element counted twice, each bit misstated. A held cell
    struck again names the bits it holds; its patterns show those the update had changed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, bias=False)
    fault = FaultConfig(site="weight", model="bitflip", ber=0.03, persistence=persistence,
                        ranks=(0,), steps=(0, 1, 2, 3), tensor="*")  # fmt: skip
    log = EventLog(0, 0)
    injector = FaultInjector(fault, 0, RankInfo(0, 1, 1), log, model)
    for step in range(4):
        with torch.no_grad():
            model.weight.mul_(0.5)  # the update: an exponent moves, a held bit may change
        injector.on_update(step, model)
    struck = [e for e in log.events if isinstance(e, ElementInject)]
    assert any(len(e.bits) > 1 for e in struck)
    for step in {e.step for e in struck}:
        indices = [e.index for e in struck if e.step == step]
        assert len(indices) == len(set(indices)), step
    for e in struck:
        flipped, named = int(e.old_bits, 16) ^ int(e.new_bits, 16), sum(1 << b for b in e.bits)
        if persistence == "transient" or e.step == struck[0].step:
            assert flipped == named, e
        else:
            assert flipped & ~named == 0, e


@pytest.mark.parametrize(("persistence", "strikes"), [("transient", 1), ("permanent", 3)])
def test_a_transient_gather_fault_strikes_the_first_of_a_steps_gathers(persistence, strikes):
    """Each micro-batch's forward gathers a group's weights again: a transient fault struck
    every one of them (k strikes recorded for one), a persisting one strikes each."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fault = FaultConfig(site="gather", model="scale", factor=10.0, persistence=persistence,
                        ranks=(0,), steps=(1,), tensor="*")  # fmt: skip
    log = EventLog(0, 0)
    injector = FaultInjector(fault, 0, RankInfo(0, 1, 1), log, model)
    for _ in range(3):  # three micro-batches' forwards of step 1
        gathered = [(n, p.detach().clone()) for n, p in model.named_parameters()]
        buffer = torch.cat([t.view(-1) for _, t in gathered])
        injector.on_gathered(1, Bucket(0, buffer, gathered, is_last=True))
    assert len([e for e in log.events if isinstance(e, ElementInject)]) == strikes


def test_largest_at_activation_strikes_its_elements_in_one_module_drawn_from_the_seed():
    """The module holding the largest output is unknown before the forward: one module is drawn
    up front, as for random select, and only its largest outputs are struck."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    fault = FaultConfig(
        site="activation", model="value", value="zero", select="largest", elements=2,
        ranks=(0,), steps=(0,), tensor="*",
    )  # fmt: skip
    outputs = {"0": torch.tensor([1.0, -5.0, 2.0, 0.5]), "1": torch.tensor([1.0, 0.0, 2.0, 0.5]),
               "2": torch.tensor([9.0, -3.0])}  # fmt: skip
    modules = set()
    for seed in range(8):
        log = EventLog(0, 0)
        injector = FaultInjector(fault, seed, RankInfo(0, 1, 1), log, model)
        for name, output in outputs.items():
            injector.on_forward(0, name, output.clone())
        assert len(log.events) == 2 and len({e.tensor for e in log.events}) == 1, log.events
        module = log.events[0].tensor
        top = sorted(outputs[module].abs().tolist(), reverse=True)[:2]
        assert sorted((abs(e.old) for e in log.events), reverse=True) == top
        modules.add(module)
    assert len(modules) > 1, "the module is drawn from the seed"


def test_a_sharded_fault_draws_its_tensor_among_those_this_ranks_shard_holds():
    """FSDP's last ranks may hold nothing of a short parameter: the tensor is drawn among those
    with elements in this rank's shard, so the fault always strikes."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    held = {"0.weight": 4, "0.bias": 1, "1.weight": 0, "1.bias": 0}  # this rank's dim-0 rows

    def shard(name: str, p: torch.Tensor) -> torch.Tensor:
        return p.detach()[: held[name]]

    params = dict(model.named_parameters())
    fault = FaultConfig(
        site="weight", model="value", value=7.0, ranks=(0,), steps=(0,), tensor="*.bias"
    )
    with patch("injectors.sites.is_dtensor", return_value=True), patch(
        "injectors.sites.local", side_effect=lambda p: shard(next(
            n for n, q in params.items() if q is p), p)
    ):  # fmt: skip
        for seed in range(8):
            log = EventLog(0, 0)
            injector = FaultInjector(fault, seed, RankInfo(0, 1, 1), log, model)
            injector.inject(0, [(n, shard(n, p).clone()) for n, p in params.items()])
            assert [(e.tensor, e.fired) for e in log.events] == [("0.bias", True)], seed


def _strikes(fault: FaultConfig, steps: range, seed: int = 0) -> list:
    """The inject events of `fault` on a small model's weights over `steps`, its weights
    restored before each strike, as training would move them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    log = EventLog(0, 0)
    injector = FaultInjector(fault, seed, RankInfo(0, 1, 1), log, model)
    start = [p.detach().clone() for p in model.parameters()]
    for step in steps:
        with torch.no_grad():
            for p, p0 in zip(model.parameters(), start, strict=True):
                p.copy_(p0)
        injector.on_update(step, model)
    return [replace(e, time=0.0) for e in log.events]


@pytest.mark.parametrize(("model", "bit", "persistence"), [
    ("bitflip", "exponent", "permanent"),
    ("bitflip", None, "intermittent"),
    ("stuck", "mantissa", "permanent"),
    ("stuck", None, "intermittent"),
])  # fmt: skip
def test_a_persistent_fault_breaks_the_same_bits_of_its_elements_at_every_strike(
    model, bit, persistence
):
    fault = FaultConfig(
        site="weight", model=model, bit=bit, stuck_at=1, persistence=persistence,
        probability=0.6, elements=3, ranks=(0,), steps=(1,), tensor="*",
    )  # fmt: skip
    struck = _strikes(fault, range(12))
    assert len({e.step for e in struck}) >= 3
    by_element = defaultdict(set)
    for e in struck:
        by_element[(e.tensor, e.index)].add(tuple(e.bits))
    assert len(by_element) == 3 and all(len(b) == 1 for b in by_element.values()), by_element
    assert _strikes(fault, range(12)) == struck, "the same seed gives the same strikes"


def test_a_persistent_fault_with_extra_bits_flips_the_same_set_every_time():
    fault = FaultConfig(
        site="weight", model="bitflip", bit="mantissa", nbits=3, adjacent=False,
        persistence="permanent", ranks=(0,), steps=(0,), tensor="*",
    )  # fmt: skip
    struck = _strikes(fault, range(4))
    assert len(struck) == 4 and len({tuple(e.bits) for e in struck}) == 1


def test_a_persisting_fault_of_values_strikes_carried_over_state_again_at_each_step():
    """Not a fault of bits, nothing to hold: at weight, whose state carries over, a permanent
    x10 strikes what the last strike left (x100 after two steps, as a faulty read-modify-write
    would make it), and a permanent swap exchanges the same pair again, so alternate strikes
    restore the order (docs/configuration.md)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    flat = model.weight.detach().view(-1)
    start = flat.clone()
    for kind, settings in (("scale", {"factor": 10.0}), ("swap", {})):
        with torch.no_grad():
            flat.copy_(start)
        fault = FaultConfig(site="weight", model=kind, persistence="permanent", ranks=(0,),
                            steps=(1,), tensor="weight", index=3, **settings)  # fmt: skip
        log = EventLog(0, 0)
        injector = FaultInjector(fault, 0, RankInfo(0, 1, 1), log, model)
        seen = []
        for step in range(1, 4):
            injector.on_update(step, model)
            seen.append(flat.clone())
        if kind == "scale":
            assert [float(w[3] / start[3]) for w in seen] == pytest.approx([10, 100, 1000])
        else:
            other = next(e.index for e in log.events if e.index != 3)
            assert [(float(w[3]), float(w[other])) for w in seen] == [
                (float(start[other]), float(start[3])),
                (float(start[3]), float(start[other])),
                (float(start[other]), float(start[3])),
            ]


@pytest.mark.parametrize(("site", "persistence"), [
    ("weight", "permanent"), ("optimizer", "intermittent"),
])  # fmt: skip
def test_a_persisting_flip_of_carried_over_state_holds_its_bits(site, persistence):
    """Weights and moments carry over from step to step: a second XOR of the bits a broken cell
    flipped would flip them back (bit 30 of a weight read -1.2e38, then -0.35, then -1.2e38).
    From its first strike the fault holds them, a strike after the update setting back only
    what the update changed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()  # the moments exist
    fault = FaultConfig(
        site=site, model="bitflip", bit=29, persistence=persistence, probability=0.7,
        ranks=(0,), steps=(1,), tensor="weight*", index=3,
    )  # fmt: skip
    log = EventLog(0, 0)
    injector = FaultInjector(fault, 0, RankInfo(0, 1, 1), log, model)
    state = model.weight if site == "weight" else optimizer.state[model.weight]["exp_avg"]
    held = []
    for step in range(1, 8):
        with torch.no_grad():
            state.mul_(1.000001)  # the update moves the low bits, not bit 29
        if site == "weight":
            injector.on_update(step, model)
        else:
            injector.on_optimizer_state(step, optimizer)
        held.append(bits.pattern(state.detach().view(-1), 3) >> 29 & 1)
    (struck,) = [e for e in log.events if e.fired]  # held since: no later strike changes it
    assert len({e.step for e in log.events}) >= 3, log.events
    after = held[struck.step - 1 :]
    assert after == [after[0]] * len(after) and held[: struck.step - 1] != after[:1], held


def test_a_transient_fault_still_draws_each_strike_anew():
    fault = FaultConfig(
        site="weight", model="bitflip", bit="mantissa", steps=(0, 1, 2, 3, 4, 5),
        ranks=(0,), tensor="*",
    )  # fmt: skip
    assert len({e.bit for e in _strikes(fault, range(6))}) > 1


@pytest.mark.parametrize("action", ["raise", "exit"])
def test_a_crash_keeps_its_strike_before_it_takes_the_rank_down(tmp_path, action):
    """A crashed rank returns no events: its strike must be kept before the crash acts, or its
    row says the fault never struck."""
    model = torch.nn.Linear(2, 2)
    log = EventLog(1, 1)
    kept = tmp_path / "rank1.last_words.jsonl"
    fault = FaultConfig(site="weight", model="crash", value=action, ranks=(1,), steps=(3,))
    keep = partial(last_words.keep, kept, log.events)
    injector = FaultInjector(fault, 0, RankInfo(1, 2, 1), log, model, keep=keep)
    with pytest.raises(InjectedCrash) if action == "raise" else _exits():
        injector.on_update(3, model)
    (strike,) = last_words.read(tmp_path)
    assert (strike.step, strike.rank, strike.model, strike.fired) == (3, 1, "crash", True)


@contextlib.contextmanager
def _exits():
    """os._exit, caught: the crash's own exit, stopped short of ending the test."""
    with patch("os._exit", side_effect=SystemExit) as exit_, pytest.raises(SystemExit):
        yield
    exit_.assert_called_once_with(0)


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
    results.put(_scaled_once(rank))
    shutdown()


def _scaled_once(rank: int) -> tuple[int, float, list]:
    """Its own function, so that its DDP goes before the process group does (`shutdown`)."""
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
    return rank, float(w.weight.grad), [e.new for e in log.events]


def test_published_example_one_scaled_gradient_poisons_every_replica_alike(tmp_path):
    ctx = forked_ranks(tmp_path)
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


# The grouped, contribution and strided fault models and the matmul shapes, in one campaign
# shared by the tests below: each scenario on a different site, so one run covers them all.
NEW_MODELS = {
    "swap": "site:weight,model:swap,ranks:[1],steps:[3]",
    "burst": "site:grad,model:burst,burst_model:bitflip,bit:30,elements:4,ranks:[1],steps:[3]",
    "strided": "site:grad,model:burst,burst_model:scale,factor:1000,elements:3,stride:16,"
    "ranks:[1],steps:[3],tensor:fc2.weight",
    "drop": "site:allreduce,scope:reduction,model:drop,ranks:[2],steps:[3]",
    "duplicate": "site:allreduce,scope:reduction,model:duplicate,ranks:[2],steps:[3]",
    "stale": "site:allreduce,scope:reduction,model:stale,ranks:[2],steps:[3]",
    "matmul": "site:matmul,tensor:fc1,model:scale,factor:1000,ranks:[1],steps:[3]",
    "matmul_backward": "site:matmul,tensor:fc2,phase:backward,model:value,value:max,"
    "ranks:[1],steps:[3]",
    "riders": "site:allreduce,scope:reduction,tensor:riders,model:value,value:1e6,"
    "ranks:[0],steps:[3]",
    "unit": "site:matmul,model:defective_unit,persistence:permanent,rate:0.5,lanes:4,lane:1,"
    "bit:exponent_msb,ranks:[1],steps:[3]",
}
NEW_DETECTORS = "[nan_inf,allreduce_sketch,grad_stats,weight_consensus]"


@pytest.fixture(scope="module")
def new_models(tmp_path_factory) -> tuple[dict[str, dict], dict[str, list[dict]], list[dict]]:
    """(row, inject events, alerts) per scenario name of NEW_MODELS."""
    tmp = tmp_path_factory.mktemp("new_models")
    listed = ",".join("{" + s + "}" for s in NEW_MODELS.values())
    run_here(
        "workload.steps=8", "campaign.seeds=1", "campaign.noise_seeds=2",
        f"detectors={NEW_DETECTORS}", "detectors.weight_consensus.interval=1",
        f"campaign.scenarios=[{listed}]", f"out={tmp / 'run'}", cwd=tmp,
    )  # fmt: skip
    out = tmp / "run"
    table = dict(zip(NEW_MODELS, rows(out), strict=True))
    injected = _by_trial(out)
    alerts = [e for e in events(out) if e["kind"] == "alert"]
    return (
        table,
        {name: injected[row["trial_id"]] for name, row in table.items()},
        {
            name: [a for a in alerts if a["trial_id"] == row["trial_id"]]
            for name, row in table.items()
        },
    )


def test_swap_and_bursts_change_exactly_the_recorded_elements(new_models):
    _, injected, _ = new_models
    a, b = injected["swap"]
    assert a["tensor"] == b["tensor"] and a["index"] != b["index"] and a["rank"] == 1
    assert (a["old_bits"], a["new_bits"]) == (b["new_bits"], b["old_bits"])
    burst = injected["burst"]
    first = burst[0]["index"]
    assert [e["index"] for e in burst] == list(range(first, first + 4))
    assert len({e["tensor"] for e in burst}) == 1
    assert all(int(e["old_bits"], 16) ^ int(e["new_bits"], 16) == 1 << 30 for e in burst)
    strided = injected["strided"]
    first = strided[0]["index"]
    assert [e["index"] for e in strided] == [first, first + 16, first + 32]
    assert all(math.isclose(e["new"], e["old"] * 1000, rel_tol=1e-6) for e in strided)


def test_contribution_faults_record_what_the_rank_sent(new_models):
    table, injected, _ = new_models
    for name in ("drop", "duplicate", "stale"):
        records = injected[name]
        assert {e["rank"] for e in records} == {2} and {e["step"] for e in records} == {3}
        assert all(e["riders"] and e["changed"] > 0 for e in records), name
        # Every receiver got the same wrong sum: the replicas still agree with each other.
        assert table[name]["replicas_agree"] == "True" and table[name]["golden_match"] == "False"
    assert all(e["new_norm"] == 0 for e in injected["drop"])
    assert all(
        math.isclose(e["new_norm"], 2 * e["old_norm"], rel_tol=1e-12) for e in injected["duplicate"]
    )
    assert all(e["from_step"] == 2 and e["new_norm"] != e["old_norm"] for e in injected["stale"])


def test_matmul_faults_strike_the_chosen_module_in_the_chosen_pass(new_models):
    table, injected, _ = new_models
    (forward,) = injected["matmul"]
    # Each names its product (fault.product, 1 here): what a schedule needs to strike it again.
    assert (forward["tensor"], forward["phase"], forward["product"]) == ("fc1", "forward", 1)
    assert math.isclose(forward["new"], forward["old"] * 1000, rel_tol=1e-6)
    (backward,) = injected["matmul_backward"]
    assert (backward["tensor"], backward["phase"], backward["product"]) == ("fc2", "backward", 1)
    assert backward["new_bits"] == "0x7f7fffff"
    # fc2's weight gradient (256 x 256) is what the backward matmul computed.
    assert 0 <= backward["index"] < 256 * 256
    assert table["matmul_backward"]["golden_match"] == "False"


def test_a_defective_unit_strikes_products_of_its_rank_from_its_step_as_recorded(new_models):
    """Through the real world: one event per struck product, on rank 1 from step 3 on, each
    with the lane and the output's norms; the row takes its first step and the unit's bit."""
    table, injected, _ = new_models
    struck = injected["unit"]
    assert struck and {e["rank"] for e in struck} == {1} and min(e["step"] for e in struck) == 3
    assert {(e["lane"], e["lanes"], e["bit"], e["phase"]) for e in struck} == {
        (1, 4, 30, "forward")
    }
    # The top exponent bit makes the lane huge or infinite; later products may start non-finite.
    assert all(e["elements"] > 0 for e in struck) and struck[0]["new_norm"] != struck[0]["old_norm"]
    row = table["unit"]
    assert (row["fired"], row["inject_step"], row["injected_ranks"], row["bit"]) == (
        "True", "3", "1", "30")  # fmt: skip


def test_the_rider_region_is_a_target_of_the_reduction(new_models):
    table, injected, _ = new_models
    records = injected["riders"]
    assert {e["rank"] for e in records} == {0, 1, 2, 3}
    assert {(e["tensor"], e["index"], e["new"]) for e in records} == {
        ("riders", records[0]["index"], 1e6)
    }


def _reduction_faults(rank: int, store: str, results) -> None:
    """One parameter, local gradients 0.2, 0.4, 0.3 at step 0 and 0.5, 0.6, 0.7 at step 1 on
    ranks 0, 1, 2; rank 1 drops, duplicates or re-sends its contribution at step 1."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=3,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    torch.set_num_threads(1)
    for model in ("drop", "duplicate", "stale"):
        results.put((model, rank, *_two_steps(rank, model)))
    shutdown()


def _two_steps(rank: int, model: str) -> tuple[float, int]:
    """Its own function, so that its DDP goes before the process group does (`shutdown`)."""
    w = torch.nn.Linear(1, 1, bias=False)
    w.weight.data.fill_(1.0)
    fault = FaultConfig(site="allreduce", scope="reduction", model=model, ranks=(1,), steps=(1,))
    log = EventLog(rank, rank)
    state = HookState(PluginBus([FaultInjector(fault, 0, RankInfo(rank, 3, 1), log, w)]), w, 3)
    ddp = DDP(w)
    ddp.register_comm_hook(state, comm_hook)
    for step, grads in enumerate(((0.2, 0.4, 0.3), (0.5, 0.6, 0.7))):
        state.step = step
        w.zero_grad()
        ddp(torch.tensor([[grads[rank]]])).sum().backward()
    return float(w.weight.grad), len(log.events)


def test_contribution_faults_make_the_sum_they_name(tmp_path):
    ctx = forked_ranks(tmp_path)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_reduction_faults, args=(r, str(tmp_path / "store"), results))
        for r in range(3)
    ]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in range(9)]
    for p in procs:
        p.join(timeout=30)
    expected = {"drop": (0.5 + 0.7) / 3, "duplicate": (0.5 + 1.2 + 0.7) / 3,
                "stale": (0.5 + 0.4 + 0.7) / 3}  # fmt: skip
    for model, rank, grad, n_events in got:
        assert math.isclose(grad, expected[model], rel_tol=1e-6), (model, rank, grad)
        assert n_events == (1 if rank == 1 else 0), (model, rank)


@pytest.mark.parametrize(
    ("scenario", "key", "allowed"),
    [
        ({"model": "burst", "site": "grad", "elements": 4}, "burst_model", "bitflip, scale"),
        ({"model": "burst", "site": "grad", "burst_model": "bitflip"}, "elements", "2 or more"),
        ({"model": "bitflip", "site": "grad", "stride": 4}, "stride", "only model burst"),
        (
            {
                "model": "burst",
                "site": "grad",
                "burst_model": "scale",
                "elements": 2,
                "factor": 2.0,
                "stride": 0,
            },
            "stride",
            "1..inf",
        ),
        (
            {"model": "scale", "factor": 2.0, "site": "grad", "phase": "backward"},
            "phase",
            "only site matmul",
        ),
        (
            {"model": "scale", "factor": 2.0, "site": "matmul", "phase": "sideways"},
            "phase",
            "allowed: forward, backward",
        ),
        ({"model": "drop", "site": "grad"}, "model", "site allreduce and scope reduction"),
        ({"model": "drop", "site": "allreduce", "scope": "rank"}, "model", "scope reduction"),
        (
            {"model": "stale", "site": "allreduce", "scope": "reduction", "steps": [0]},
            "steps",
            ">= 1",
        ),
        ({"model": "swap", "site": "weight", "select": "largest"}, "select", "its own group"),
        ({"model": "swap", "site": "weight", "elements": 3}, "elements", "exactly two"),
        (
            {"model": "scale", "factor": 2.0, "site": "matmul", "tensor": "act"},
            "tensor",
            "matches nothing at site matmul",
        ),
    ],  # fmt: skip
)
def test_bad_new_fault_keys_are_refused(scenario, key, allowed):
    raw = {"ranks": [1], "steps": [3], **scenario}
    listed = "{" + ",".join(f"{k}:{_yaml(v)}" for k, v in raw.items()) + "}"
    with pytest.raises(ConfigError) as error:
        compose_run(f"campaign.scenarios=[{listed}]")
    assert error.value.key == f"campaign.scenarios[0].{key}" and allowed in str(error.value)


def _yaml(value) -> str:
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


def test_a_bad_burst_exits_2_with_one_line(tmp_path):
    proc = sdc_bench(
        "campaign=single", "fault.site=grad", "fault.model=burst", "fault.elements=3",
        "fault.burst_model=stuck", "fault.ranks=[1]", "fault.steps=[2]", f"out={tmp_path / 'o'}",
        cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "fault.burst_model" in proc.stderr and "allowed: bitflip, scale, value" in proc.stderr


def test_each_new_fault_is_caught_in_its_step_naming_the_right_rank(new_models):
    """Each is caught by one of our checks in the step it can first be
    seen: a weight swap and a gradient burst name the rank; a reduction fault is flagged on
    every rank, which (the tags being per rank) also name the contribution that was wrong."""
    table, _, alerts = new_models
    # (The strided x1000 burst of three gradient elements is too small for grad_stats' norms;
    # off an audit step nothing of ours looks at a local gradient's values.)
    for name in ("swap", "burst", "matmul_backward"):
        row = table[name]
        assert row["detect_step"] == "3" and row["suspect_ranks"] == "1", (name, row)
        assert row["attribution_correct"] == "True"
    assert table["swap"]["first_detector"] == "weight_consensus"
    verdicts = {"drop": "missing from the sum", "duplicate": "counted twice",
                "stale": "from the previous step"}  # fmt: skip
    for name, verdict in verdicts.items():
        sketch = [a for a in alerts[name] if a["detector"] == "allreduce_sketch"]
        assert {a["rank"] for a in sketch} == {0, 1, 2, 3}, name
        assert all(a["step"] == 3 and a["suspect_ranks"] == [2] for a in sketch), name
        assert all(a["evidence"]["tags"] == {"2": verdict} for a in sketch), name
    riders = [a for a in alerts["riders"] if a["detector"] == "allreduce_sketch"]
    assert {a["rank"] for a in riders} == {0, 1, 2, 3} and {a["step"] for a in riders} == {3}


@pytest.mark.parametrize(
    ("workload", "module", "phase"),
    [
        (["workload=mlp"], "fc1", "forward"),
        (["workload=mlp"], "fc1", "backward"),
        # 1.7 MB of gradients, its products in bfloat16 under autocast.
        (["workload=gpt", "workload.precision=bf16-mixed"], "blocks.0.fc", "forward"),
        # The transformers Llama with the LLM recipe (dropout, clipping, bf16-mixed).
        (["workload=llama"], "model.layers.0.mlp.up_proj", "backward"),
    ],
)
def test_a_scheduled_product_strikes_at_its_step_and_module(workload, module, phase):
    """A schedule draws no module, and the products' site watched only the one drawn: a
    scheduled matmul fault was accepted and never struck (fired False)."""
    run = compose_run(
        "campaign=single", *workload, "topology.nodes=1", "fault.site=matmul",
        "fault.model=bitflip", "fault.bit=null", f"fault.phase={phase}",
        f"fault.schedule=[{{step:1,rank:0,tensor:{module},index:0,bit:14}}]",
    )  # fmt: skip
    rank = Rank(run, run.scenarios[0], seed=0)
    for step in range(3):
        rank.train(step)
    struck = [e for e in rank.log.events if isinstance(e, ElementInject)]
    assert [(e.step, e.tensor, e.index, e.bit, e.fired) for e in struck] == [
        (1, module, 0, 14, True)
    ]


def test_a_rider_fault_strikes_the_index_and_bucket_it_names():
    """`fault.index` in the rider region was ignored (an element drawn from the seed, the row
    saying the index), and `fault.bucket` too (every chunk's region struck)."""
    model = torch.nn.Linear(2, 2)
    fault = FaultConfig(site="allreduce", scope="rank", model="value", value=1e6, tensor="riders",
                        index=5, elements=2, bucket=1, ranks=(0,), steps=(0,))  # fmt: skip
    log = EventLog(0, 0)
    injector = FaultInjector(fault, 0, RankInfo(0, 1, 1), log, model)
    regions = [torch.zeros(12) for _ in range(3)]
    for i, region in enumerate(regions):
        bucket = Bucket(i, torch.zeros(4), [], i == 2, rider_region=region)
        injector.on_reduced_grad(0, bucket)
    assert [r.nonzero().flatten().tolist() for r in regions] == [[], [5, 6], []]
    struck = [e for e in log.events if isinstance(e, ElementInject)]
    assert sorted(e.index for e in struck) == [5, 6]
