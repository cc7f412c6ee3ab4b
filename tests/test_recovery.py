"""Recovery: stop, quarantine, roll back, resume; and prove the result is a fault-free one."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from harness.campaign.recovery import loop_verdict, restore_point, run_with_recovery
from harness.config.schema import FaultConfig, Segment, TopologyConfig, TrialSpec
from harness.core.events import Alert, CorruptCheckpoint, ElementInject
from harness.results.schema import RankResult, TrialResult
from harness.runtime import checkpoint
from tests.conftest import compose_run, events, rows

# Audits at steps 0, 5, 10; checkpoints (each after a consensus) after steps 1, 3, 5, ...
BASE = [
    "recovery.enabled=true",
    "workload.steps=12",
    "campaign.seeds=1",
    "campaign.noise_seeds=3",
    "checkpoint.interval=2",
    "detectors=[replay,allreduce_sketch,weight_consensus]",
    "detectors.replay.interval=5",
    "detectors.weight_consensus.interval=2",
]


def _campaign(tmp_path, run_ok, *args: str, scenarios: list[str]):
    listed = ",".join("{" + s + "}" for s in scenarios)
    out = tmp_path / "run"
    run_ok(*BASE, *args, f"campaign.scenarios=[{listed}]", f"out={out}", cwd=tmp_path)
    return out, rows(out)


def test_with_a_spare_a_caught_fault_ends_bit_identical_to_the_golden_run(tmp_path, run_ok):
    out, table = _campaign(
        tmp_path,
        run_ok,
        "topology.spares=1",
        scenarios=[
            "site:grad,model:scale,factor:1000,ranks:[1],steps:[5]",
            "site:allreduce,model:scale,factor:1000,scope:rank,ranks:[2],steps:[6]",
            "site:weight,model:scale,factor:1000,ranks:[3],steps:[5]",
        ],
    )
    caught_by = [r["first_detector"] for r in table]
    assert caught_by == ["replay", "allreduce_sketch", "weight_consensus"]
    assert [r["quarantined_nodes"] for r in table] == ["1", "2", "3"]
    for row in table:
        assert row["recovered"] == "True" and row["recoveries"] == "1"
        assert row["final_nodes"] == "4", "the spare took the quarantined node's place"
        # The recovered run is the golden one bit for bit; the effect describes the fault,
        # judged on the same trial with every check observing.
        assert row["golden_match"] == "True" and row["recovered"] == "True"
        assert row["effect_from"] == "observe twin" and row["effect"] != "masked"
    # Restore points: replay vouched for step 0's weights and computation only (so from the
    # start); the sketch, alarming at step 6 (on a NaN contribution too), not for the weights
    # step 5's update left nor the moments step 4's did (checkpoint after step 3); consensus
    # last saw the weights agree after step 3, not its moments (checkpoint after step 1).
    assert [r["restore_step"] for r in table] == ["-1", "3", "1"]
    stops = [json.loads(line) for line in (out / "events.jsonl").open()]
    assert {e["step"] for e in stops if e["kind"] == "stop"} == {5, 6}
    # The quarantined node's local scratch was wiped; checkpoints live off the node.
    assert not (out / "nodes" / "node1").exists() and (out / "nodes" / "node0").exists()


def test_with_a_spare_recovery_on_a_model_over_one_mib_ends_bit_identical(tmp_path, run_ok):
    """gpt's gradients span two reduction chunks: the recovered segment reduces every step in
    the layout the golden run did (harness/runtime/comm.py)."""
    out, (row, reduction) = _campaign(
        tmp_path,
        run_ok,
        "topology.spares=1",
        "workload=gpt",
        "workload.micro_batch_size=8",
        "workload.context=32",
        "campaign.noise_seeds=2",  # no band is read: one golden run of gpt fewer
        scenarios=[
            "site:grad,model:scale,factor:1000,ranks:[1],steps:[5]",
            "site:allreduce,model:scale,factor:1000,scope:reduction,ranks:[2],steps:[5],"
            "persistence:permanent",
        ],
    )
    assert row["first_detector"] == "replay" and row["quarantined_nodes"] == "1"
    assert row["recovered"] == "True" and row["golden_match"] == "True"
    # A permanent fault of node 2's reduction: located by sub-group reductions of both chunks,
    # where it strikes the same element as in the full one; node 2 alone is quarantined.
    assert reduction["first_detector"] == "allreduce_sketch"
    assert reduction["quarantined_nodes"] == "2" and reduction["final_nodes"] == "4"
    assert reduction["recovered"] == "True" and reduction["golden_match"] == "True"
    struck = [e for e in events(out) if e["kind"] == "inject" and e["trial_id"][:3] == "001"]
    assert len({(e["tensor"], e["index"]) for e in struck}) == 1
    assert {tuple(e["group"]) for e in struck if "group" in e} == {(0, 1, 2), (0, 2, 3), (1, 2, 3)}


def test_without_a_spare_the_world_shrinks_and_the_loss_stays_in_the_noise_band(tmp_path, run_ok):
    out, (row,) = _campaign(
        tmp_path, run_ok, scenarios=["site:grad,model:scale,factor:1000,ranks:[1],steps:[5]"]
    )
    assert row["recovered"] == "True" and row["quarantined_nodes"] == "1"
    assert row["final_nodes"] == "3"
    assert abs(float(row["final_loss"]) - float(row["golden_final_loss"])) <= float(
        row["noise_band"]
    )
    assert row["effect_from"] == "observe twin"
    report = (out / "report.md").read_text()
    assert "## Recovery" in report and "3 nodes (shrunk)" in report


def test_the_loop_limit_after_rollbacks_that_replaced_nothing_blames_no_data_or_code():
    """A permanent NaN in one FSDP weight: nan_inf names every node at step 7, so the stop is
    rolled back without quarantine; struck again there, with recovery.max_recoveries 1 the
    trial ends. Its verdict read "alarms after every recovery, on replaced hardware: the fault
    is in the data or the code, not a node", where nothing was replaced and the fault is one
    node's."""
    stops = [(7, (0, 1, 2, 3)), (7, (0, 1, 2, 3))]
    verdict = loop_verdict(stops, quarantined=[])
    assert verdict == (
        "step 7 alarms again after 1 rollback(s) that replaced no node, and "
        "recovery.max_recoveries allows no more: its suspects (node 0, 1, 2, 3) were not "
        "quarantined"
    )
    assert "data or the code" in loop_verdict(stops, quarantined=[1])
    assert loop_verdict([(4, ()), (4, ())], []).endswith("allows no more: none named")


def test_a_fault_that_follows_the_data_ends_with_the_verdict_not_a_loop(tmp_path, run_ok):
    out, (row,) = _campaign(
        tmp_path,
        run_ok,
        "topology.spares=1",
        "recovery.max_recoveries=2",
        scenarios=["site:grad,model:scale,factor:1000,ranks:[1],steps:[5],follows:data"],
    )
    assert row["recovered"] == "False" and row["recoveries"] == "2"
    # Node 1 onto the spare, then the spare (struck in its turn) out of a world of three: the
    # data, and the fault with it, moved to rank 0. The first alert named rank 1, the rank struck
    # when it came; judged against every segment's struck ranks it read as a wrong attribution.
    assert row["quarantined_nodes"] == "1;4" and row["injected_ranks"] == "0;1"
    assert row["suspect_ranks"] == "1" and row["attribution_correct"] == "True"
    assert "step 5 alarms after every recovery" in row["recovery_verdict"]
    assert "data or the code" in row["recovery_verdict"]
    # The verdict ended it on a stopped segment, whose events are written once, with its
    # segment's number (they were written again without it, as the final run's).
    written = [e for e in events(out) if e["kind"] in ("alert", "inject", "stop")]
    once = {(e["kind"], e["step"], e.get("rank"), e["time"]) for e in written}
    assert len(written) == len(once), "an event written twice"
    assert {e.get("segment") for e in written} == {0, 1, 2}


# A NaN in rank 3's gradient at step 6, in rank 0's weights from step 5's update, and in rank
# 0's Adam moments after step 5.
NANS = {
    "gradient": "{site:grad,model:value,value:nan,ranks:[3],steps:[6]}",
    "weight": "{site:weight,model:value,value:nan,ranks:[0],steps:[5]}",
    "moment": "{site:optimizer,model:value,value:nan,ranks:[0],steps:[5]}",
}


@pytest.mark.parametrize(
    ("workload", "faults"),
    [
        # Over 1 MiB of gradients (two reduction chunks), its products in bfloat16.
        (("workload=gpt", "workload.micro_batch_size=8", "workload.context=32",
          "workload.precision=bf16-mixed"), ("gradient", "weight", "moment")),
        # The transformers Llama with the LLM recipe (bf16-mixed, clipping, warmup and cosine):
        # the gradient's, whose suspects the sketch's alerts put in doubt. In the slow set (18 s):
        # the default run keeps the gpt world above, in bfloat16 over 1 MiB.
        pytest.param(("workload=llama",), ("gradient",), marks=pytest.mark.slow),
    ],
    ids=["gpt-bf16-mixed", "llama"],
)  # fmt: skip
def test_a_nan_one_rank_contributed_quarantines_that_rank_not_those_the_sketch_names(
    tmp_path, run_ok, workload, faults
):
    """nan_inf names rank 3 in its local gradient; the sketch, after the reduction, named every
    rank (each received the NaN; it now names the sender, from its slot). Recovery took every
    alert's suspects: it quarantined nodes
    0, 1 and 2, and with node 3 left alone ended with "no healthy node left to run on".
    And a NaN written into rank 0's weights by step 5's update shows in step 6's gradients,
    after step 5's checkpoint was written with it: recovery restored that checkpoint, every
    rank alarmed again, and every node was quarantined. It now restores the one before; so
    for a NaN in rank 0's Adam moments after step 5, which shows at step 7."""
    out = tmp_path / "run"
    scenarios = ",".join(NANS[f] for f in faults)
    run_ok(*[a for a in BASE if not a.startswith("detectors")], *workload, "topology.spares=1",
           "detectors=[nan_inf,allreduce_sketch]", f"campaign.scenarios=[{scenarios}]",
           f"out={out}", cwd=tmp_path)  # fmt: skip
    got = dict(zip(faults, rows(out), strict=True))
    gradient = got["gradient"]
    assert gradient["first_detector"] == "nan_inf" and gradient["suspect_ranks"] == "3"
    sketch = [
        e for e in events(out)
        if e["kind"] == "alert" and e["trial_id"] == gradient["trial_id"]
        and e["detector"] == "allreduce_sketch" and e["step"] == 6
    ]  # fmt: skip
    assert {e["rank"] for e in sketch} == {0, 1, 2, 3}, "every receiver alarms"
    assert all(e["suspect_ranks"] == [3] for e in sketch), "from the sender's slot"
    assert gradient["quarantined_nodes"] == "3" and gradient["restore_step"] == "3"
    if "weight" in got:
        weight = got["weight"]
        assert weight["first_detector"] == "nan_inf" and weight["detect_step"] == "6"
        assert weight["suspect_ranks"] == "0" and weight["quarantined_nodes"] == "0"
        assert weight["restore_step"] == "3", "step 5's checkpoint holds the NaN"
    if "moment" in got:  # it reaches the weights at step 6's update, the gradients at 7
        moment = got["moment"]
        assert moment["first_detector"] == "nan_inf" and moment["detect_step"] == "7"
        assert moment["quarantined_nodes"] == "0" and moment["restore_step"] == "3"
    for row in got.values():
        assert row["recovered"] == "True" and row["recoveries"] == "1", row
        assert row["final_nodes"] == "4" and row["golden_match"] == "True", row


def _stopping(world: int, suspects: list[int], calls: list[TopologyConfig]):
    """A world (in place of the real one: the loop's decisions are under test) whose every run
    stops at step 5 on an alert naming `suspects`, recording the topology each run was given."""

    def execute(run, spec) -> TrialResult:
        calls.append(run.topology)
        check = next(iter(run.detectors))
        alert = Alert(rank=0, node=0, time=1.0, step=5, detector=check, phase="pre_allreduce",
                      suspect_ranks=suspects, suspect_nodes=suspects, evidence={})  # fmt: skip
        return TrialResult([RankResult(spec.trial_id, r, [alert] if r == 0 else [],
                                       stopped_step=5) for r in range(world)])  # fmt: skip

    return execute


def _summed_wrong(world: int, receivers: list[int], repeats: bool, specs: list[TrialSpec]):
    """A world whose run strikes the reduction at step 2, unless the segment met the transient
    fault already (`Segment.unmet`, as the trainer's injector gets it) or it `repeats`; a
    struck run stops there on the sketch's alert after the reduction, naming `receivers`."""

    def execute(run, spec) -> TrialResult:
        specs.append(spec)
        fault = spec.segment.unmet(spec.fault) if spec.segment else spec.fault
        if 2 not in fault.steps and not repeats:
            return TrialResult([RankResult(spec.trial_id, r, []) for r in range(world)])
        strikes = [ElementInject(rank=r, node=r // 2, time=0.5, step=2, site="allreduce",
                                 model="scale", tensor="w", index=0, bit=None, bits=None, old=1.0,
                                 new=1000.0, old_bits="", new_bits="", fired=True)
                   for r in receivers]  # fmt: skip
        alert = Alert(rank=1, node=0, time=1.0, step=2, detector="allreduce_sketch",
                      phase="post_allreduce", suspect_ranks=receivers, suspect_nodes=[],
                      evidence={})  # fmt: skip
        return TrialResult([RankResult(spec.trial_id, r, [*strikes, alert] if r == 1 else [],
                                       stopped_step=2) for r in range(world)])  # fmt: skip

    return execute


@pytest.mark.parametrize("repeats", [False, True], ids=["transient", "repeating"])
def test_a_sharded_wrong_sum_no_node_explains_is_rolled_back_to_before_any_quarantine(
    tmp_path, repeats
):
    """Under hsdp a broken reduction's receivers are one rank per replica group: the sketch
    names ranks 1, 3 and 5, a rank on every node. They were quarantined at once, three nodes
    for two spares: the trial ended unrecovered. Rolled back to without quarantine first (as
    DDP re-runs the reduction in its step), a transient fault is not met again; a repeat gets
    its receivers quarantined, which two spares cannot cover."""
    run = compose_run("recovery.enabled=true", "campaign=single", "topology.parallel=hsdp",
                      "topology.shard_size=2", "topology.nodes=3", "topology.ranks_per_node=2",
                      "topology.spares=2", "recovery.max_recoveries=2",
                      "detectors=[allreduce_sketch]")  # fmt: skip
    fault = FaultConfig(site="allreduce", model="scale", factor=1000.0, scope="reduction",
                        ranks=(1,), steps=(2,))  # fmt: skip
    specs: list[TrialSpec] = []
    outcome = run_with_recovery(
        run, TrialSpec("t", 0, fault), _summed_wrong(6, [1, 3, 5], repeats, specs), tmp_path
    )
    recovery = outcome.recovery
    assert recovery.recoveries[0] == "rollback at step 2 to step -1", recovery.recoveries
    assert len(specs) == 2 and specs[1].segment.struck == (2,)
    assert specs[1].segment.hardware == tuple(range(6)), "every node where it was"
    if repeats:
        assert recovery.verdict.startswith("3 suspect nodes and 2 spare(s) left"), recovery
        assert recovery.quarantined == () and len(recovery.recoveries) == 1
    else:
        assert recovery.verdict is None and recovery.completed and recovery.quarantined == ()


def test_a_stop_naming_every_node_is_rolled_back_to_without_quarantine(tmp_path):
    """A check that cannot tell the ranks apart names all of them (a NaN in one FSDP optimizer
    shard reaches every rank's gathered weights): quarantined at once, every node was lost, and
    the trial ended "4 suspect nodes and 1 spare(s) left". Rolled back to without quarantine,
    the transient fault is not met again and the trial ends recovered, every node in place."""
    run = compose_run("recovery.enabled=true", "campaign=single", "topology.parallel=fsdp",
                      "topology.spares=1", "recovery.max_recoveries=1", "checkpoint.interval=2",
                      "detectors=[nan_inf]")  # fmt: skip
    fault = FaultConfig(site="optimizer", model="value", value="nan", ranks=(1,), steps=(3,))
    specs: list[TrialSpec] = []

    def execute(run, spec) -> TrialResult:
        specs.append(spec)
        if spec.segment is not None:  # the transient fault struck once in time: a clean run
            return TrialResult([RankResult(spec.trial_id, r) for r in range(4)])
        alert = Alert(rank=0, node=0, time=1.0, step=5, detector="nan_inf",
                      phase="pre_allreduce", suspect_ranks=[0, 1, 2, 3], suspect_nodes=[],
                      evidence={})  # fmt: skip
        return TrialResult([RankResult(spec.trial_id, r, [alert] if r == 0 else [],
                                       stopped_step=5) for r in range(4)])  # fmt: skip

    recovery = run_with_recovery(run, TrialSpec("t", 0, fault), execute, tmp_path).recovery
    assert recovery.recoveries == ["rollback at step 5 to step -1"], recovery.recoveries
    assert recovery.verdict is None and recovery.completed and recovery.quarantined == ()
    assert specs[1].segment.hardware == tuple(range(4)), "every node where it was"


def test_a_transient_fault_met_in_an_earlier_segment_is_not_met_again():
    """A recovery segment re-executes steps: a transient fault on hardware struck once in
    time; one that follows the data is met again (the data is what it was), and so is one
    that persists."""
    segment = Segment(0, "", (0, 1), ((0,), (1,)), struck=(2,))
    transient = FaultConfig(site="grad", model="scale", factor=10.0, ranks=(1,), steps=(2, 5))
    assert segment.unmet(transient).steps == (5,)
    schedule = ({"step": 2, "rank": 1, "tensor": "w", "index": 0},
                {"step": 5, "rank": 1, "tensor": "w", "index": 0})  # fmt: skip
    scheduled = FaultConfig(site="grad", model="scale", factor=10.0, schedule=schedule)
    assert [e["step"] for e in segment.unmet(scheduled).schedule] == [5]
    for kept in (
        FaultConfig(site="grad", model="scale", factor=10.0, ranks=(1,), steps=(2, 5),
                    follows="data"),
        FaultConfig(site="grad", model="scale", factor=10.0, ranks=(1,), steps=(2,),
                    persistence="permanent"),
    ):  # fmt: skip
        assert segment.unmet(kept) == kept


@pytest.mark.parametrize(
    ("overrides", "suspects", "runs", "verdict"),
    [
        # FSDP keeps its mesh: one spare for the one recovery allowed, two nodes suspected. The
        # world shrank to 3 nodes and hung in its first collective (a crash after the timeout).
        (("topology.parallel=fsdp", "topology.spares=1", "recovery.max_recoveries=1"), [1, 2],
         1, "2 suspect nodes and 1 spare(s) left: a sharded world keeps its size"),
        # Replay needs 3 nodes: the second recovery left 2, where its alerts named suspects
        # on grounds it does not have, and the loop went on to quarantine them.
        (("detectors=[replay]", "recovery.max_recoveries=3"), [1], 2,
         "2 node(s) left, too few for replay: replay needs at least 3 nodes"),
        # Every node suspected, no spare: rolled back to without quarantine first (no node to
        # lay the fault on), then, met again, nothing left to run on.
        (("recovery.max_recoveries=3",), [0, 1, 2, 3], 2, "no healthy node left to run on"),
    ],
    ids=["fsdp-without-a-spare", "ddp-below-replay", "every-node"],
)  # fmt: skip
def test_recovery_ends_with_a_verdict_where_the_world_left_cannot_run_the_trial(
    tmp_path, overrides, suspects, runs, verdict
):
    run = compose_run("recovery.enabled=true", "campaign=single", "detectors=[nan_inf]",
                      "checkpoint.interval=2", *overrides)  # fmt: skip
    calls: list[TopologyConfig] = []
    spec = TrialSpec("t", 0, FaultConfig())
    outcome = run_with_recovery(run, spec, _stopping(4, suspects, calls), tmp_path)
    assert len(calls) == runs and all(t.nodes >= 3 for t in calls), calls
    assert outcome.recovery.verdict.startswith(verdict), outcome.recovery.verdict
    # Decided before that recovery quarantines any node: only the earlier recoveries' are
    # (before, the sharded world lost one suspect before the verdict, and the world of four
    # suspects three), and a rollback that suspected every node quarantined none.
    plain = len(suspects) == 4
    assert len(outcome.recovery.quarantined) == runs - 1 - plain, outcome.recovery.quarantined


def test_a_corrupted_checkpoint_is_detected_and_an_older_verified_one_is_used(tmp_path):
    for step in (1, 3, 5):
        checkpoint.save(tmp_path / f"step_{step:06d}.pt", {"w": torch.full((4,), float(step))})
    newest = tmp_path / "step_000005.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    log: list[CorruptCheckpoint] = []
    step, path = restore_point(tmp_path, 6, log)
    assert step == 3 and torch.equal(checkpoint.load(tmp_path / path)["w"], torch.full((4,), 3.0))
    assert [type(e) for e in log] == [CorruptCheckpoint] and log[0].step == 5
    assert restore_point(tmp_path, 3, []) == (1, str(tmp_path / "step_000001.pt"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checksum_changed_out_of_its_text_is_a_corrupt_checkpoint_not_a_crash(tmp_path):
    """A checksum file, or a sharded checkpoint's list, whose bytes no longer decode or parse:
    the campaign died of a UnicodeDecodeError (a ValueError for a list line without its
    separator) in restore_point, and a golden store entry so damaged failed every campaign."""
    for step in (1, 3):
        checkpoint.save(tmp_path / f"step_{step:06d}.pt", {"w": torch.full((4,), float(step))})
    digest = tmp_path / "step_000003.pt.sha256"
    digest.write_bytes(bytes([digest.read_bytes()[0] ^ 0x80]) + digest.read_bytes()[1:])
    log: list[CorruptCheckpoint] = []
    assert restore_point(tmp_path, 6, log) == (1, str(tmp_path / "step_000001.pt"))
    assert [e.step for e in log] == [3]
    with pytest.raises(checkpoint.CorruptCheckpoint):
        checkpoint.load(tmp_path / "step_000003.pt")

    sharded = checkpoint.save_shards(tmp_path / "dcp" / "step_000005.pt", {"w": torch.ones(4)}, 0)
    assert checkpoint.verify(sharded)
    listed = (sharded / checkpoint.SHARDS).read_bytes()
    for damaged in (bytes([listed[0] ^ 0x80]) + listed[1:], listed.replace(b"  ", b" ")):
        (sharded / checkpoint.SHARDS).write_bytes(damaged)
        assert not checkpoint.verify(sharded)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_save_over_a_placed_snapshot_leaves_the_other_stores_files(tmp_path):
    """A fast-forwarded trial's store holds its golden run's snapshots by hard links (the
    golden store's too); a rollback segment saves the same step again. Into the folder, that
    save truncated and rewrote the shared files, the golden store's among them (a save cut
    short there left a half-written entry)."""
    golden, trial = tmp_path / "golden", tmp_path / "trial"
    source = checkpoint.save_shards(golden / "step_000007.pt", {"w": torch.ones(64)}, 0)
    trial.mkdir()
    checkpoint.place(source, trial)
    kept = {p.name: p.read_bytes() for p in source.iterdir()}
    again = checkpoint.save_shards(trial / "step_000007.pt", {"w": torch.full((64,), 2.0)}, 0)
    assert {p.name: p.read_bytes() for p in source.iterdir()} == kept
    assert checkpoint.verify(source) and checkpoint.verify(again)
    assert sorted(p.name for p in trial.iterdir()) == ["step_000007.dcp"]
    restored = {"w": torch.zeros(64)}
    dcp.load(restored, checkpoint_id=again)
    assert torch.equal(restored["w"], torch.full((64,), 2.0))


def test_a_wrong_reduction_is_re_run_and_a_repeating_one_quarantines_only_its_node(
    tmp_path, run_ok
):
    """A reduction fault that names no node (every rank alarms on the received sum)
    is re-run once from the local contributions kept before the collective: a transient one
    ends there, with no rollback, no quarantine, bit-identical to the golden run. A permanent
    one on node 1's reduction fails the repeat too; reductions in sub-groups that each leave
    one node out find that only the group without node 1 sums right (harness/runtime/locate.py), and
    node 1 alone is quarantined. A permanently stale contribution (its previous step's chunk,
    also on a repeat) is named by the sketch's tags and located alike."""
    out, table = _campaign(
        tmp_path,
        run_ok,
        "topology.spares=1",
        scenarios=[
            "site:allreduce,model:scale,factor:1000,scope:reduction,ranks:[1],steps:[5]",
            "site:allreduce,model:drop,scope:reduction,ranks:[2],steps:[5]",
            "site:allreduce,model:scale,factor:1000,scope:reduction,ranks:[1],steps:[5],"
            "persistence:permanent",
            "site:allreduce,model:stale,scope:reduction,ranks:[2],steps:[5],persistence:permanent",
        ],
    )
    for row in table:
        assert row["detected_by"] == "allreduce_sketch" and row["detect_step"] == "5"
        assert row["final_nodes"] == "4" and row["golden_match"] == "True"
    # Every way back is a recovery: the transient faults' retries, the permanent ones' rollback
    # with quarantine (their retry, wrong again, did not get the run back), to before the
    # updates the sketch does not vouch for (it alarms on a NaN contribution too, which a
    # weight step 4's update broke, or a moment step 3's left, would send).
    assert [(r["quarantined_nodes"], r["recoveries"], r["recovered"]) for r in table] == [
        ("", "1", "True"), ("", "1", "True"), ("1", "1", "True"), ("2", "1", "True")
    ]  # fmt: skip
    assert [r["recovery_verdict"] for r in table] == [
        "retry at step 5", "retry at step 5",
        "rollback+quarantine at step 5 to step 1 (node 1)",
        "rollback+quarantine at step 5 to step 1 (node 2)",
    ]  # fmt: skip
    logged = events(out)
    retries = [e for e in logged if e["kind"] == "retry"]
    assert sorted((e["trial_id"][:3], e["rank"], e["step"]) for e in retries) == sorted(
        (t, r, 5) for t in ("000", "001", "002", "003") for r in range(4)
    )
    located = {(e["trial_id"][:3], e["rank"]): e for e in logged if e["kind"] == "locate"}
    assert sorted(located) == [(t, r) for t in ("002", "003") for r in range(4)]
    for (trial, _), e in located.items():
        node = 1 if trial == "002" else 2
        assert e["step"] == 5 and e["suspect_nodes"] == [node] and e["suspect_ranks"] == [node]
        assert e["wrong_without"] == [n for n in range(4) if n != node]
    # The sub-group reductions' own injections: only where node 1 took part, on every member.
    in_groups = [
        e for e in logged if e["kind"] == "inject" and e["trial_id"][:3] == "002" and "group" in e
    ]
    assert {tuple(e["group"]) for e in in_groups} == {(0, 1, 2), (0, 1, 3), (1, 2, 3)}
    assert {(tuple(e["group"]), e["rank"]) for e in in_groups} == {
        (g, r) for g in ((0, 1, 2), (0, 1, 3), (1, 2, 3)) for r in g
    }


@pytest.mark.slow
def test_in_bfloat16_a_repeating_wrong_reduction_quarantines_only_its_node(tmp_path, run_ok):
    """The float32 test above in bfloat16 (its twin in the default run): the chunk and its
    rider region are two collectives there, and the sub-group sums are checked within
    bfloat16's rounding. An exponent flip, not x1000: a x1000 of a random element can be
    smaller than bfloat16's rounding of the sum, which the sketch allows for."""
    _, table = _campaign(
        tmp_path,
        run_ok,
        "topology.spares=1",
        "workload.dtype=bfloat16",
        scenarios=[
            "site:allreduce,model:bitflip,bit:exponent_msb,scope:reduction,ranks:[1],steps:[5]",
            "site:allreduce,model:bitflip,bit:exponent_msb,scope:reduction,ranks:[3],steps:[5],"
            "persistence:permanent",
        ],
    )
    assert [(r["quarantined_nodes"], r["recoveries"]) for r in table] == [("", "1"), ("3", "1")]
    for row in table:
        assert row["detected_by"] == "allreduce_sketch" and row["detect_step"] == "5"
        assert row["final_nodes"] == "4" and row["golden_match"] == "True"


def test_a_reduction_fault_retried_in_its_step_reads_recovered_with_its_verdict(tmp_path, run_ok):
    """The in-step retry is a recovery like a rollback: the row says the trial recovered and
    how, and the report counts it apart from rollbacks."""
    out = tmp_path / "run"
    run_ok(
        *("campaign=single", "topology.nodes=4", "topology.spares=1", "recovery.enabled=true"),
        *("fault.site=allreduce", "fault.scope=reduction", "fault.model=scale"),
        *("fault.factor=1000", "fault.steps=[7]", "detectors=[nan_inf,allreduce_sketch]"),
        *("workload.steps=9", "campaign.seeds=1", "campaign.noise_seeds=2", f"out={out}"),
        cwd=tmp_path,
    )
    (row,) = rows(out)
    assert row["detected"] == "True" and row["golden_match"] == "True"
    assert (row["recovered"], row["recoveries"]) == ("True", "1")
    assert row["recovery_verdict"] == "retry at step 7"
    assert (row["quarantined_nodes"], row["restore_step"], row["steps_lost"]) == ("", "", "0")
    report = (out / "report.md").read_text()
    assert (
        "1 of 1 trials that needed recovery got back: 1 by an in-step retry of the reduction, "
        "0 by a rollback, 0 by a rollback with quarantine"
    ) in report
