"""Recovery: stop, quarantine, roll back, resume; and prove the result is a fault-free one."""

from __future__ import annotations

import json

import torch

from harness import checkpoint
from harness.recovery import restore_point
from tests.conftest import rows

# Audits at steps 0, 5, 10; checkpoints (each after a consensus) after steps 1, 3, 5, ...
BASE = [
    "recovery.enabled=true",
    "workload.steps=12",
    "campaign.seeds=1",
    "campaign.noise_seeds=3",
    "checkpoint.interval=2",
    "detectors=[replay,allreduce_sketch,weight_consensus]",
    "detectors.replay.interval=5",
    "detectors.weight_consensus.interval=4",
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
    # Restore points: replay vouched for step 0 only (so from the start); the sketch checks
    # every step (checkpoint after step 5); consensus last passed after step 3.
    assert [r["restore_step"] for r in table] == ["-1", "5", "3"]
    stops = [json.loads(line) for line in (out / "events.jsonl").open()]
    assert {e["step"] for e in stops if e["kind"] == "stop"} == {5, 6}
    # The quarantined node's local scratch was wiped; checkpoints live off the node.
    assert not (out / "nodes" / "node1").exists() and (out / "nodes" / "node0").exists()


def test_with_a_spare_recovery_on_a_model_over_one_mib_ends_bit_identical(tmp_path, run_ok):
    """gpt's gradients span two reduction chunks: the recovered segment reduces every step in
    the layout the golden run did (harness/comm.py)."""
    _, (row,) = _campaign(
        tmp_path,
        run_ok,
        "topology.spares=1",
        "workload=gpt",
        "workload.micro_batch_size=8",
        "workload.context=32",
        scenarios=["site:grad,model:scale,factor:1000,ranks:[1],steps:[5]"],
    )
    assert row["first_detector"] == "replay" and row["quarantined_nodes"] == "1"
    assert row["recovered"] == "True" and row["golden_match"] == "True"


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


def test_a_fault_that_follows_the_data_ends_with_the_verdict_not_a_loop(tmp_path, run_ok):
    _, (row,) = _campaign(
        tmp_path,
        run_ok,
        "topology.spares=4",
        "recovery.max_recoveries=2",
        scenarios=["site:grad,model:scale,factor:1000,ranks:[1],steps:[5],follows:data"],
    )
    assert row["recovered"] == "False" and row["recoveries"] == "2"
    assert "step 5 alarms after every recovery" in row["recovery_verdict"]
    assert "data or the code" in row["recovery_verdict"]


def test_a_corrupted_checkpoint_is_detected_and_an_older_verified_one_is_used(tmp_path):
    for step in (1, 3, 5):
        checkpoint.save(tmp_path / f"step_{step:06d}.pt", {"w": torch.full((4,), float(step))})
    newest = tmp_path / "step_000005.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    log: list[dict] = []
    step, path = restore_point(tmp_path, 6, log)
    assert step == 3 and torch.equal(checkpoint.load(tmp_path / path)["w"], torch.full((4,), 3.0))
    assert [e["kind"] for e in log] == ["corrupt_checkpoint"] and log[0]["step"] == 5
    assert restore_point(tmp_path, 3, []) == (1, str(tmp_path / "step_000001.pt"))


def test_a_transient_wrong_reduction_is_re_run_from_the_local_gradients(tmp_path, run_ok):
    """Issue 14: a reduction fault that names no node (every rank alarms on the received sum)
    is re-run once from the local contributions kept before the collective: no rollback, no
    quarantine, and the run ends bit-identical to the golden one."""
    out, table = _campaign(
        tmp_path,
        run_ok,
        "topology.spares=1",
        scenarios=[
            "site:allreduce,model:scale,factor:1000,scope:reduction,ranks:[1],steps:[5]",
            "site:allreduce,model:drop,scope:reduction,ranks:[2],steps:[5]",
        ],
    )
    for row in table:
        assert row["detected_by"] == "allreduce_sketch" and row["detect_step"] == "5"
        assert row["quarantined_nodes"] == "" and row["recoveries"] == "0"
        assert row["final_nodes"] == "4" and row["golden_match"] == "True"
    retries = [json.loads(line) for line in (out / "events.jsonl").open()]
    retries = [e for e in retries if e["kind"] == "retry"]
    assert sorted((e["trial_id"][:3], e["rank"], e["step"]) for e in retries) == sorted(
        (t, r, 5) for t in ("000", "001") for r in range(4)
    )
