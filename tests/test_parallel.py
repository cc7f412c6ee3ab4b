"""Campaigns under `topology.parallel=fsdp|hsdp`: the real trainer on a 4-rank gloo world, FSDP2's
own collectives with the harness's sites on them (harness/runtime/shard_sites.py).

On gpt (1.7 MB of gradients), in float32 under FSDP and bfloat16 under HSDP (2 replica groups of
2), with every check that applies at every step: a clean run raises no alert and matches its
golden run; a NaN in one rank's local gradients, a x1000 on one element of the shard one rank
receives (scope rank) or of a reduction (scope reduction), and a x1000 in the parameters one
rank gathers for its forward, and a x1000 on one product of one rank's forward are each caught
in their step, naming the rank (docs/design.md, section 3); a NaN in one rank's optimizer shard
shows a step after it spoils the weights. The replays, on a copy gathered whole from the shards,
name the rank whose local gradient or gathered copy went wrong and change no bit of the run.
The checks that compare HSDP's replica groups are tests/test_replica_groups.py's; that the sites
and checks change no bit of a clean run against plain fully_shard, tests/test_sharding.py's."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from harness.analysis import report
from harness.campaign.golden_store import golden_inputs
from harness.core.phases import PHASE_ORDER
from tests.conftest import BIN, compose_run, events, rows, without_timing

REDUCTION = "{site:allreduce,scope:reduction,model:scale,factor:1000.0,ranks:[1],steps:[2]}"
SCENARIOS = [
    "{site:none}",
    "{site:grad,model:value,value:nan,ranks:[1],steps:[2]}",
    "{site:allreduce,model:scale,factor:1000.0,ranks:[2],steps:[3]}",
    REDUCTION,
    "{site:gather,model:scale,factor:1000.0,ranks:[3],steps:[2]}",
    "{site:optimizer,model:value,value:nan,ranks:[0],steps:[1]}",
    "{site:matmul,model:scale,factor:1000.0,ranks:[1],steps:[2]}",
]
DETECTORS = "detectors=[nan_inf,allreduce_sketch,gather_consensus,matmul_checksum]"
REPLAYS = [
    "detectors=[nan_inf,allreduce_sketch,gather_consensus,matmul_checksum,replay,titan_replay]",
    "detectors.replay.interval=1",
    "detectors.titan_replay.num_steps=-1",
]
# (detector, step, phase, suspects) of each fault's first alert, per parallelism: the receiver of
# the wrong shard (under HSDP, the wrong reduction reaches rank 1's twin in the other replica
# group too), the rank whose gathered copy differs from the others'.
CAUGHT = {
    "fsdp": [
        None,
        ("nan_inf", 2, "pre_allreduce", "1"),
        ("allreduce_sketch", 3, "post_allreduce", "2"),
        ("allreduce_sketch", 2, "post_allreduce", "1"),
        ("gather_consensus", 2, "forward", "3"),
        # A moment's NaN spoils rank 0's weight shard at the next update, and every rank gathers
        # it alike: no check names rank 0, the gradients of all show it a step later.
        ("nan_inf", 3, "pre_allreduce", "0;1;2;3"),
        ("matmul_checksum", 2, "forward", "1"),
    ],
    "hsdp": [
        None,
        ("nan_inf", 2, "pre_allreduce", "1"),
        ("allreduce_sketch", 3, "post_allreduce", "2"),
        ("allreduce_sketch", 2, "post_allreduce", "1;3"),
        ("gather_consensus", 2, "forward", "3"),
        # Replica group 0 gathers the spoilt shard, group 1 does not: two against two.
        ("gather_consensus", 3, "forward", ""),
        ("matmul_checksum", 2, "forward", "1"),
    ],
}


def goldens(out) -> dict[int, dict]:
    """Each golden seed's entry in golden.jsonl: its weights digest, and whence it was reused."""
    entries = [json.loads(line) for line in (out / "golden.jsonl").read_text().splitlines()]
    return {e["seed"]: e for e in entries}


def campaign(run_ok, tmp_path, name, *overrides, micro_batch_size=4):
    """One seed of 4 steps, by default at a quarter of the workload's tokens per step: gpt's
    gradients stay 1.7 MB (they are the size of its parameters) and a step costs a third."""
    out = tmp_path / name
    run_ok(
        "workload=gpt", "workload.steps=4", f"workload.micro_batch_size={micro_batch_size}",
        "campaign.seeds=1", "campaign.noise_seeds=2", *overrides, f"out={out}", cwd=tmp_path,
    )  # fmt: skip
    return out


FSDP = ["topology.parallel=fsdp"]
HSDP_BF16 = ["topology.parallel=hsdp", "topology.shard_size=2", "workload.dtype=bfloat16"]


# FSDP in the slow set (22 s): HSDP's shard groups run FSDP's sites (reduce-scatter, all-gather)
# and add the replicas' all-reduce, in bfloat16; the default run keeps plain FSDP's in the replay
# test below, tests/test_sharding.py and the FSDP guard loop.
@pytest.mark.parametrize(
    "parallel",
    [pytest.param(FSDP, marks=pytest.mark.slow), HSDP_BF16],
    ids=["fsdp-float32", "hsdp-bfloat16"],
)
def test_faults_at_each_collective_site_are_caught_in_their_step(run_ok, tmp_path, parallel):
    """Every check derived for the site of a fault, each at every step: the clean trial raises
    no alert and matches its golden run; each fault is caught in its step, first by the check
    derived for its site, naming its rank."""
    scenarios = f"campaign.scenarios=[{','.join(SCENARIOS)}]"
    out = campaign(run_ok, tmp_path, "faults", *parallel, scenarios, DETECTORS)
    table = rows(out)
    assert len(table) == len(SCENARIOS)
    alerts = [e for e in events(out) if e["kind"] == "alert"]
    mode = parallel[0].split("=")[1]
    for row, caught in zip(table, CAUGHT[mode], strict=True):
        mine = [a for a in alerts if a["trial_id"] == row["trial_id"]]
        if caught is None:
            assert row["effect"] == "none" and not mine and row["golden_match"] == "True", row
            continue
        detector, step, phase, suspects = caught
        assert row["fired"] == "True" and row["detected"] == "True", row
        assert (row["detect_step"], row["suspect_ranks"]) == (str(step), suspects), row
        first = min(mine, key=lambda a: (a["step"], PHASE_ORDER[a["phase"]]))
        assert (first["detector"], first["step"], first["phase"]) == (detector, step, phase)
    # The broken reduction is rank 1's: under HSDP the sketch names rank 1 and its twin, both
    # struck, which does not single out the rank the fault names.
    reduction = table[SCENARIOS.index(REDUCTION)]
    assert reduction["attribution_correct"] == str(mode == "fsdp"), reduction


# 8 sequences per step under HSDP in bfloat16 (gpt's default is 16): at 4, replay did not name
# rank 3's wrong gathered copy at step 2 (titan_replay, gather_consensus and matmul_checksum did).
# HSDP in the slow set (23 s): the default run keeps HSDP's sites in the collective-site test and
# its replica groups in tests/test_replica_groups.py.
@pytest.mark.parametrize(
    "parallel, micro_batch_size",
    [(FSDP, 4), pytest.param(HSDP_BF16, 8, marks=pytest.mark.slow)],
    ids=["fsdp-float32", "hsdp-bfloat16"],
)
def test_replays_on_a_gathered_replica_name_the_rank_and_change_no_weight(
    run_ok, tmp_path, parallel, micro_batch_size
):
    """Every applicable check at every step, the replays among them (each on a copy of the model
    gathered whole from the stored shards): the clean trial raises no alert, its golden run ends
    bit-identical to one computed first by a campaign with no check at all, and both replays
    name the rank whose local gradient (a NaN) or gathered copy (x1000) went wrong, in its step."""
    store = f"campaign.golden_cache={tmp_path / 'goldens'}"
    both = [*parallel, store]
    plain = campaign(run_ok, tmp_path, "plain", *both, "detectors=[]", "fault=none",
                     micro_batch_size=micro_batch_size)  # fmt: skip
    faults = [SCENARIOS[0], SCENARIOS[1], SCENARIOS[4]]
    scenarios = f"campaign.scenarios=[{','.join(faults)}]"
    out = campaign(run_ok, tmp_path, "replays", *both, scenarios, *REPLAYS,
                   micro_batch_size=micro_batch_size)  # fmt: skip
    # The trials' seed's golden reruns with the checks (fast-forward needs their state at each
    # snapshot): its weights are the unchecked run's, bit for bit.
    checked, unchecked = goldens(out)[0], goldens(plain)[0]
    assert checked["reused_from"] is None, checked
    assert checked["weights_digest"] == unchecked["weights_digest"]
    clean, local, gathered = rows(out)
    assert clean["alerts"] == "0" and clean["golden_match"] == "True", clean
    alerts = [e for e in events(out) if e["kind"] == "alert"]
    for row, rank in ((local, 1), (gathered, 3)):
        for check in ("replay", "titan_replay"):
            named = {tuple(a["suspect_ranks"]) for a in alerts
                     if a["trial_id"] == row["trial_id"] and a["detector"] == check
                     and a["step"] == 2}  # fmt: skip
            assert named == {(rank,)}, (row["trial_id"], check, named)


def test_float16_replays_recompute_the_gradient_as_fsdp_divided_it(run_ok, tmp_path):
    """FSDP2 divides a float16 reduce-scatter input by about sqrt(W) (its guard against
    overflow, 2 on 4 ranks) before the `grad` site, where the replays fingerprint it. Compared
    with the undivided recomputation, both alarmed at every audited step of a clean trial,
    naming every rank; recomputed and divided as FSDP divides, they agree bit for bit and still
    name the rank whose local gradient was scaled. On a gpt of three blocks (four FSDP groups,
    1.3 MB of float16 gradients), compared exactly: no tolerance to hide a factor in."""
    scaled = "{site:grad,model:scale,factor:8.0,ranks:[1],steps:[2]}"
    checks = ["detectors=[replay,titan_replay]", "detectors.replay.interval=1",
              "detectors.replay.compare=exact", "detectors.titan_replay.num_steps=-1"]  # fmt: skip
    out = campaign(run_ok, tmp_path, "float16", "workload.dtype=float16", "workload.layers=3",
                   "workload.steps=3", *FSDP, f"campaign.scenarios=[{{site:none}},{scaled}]",
                   *checks, micro_batch_size=2)  # fmt: skip
    clean, struck = rows(out)
    assert clean["alerts"] == "0", clean
    first = {(a["detector"], a["step"], tuple(a["suspect_ranks"])) for a in events(out)
             if a["kind"] == "alert" and a["trial_id"] == struck["trial_id"]}  # fmt: skip
    assert first == {("replay", 2, (1,)), ("titan_replay", 2, (1,))}, first


def test_a_sharded_golden_is_never_a_replicated_ones():
    """The golden store keys a golden by how its world trains: fsdp, hsdp and ddp runs of the
    same workload and seed reduce in different collectives, so their goldens differ."""
    keys = [
        golden_inputs(compose_run(*overrides), {}, seed=0)
        for overrides in (
            [],
            ["topology.parallel=fsdp", "detectors=[nan_inf]"],
            ["topology.parallel=hsdp", "topology.shard_size=2", "detectors=[nan_inf]"],
        )
    ]
    assert len({json.dumps(k, sort_keys=True) for k in keys}) == 3


def test_the_report_sets_the_same_faults_side_by_side_under_each_parallelism(run_ok, tmp_path):
    """sdc-report over a ddp and an fsdp run of the same faults: one row per fault and check,
    a column per parallelism; the ddp-only checks read `not run` under fsdp."""
    faults = "campaign.scenarios=[" + ",".join(SCENARIOS[1:3]) + "]"
    common = ["workload=mlp", "workload.steps=4", "campaign.seeds=1", "campaign.noise_seeds=2"]
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    run_ok(*common, faults, "detectors=[nan_inf,grad_stats]", f"out={ddp}", cwd=tmp_path)
    run_ok(*common, faults, "detectors=[nan_inf]", "topology.parallel=fsdp", f"out={fsdp}",
           cwd=tmp_path)  # fmt: skip
    report.main([str(ddp), str(fsdp), "--out", str(tmp_path / "both")])
    text = (tmp_path / "both" / "report.md").read_text()
    section = text.split("## Catch rate by parallelism")[1].split("\n## ")[0]
    # The two faults strike at steps 2 and 3: the step tells their rows apart, as in the cells.
    assert "| site | model | dtype | fault steps | detector | ddp | fsdp |" in section
    lines = [line for line in section.splitlines() if line.startswith("| grad ")]
    assert "| grad | value | float32 | 2 | nan_inf | 1/1 = 100%" in lines[1]
    assert lines[1].endswith("| 1/1 = 100% [21%, 100%] |"), lines
    assert lines[0].startswith("| grad | value | float32 | 2 | grad_stats |")
    assert lines[0].endswith("| not run |"), lines


# HSDP's in the slow set: the same snapshot and restore, over a 2-D mesh.
@pytest.mark.parametrize("parallel", ["fsdp", pytest.param("hsdp", marks=pytest.mark.slow)])
def test_fast_forward_gives_the_rows_of_trials_trained_from_step_0(run_ok, tmp_path, parallel):
    """A trial started from its golden run's full-state snapshot (resharded by slicing) ends
    exactly where the same trial trained from step 0 does."""
    late = "campaign.scenarios=[{site:grad,model:scale,factor:1000.0,ranks:[1],steps:[3]}]"
    both = [f"topology.parallel={parallel}", "detectors=[nan_inf]", late]
    if parallel == "hsdp":
        both.append("topology.shard_size=2")
    tables = {}
    for ff in ("true", "false"):
        out = campaign(run_ok, tmp_path, f"ff-{ff}", *both, f"campaign.fast_forward={ff}")
        tables[ff] = without_timing(rows(out))
    assert tables["true"][0]["start_step"] == "3" and tables["false"][0]["start_step"] == "0"
    for row in tables.values():
        row[0].pop("start_step")
    assert tables["true"] == tables["false"]


def test_torchrun_runs_a_sharded_custom_campaign_and_writes_the_spawned_worlds_rows(
    tmp_path, run_ok
):
    """The plan's torchrun command, run on this machine, trains the FSDP world the spawned
    campaign trains: the same rows, the received shard's x1000 caught by the sketch on rank 1.
    The workload is a user's (`workload=custom`, the example conv net: one FSDP group)."""
    args = [
        "workload=custom", "workload.steps=4", "campaign.seeds=1", "campaign.noise_seeds=2",
        "topology.parallel=fsdp", "topology.nodes=1", "topology.ranks_per_node=2",
        "detectors=[nan_inf,allreduce_sketch]",
        "campaign.scenarios=[{site:allreduce,model:scale,factor:1000.0,ranks:[1],steps:[2]}]",
    ]  # fmt: skip
    spawned, planned = tmp_path / "spawned", tmp_path / "planned"
    run_ok(*args, f"out={spawned}", cwd=tmp_path)
    printed = run_ok(*args, "launcher=torchrun", f"out={planned}", cwd=tmp_path)
    words = printed.stdout.strip().splitlines()[-1].split()
    pins = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", **pins)
    done = subprocess.run(
        words[len(pins) :], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert without_timing(rows(spawned)) == without_timing(rows(planned))
    row = rows(planned)[0]
    assert (row["parallel"], row["detected"], row["first_detector"]) == (
        "fsdp", "True", "allreduce_sketch",
    ), row  # fmt: skip
    assert (row["detect_step"], row["suspect_ranks"]) == ("2", "1"), row


# Slow set (30 s): under FSDP the default run keeps gpt's sites and the guard's transformers Qwen2
# loop (tests/test_guard_loops.py); the Llama with the LLM recipe keeps its DDP tests.
@pytest.mark.slow
def test_a_transformers_llama_with_the_llm_recipe_is_checked_under_fsdp(run_ok, tmp_path):
    """The real architecture (a transformers Llama, one FSDP group per decoder layer) trained
    with the LLM recipe (bf16-mixed autocast, clipping, warmup + cosine), every applicable
    check at every step: the clean trial raises no alert; a wrong gathered copy and a wrong
    received shard are caught in their step by the check derived for each site, naming the
    rank, and the replays see the wrong forward too."""
    faults = [
        "{site:none}",
        "{site:gather,model:scale,factor:1000.0,ranks:[1],steps:[2]}",
        "{site:allreduce,model:scale,factor:1000.0,ranks:[2],steps:[1]}",
    ]
    out = campaign(
        run_ok, tmp_path, "llama", "workload=llama", "topology.parallel=fsdp", *REPLAYS,
        f"campaign.scenarios=[{','.join(faults)}]",
    )  # fmt: skip
    clean, gathered, received = rows(out)
    assert clean["alerts"] == "0" and clean["golden_match"] == "True", clean
    for row, detector, step, rank in (
        (gathered, "gather_consensus", "2", "1"),
        (received, "allreduce_sketch", "1", "2"),
    ):
        assert row["first_detector"] == detector, row
        assert (row["detect_step"], row["suspect_ranks"]) == (step, rank), row
    # The replays see the wrong forward too: it changes rank 1's loss and local gradient.
    assert set(gathered["alert_detectors"].split(";")) >= {"replay", "titan_replay"}, gathered
