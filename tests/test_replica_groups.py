"""HSDP's replica groups, on the real trainer over gloo: what the checks that compare replicas
see of one group's wrong weight shard (weight consensus across 3 groups, and recovery from it
with a spare; Megatron's hash against replica group 0). Apart from tests/test_parallel.py so
that the two workers of the default run share the sharded campaigns."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.runtime import checkpoint
from tests.conftest import events, rows
from tests.test_parallel import campaign


# float32 in the slow set (20 s): the default run keeps bfloat16, whose rounding is the harder
# case for the rollback's bit-identical end, on the same sharded consensus and recovery path.
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_a_wrong_weight_shard_on_one_hsdp_replica_is_caught_and_recovered_from(
    run_ok, tmp_path, dtype
):
    """HSDP over 3 nodes of 2 ranks (a shard group per node) and one spare node: rank 2's own
    weight shard x1000 at step 2. weight_consensus compares each shard with the same shard of the
    other two replica groups, Adam's moments with them, and names rank 2 at step 2; the run
    rolls back to the sharded checkpoint of step 1 (whose moments consensus saw agree), the
    spare takes node 1's place, and the run ends where golden does.
    The clean trial raises no alert and checkpoints after every approved step."""
    weight = "{site:weight,model:scale,factor:1000.0,ranks:[2],steps:[2]}"
    out = campaign(
        run_ok, tmp_path, "recovery", "topology.parallel=hsdp", "topology.shard_size=2",
        "topology.nodes=3", "topology.ranks_per_node=2", "topology.spares=1",
        "recovery.enabled=true", "recovery.max_recoveries=1",
        "detectors=[nan_inf,weight_consensus]", "detectors.weight_consensus.interval=1",
        "detectors.weight_consensus.optimizer_state=true",
        "checkpoint.interval=2", "checkpoint.keep=true", f"workload.dtype={dtype}",
        f"campaign.scenarios=[{{site:none}},{weight}]",
    )  # fmt: skip
    clean, row = rows(out)
    assert clean["alerts"] == "0" and clean["golden_match"] == "True", clean
    alerts = [e for e in events(out) if e["kind"] == "alert"]
    assert {(a["detector"], a["step"], tuple(a["suspect_ranks"])) for a in alerts} == {
        ("weight_consensus", 2, (2,))
    }
    assert row["recovered"] == "True" and row["golden_match"] == "True", row
    assert (row["restore_step"], row["quarantined_nodes"]) == ("1", "1"), row
    # Consensus runs after the update; its alarm stops the next step, before its update.
    assert row["recovery_verdict"] == "rollback+quarantine at step 3 to step 1 (node 1)", row
    # A sharded checkpoint after each approved step: every rank's shards, in one sealed folder.
    saved = [e for e in events(out) if e["kind"] == "checkpoint"]
    assert [e["step"] for e in saved if e["trial_id"] == clean["trial_id"]] == [1, 3]
    assert all(checkpoint.verify(Path(e["path"])) for e in saved)


# The slow set (10 s): the default run keeps the recovery loop's decision and a transient
# fault's re-execution in tests/test_recovery.py, with a world in place of the real one.
@pytest.mark.slow
def test_a_transient_broken_reduction_under_hsdp_is_rolled_back_to_without_quarantine(
    run_ok, tmp_path
):
    """Rank 1's broken reduction at step 2: every replica group's receiver of that shard gets
    the wrong sum, the sketch names all three (one per node), and no node can be laid on. A
    sharded world keeps no contributions to re-run it from: rolled back to without quarantine
    (it had quarantined all three nodes, more than the spare, and ended unrecovered), and the
    transient fault, met once, ends there, bit-identical to golden."""
    reduction = "{site:allreduce,model:scale,factor:1000.0,scope:reduction,ranks:[1],steps:[2]}"
    out = campaign(
        run_ok, tmp_path, "reduction", "topology.parallel=hsdp", "topology.shard_size=2",
        "topology.nodes=3", "topology.ranks_per_node=2", "topology.spares=1",
        "recovery.enabled=true", "recovery.max_recoveries=1", "detectors=[allreduce_sketch]",
        "checkpoint.interval=2", "workload.dtype=bfloat16", f"campaign.scenarios=[{reduction}]",
    )  # fmt: skip
    (row,) = rows(out)
    assert (row["detected_by"], row["detect_step"]) == ("allreduce_sketch", "2"), row
    assert row["suspect_ranks"] == "1;3;5" and row["quarantined_nodes"] == "", row
    assert row["recovery_verdict"] == "rollback at step 2 to step -1", row
    assert row["recovered"] == "True" and row["golden_match"] == "True", row


def test_megatrons_hash_under_hsdp_compares_each_shard_with_replica_group_0s(run_ok, tmp_path):
    """Megatron's check as published, with replica group 0 in rank 0's part: a wrong weight
    shard on rank 3 is named by rank 3; on rank 0 it is named by rank 2, the healthy holder of
    the same shard, since the first group always agrees with itself (its stated blind spot)."""
    faults = [
        "{site:none}",
        "{site:weight,model:scale,factor:1000.0,ranks:[3],steps:[1]}",
        "{site:weight,model:scale,factor:1000.0,ranks:[0],steps:[1]}",
    ]
    out = campaign(
        run_ok, tmp_path, "hash", "workload=mlp", "topology.parallel=hsdp", "topology.shard_size=2",
        "detectors=[megatron_hash]", "detectors.megatron_hash.interval=1",
        f"campaign.scenarios=[{','.join(faults)}]",
    )  # fmt: skip
    clean, third, first = rows(out)
    assert clean["alerts"] == "0" and clean["golden_match"] == "True", clean
    assert (third["detect_step"], third["suspect_ranks"]) == ("1", "3"), third
    assert (first["detect_step"], first["suspect_ranks"]) == ("1", "2"), first
    # Two replica groups, 2 against 2, and neither holds the golden weights (the groups average
    # their gradients, so the wrong shard's steps reached both): no side is the healthy one, and
    # every rank is named. A tie's most common digest was rank 0's: "2;3" both times before.
    assert (third["divergent_ranks"], first["divergent_ranks"]) == ("0;1;2;3", "0;1;2;3")
