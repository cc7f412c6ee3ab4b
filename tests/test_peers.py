"""The peers' methods as detectors, on one small 4-rank campaign: each behaves as
published, side by side with ours on identical faults."""

from __future__ import annotations

import pytest

from tests.conftest import events, rows, run_here

CHECKS = [
    "detectors=[weight_consensus,megatron_hash,titan_replay,spiky_loss]",
    "detectors.weight_consensus.interval=1",
    "detectors.megatron_hash.interval=1",
    "detectors.titan_replay.num_steps=-1",
    "detectors.spiky_loss.samples=3",
]
SCENARIOS = {
    "clean": "site:none",
    "weight_rank0": "site:weight,model:scale,factor:1000,ranks:[0],steps:[3]",
    "grad": "site:grad,model:scale,factor:1000,ranks:[1],steps:[4]",
    "loss": "site:loss,model:scale,factor:1000,ranks:[2],steps:[5]",
}


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peers")
    listed = ",".join("{" + s + "}" for s in SCENARIOS.values())
    run_here(
        *CHECKS, "workload.steps=8", "campaign.seeds=1", "campaign.noise_seeds=2",
        f"campaign.scenarios=[{listed}]", f"out={tmp / 'run'}", cwd=tmp,
    )  # fmt: skip
    table = dict(zip(SCENARIOS, rows(tmp / "run"), strict=True))
    alerts = [e for e in events(tmp / "run") if e["kind"] == "alert"]
    return {
        name: [a for a in alerts if a["trial_id"] == row["trial_id"]] for name, row in table.items()
    }


def _by(alerts: list[dict], detector: str) -> list[dict]:
    return [a for a in alerts if a["detector"] == detector]


def test_megatron_hash_suspects_the_healthy_ranks_when_rank_0_is_corrupt(peers):
    """Acceptance: its real behaviour; weight_consensus's majority names rank 0."""
    # The replicas stay apart after the fault: both checks keep alarming, from step 3 on.
    megatron = _by(peers["weight_rank0"], "megatron_hash")
    assert min(a["step"] for a in megatron) == 3
    assert sorted(r for a in megatron if a["step"] == 3 for r in a["suspect_ranks"]) == [1, 2, 3]
    assert all(a["rank"] != 0 for a in megatron), "rank 0 agrees with itself"
    consensus = _by(peers["weight_rank0"], "weight_consensus")
    assert min(a["step"] for a in consensus) == 3
    assert all(a["suspect_ranks"] == [0] for a in consensus)


def test_titan_replay_sees_a_transient_local_gradient_fault_on_its_own_rank(peers):
    titan = _by(peers["grad"], "titan_replay")
    assert [(a["step"], a["rank"], a["suspect_ranks"]) for a in titan] == [(4, 1, [1])]
    assert titan[0]["evidence"]["losses_equal"] is True


def test_spiky_loss_flags_ten_times_the_largest_of_its_first_losses(peers):
    spiky = _by(peers["loss"], "spiky_loss")
    assert [(a["step"], a["suspect_ranks"]) for a in spiky] == [(5, [2])]
    assert spiky[0]["evidence"]["loss"] >= spiky[0]["evidence"]["limit"]


def test_no_peer_check_alarms_on_a_clean_run(peers):
    assert peers["clean"] == []


def test_replay_with_megatrons_rerun_verdicts(tmp_path):
    """`detectors.replay.verdict=megatron`: a fault the same rank does not reproduce on a rerun
    is transient (a local gradient corrupted in the comm hook); one it reproduces but another
    node does not is a persistent fault of that rank (its forward, broken on every run: a
    permanent fault; a transient one strikes its step's first forward only); the verdict goes
    into the alert."""
    scenarios = [
        "site:grad,model:scale,factor:1000,ranks:[1],steps:[5]",
        "site:activation,tensor:fc1,model:scale,factor:1000,ranks:[1],steps:[5],"
        "persistence:permanent",
    ]
    listed = ",".join("{" + s + "}" for s in scenarios)
    run_here(
        "detectors=[replay]", "detectors.replay.verdict=megatron", "workload.steps=6",
        "campaign.seeds=1", "campaign.noise_seeds=2", f"campaign.scenarios=[{listed}]",
        f"out={tmp_path / 'run'}", cwd=tmp_path,
    )  # fmt: skip
    trials = [r["trial_id"] for r in rows(tmp_path / "run")]
    alerts = [e for e in events(tmp_path / "run") if e["kind"] == "alert"]
    verdicts = [
        {(a["step"], a["evidence"]["verdict"], tuple(a["suspect_ranks"])) for a in alerts
         if a["trial_id"] == t}
        for t in trials
    ]  # fmt: skip
    assert verdicts == [
        {(5, "not reproduced on the same rank: transient fault", (1,))},
        # Rank 1's forward also corrupted its replay of rank 2: rank 2's result is reproduced
        # by its own rerun and on another node, so the replay is the one that differed.
        {(5, "reproduced on its own rank only: persistent fault", (1,)),
         (5, "reproduced on another node: the replay differed", (1,))},
    ]  # fmt: skip
