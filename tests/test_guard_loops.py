"""The guard in a user's own loop under torchrun (tests/loops/user_loop.py, written from
docs/guard.md with no harness code but the Guard): a transformers Qwen2 (1.15 MiB of float32
gradients) with attention dropout, two micro-batches accumulated without a reduction, bf16
autocast, clipping at 0.3 and AdamW as LLM recipes set it, under FSDP2's fully_shard over 4
ranks (FSDP), over 3 replica groups of 2 shards (HSDP, 6 ranks), and under DDP; every rank its
own machine. HSDP (six ranks), the fault matrix under FSDP and HSDP and the other endings after
each check's alarm are the slow set's."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from harness.analysis import plan_report
from harness.analysis.plan import job_overheads, load
from harness.guard import EXIT_SUSPECT_HARDWARE
from harness.guard.alarm import EXIT_UNATTRIBUTED
from harness.results.costs import JobCosts
from tests.conftest import BIN

pytest.importorskip("transformers")

LOOP = Path(__file__).parent / "loops" / "user_loop.py"
SWEEP = Path(__file__).parent / "fixtures" / "sweep"
# What "all" runs under FSDP, replay and titan_replay at every step.
SHARDED = {"nan_inf": {}, "allreduce_sketch": {}, "gather_consensus": {}, "matmul_checksum": {},
           "replay": {"interval": 1}, "titan_replay": {"num_steps": -1}}  # fmt: skip
REPLICATED = {"nan_inf": {}, "allreduce_sketch": {}, "matmul_checksum": {},
              "replay": {"interval": 1}, "weight_consensus": {"interval": 1}}  # fmt: skip
HSDP = {**SHARDED, "weight_consensus": {"interval": 1}}


def loop(out: Path, ranks: int, *args: str) -> tuple[list[dict], subprocess.CompletedProcess]:
    """Every rank's record, and the torchrun that ran them."""
    env = dict(os.environ, SDC_NODE_NAME="machine-{node}")
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={ranks}", str(LOOP), str(out),
         "--steps", "5", "--accumulate", "2", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert "terminate called" not in proc.stderr and "exitcode  : -6" not in proc.stderr
    found = [out / f"rank{r}.json" for r in range(ranks)]
    assert all(f.exists() for f in found), proc.stderr[-3000:]
    return [json.loads(f.read_text()) for f in found], proc


def exit_codes(proc: subprocess.CompletedProcess) -> set[int]:
    """What torchrun reports of its failed workers (none when every one exited 0)."""
    return {int(code) for code in re.findall(r"exitcode\s+: (-?\d+)", proc.stderr)}


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The clean FSDP loop without the guard, then with every check and its costs (`--twin`:
    the same processes train both, one after the other)."""
    out = tmp_path_factory.mktemp("fsdp")
    ranks, proc = loop(out, 4, "--parallel", "fsdp", "--twin", "--detectors", json.dumps(SHARDED),
                       "--costs", str(out / "costs.json"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, ranks


def test_a_clean_fsdp_loop_with_every_check_trains_as_it_would_without_the_guard(fsdp):
    """Every rank's shards bit-identical to the unguarded loop's, with replay at every step on
    an unsharded copy of the module; no alert on any rank."""
    _, ranks = fsdp
    assert [r["digest"] for r in ranks] == [r["unguarded"] for r in ranks]
    assert len({r["digest"] for r in ranks}) == 4, "each rank holds shards of its own"
    assert all(r["alarm"] is None and r["alerts"] == [] for r in ranks)
    assert all(r["checks"] == sorted(SHARDED) for r in ranks)


def test_the_costs_measured_in_the_job_price_the_plan(fsdp, tmp_path, capsys):
    """write_costs gives every check a positive cost; sdc-plan --costs uses the job's figure for
    each check (at the job's interval, that figure; at k, c/k; looks counted, a look's cost
    over k) and the job's hook, says so in its header, and refuses a file that lacks a check
    the run ran or whose figure holds none of its looks."""
    out, _ = fsdp
    costs = JobCosts.read(out / "costs.json")
    assert set(costs.checks) == set(SHARDED) and costs.parallel == "fsdp"
    assert costs.world_size == 4 and costs.steps == 2 and costs.step_time_s > 0
    assert all(c.seconds_per_step > 0 and c.overhead_pct > 0 for c in costs.checks.values())
    assert costs.hook.seconds_per_step > 0
    trials, _ = load([SWEEP], need_overhead=False)
    priced = job_overheads(costs, "costs.json", trials)
    assert priced.at[("replay", "1")] == pytest.approx(costs.checks["replay"].overhead_pct)
    assert priced.at[("replay", "20")] == pytest.approx(costs.checks["replay"].overhead_pct / 20)
    assert priced.at[("nan_inf", "")] == pytest.approx(costs.checks["nan_inf"].overhead_pct)
    assert priced.hook == costs.hook.overhead_pct
    plan_report.main([str(SWEEP), "--costs", str(out / "costs.json"), "--out", str(tmp_path)])
    assert "overheads measured in the job itself" in capsys.readouterr().out
    lacking = replace(costs, checks={"nan_inf": costs.checks["nan_inf"]})
    lacking.write(tmp_path / "lacking.json")
    with pytest.raises(SystemExit) as exited:
        plan_report.main([str(SWEEP), "--costs", str(tmp_path / "lacking.json")])
    assert exited.value.code == 2
    assert "no figure for 'replay'" in capsys.readouterr().err
    # A figure of 2 steps for a check that looks every 5: it priced replay at 5 from the steps
    # between its looks.
    sparse = replace(costs.checks["replay"], interval=5)
    replace(costs, checks={**costs.checks, "replay": sparse}).write(tmp_path / "short.json")
    with pytest.raises(SystemExit) as exited:
        plan_report.main([str(SWEEP), "--costs", str(tmp_path / "short.json")])
    assert exited.value.code == 2
    assert "'replay' looks every 5 steps and the guard measured 2" in capsys.readouterr().err
    # Replay at listed steps, one of them among the 2 measured: its figure is one look's cost
    # spread over 2 steps, so one look costs twice it; a figure holding none is refused.
    listed = replace(costs.checks["replay"], interval=None, looks=1)
    once = replace(costs, checks={**costs.checks, "replay": listed})
    per_look = 2 * costs.checks["replay"].overhead_pct
    assert job_overheads(once, "once.json", trials).at[("replay", "20")] == pytest.approx(
        per_look / 20
    )
    unseen = replace(costs, checks={**costs.checks, "replay": replace(listed, looks=0)})
    unseen.write(tmp_path / "unseen.json")
    with pytest.raises(SystemExit) as exited:
        plan_report.main([str(SWEEP), "--costs", str(tmp_path / "unseen.json")])
    assert exited.value.code == 2
    assert "'replay' looked at none of the 2 steps the guard measured" in capsys.readouterr().err


@pytest.mark.slow
def test_a_wrong_weight_on_one_hsdp_replica_group_stops_every_rank_with_86(tmp_path):
    """A weight of rank 2 (replica group 1, shard 0) scaled after step 2's update: consensus
    across the 3 groups names rank 2 at step 2, and the loop, leaving the Guard's `with` block
    and destroying the group, exits 86 on every rank (torchrun stops the rest: -15). Slow (six
    ranks); the default run's sharded guard is the FSDP loop's."""
    fault = {"site": "weight", "model": "scale", "factor": 100.0, "ranks": [2], "steps": [2],
             "select": "largest"}  # fmt: skip
    checks = {"nan_inf": {}, "gather_consensus": {}, "weight_consensus": {"interval": 1}}
    ranks, proc = loop(tmp_path, 6, "--parallel", "hsdp", "--detectors", json.dumps(checks),
                       "--inject", json.dumps(fault), "--ending", "close")  # fmt: skip
    alarm = {"detector": "weight_consensus", "step": 2, "suspect_ranks": [2],
             "exit_code": EXIT_SUSPECT_HARDWARE}  # fmt: skip
    assert [r["alarm"] for r in ranks] == [alarm] * 6
    assert EXIT_SUSPECT_HARDWARE in exit_codes(proc)
    assert exit_codes(proc) <= {EXIT_SUSPECT_HARDWARE, -15}


@pytest.mark.slow
def test_a_wrong_hsdp_sum_stops_every_rank_with_87(tmp_path):
    """Shard 1's sum x1000 as rank 1's reduction hands it out at step 2, on four machines in two
    replica groups of two: the sketch on its receivers in both groups (ranks 1 and 3) alerts,
    and the guard named machines 1 and 3 (86, "restart without" them), where no machine
    explains the sum and a campaign rolls back without quarantine: 87 on every rank. Slow (a
    sharded world of four); the rule's default-run test is tests/test_guard.py's."""
    fault = {"site": "allreduce", "scope": "reduction", "model": "scale", "factor": 1000.0,
             "ranks": [1], "steps": [2]}  # fmt: skip
    checks = {"nan_inf": {}, "allreduce_sketch": {}}
    ranks, proc = loop(tmp_path, 4, "--parallel", "hsdp", "--detectors", json.dumps(checks),
                       "--inject", json.dumps(fault))  # fmt: skip
    alarm = {"detector": "allreduce_sketch", "step": 2, "suspect_ranks": [1, 3],
             "exit_code": EXIT_UNATTRIBUTED}  # fmt: skip
    assert [r["alarm"] for r in ranks] == [alarm] * 4
    assert EXIT_UNATTRIBUTED in exit_codes(proc)
    assert exit_codes(proc) <= {EXIT_UNATTRIBUTED, -15}


@pytest.mark.slow
def test_a_ddp_loop_that_returns_after_an_alarm_exits_0_on_every_rank(tmp_path):
    """The loop catches SDCAlarm, destroys the group and returns, with no close() and nothing
    else docs/guard.md asks for: every rank ends with 0, none aborts. Slow (23 s): in the
    default run, the Lightning and Hugging Face examples end every rank after an alarm without
    an abort (tests/test_lightning.py, tests/test_hf_trainer.py)."""
    fault = {"site": "weight", "model": "scale", "factor": 100.0, "ranks": [3], "steps": [2],
             "select": "largest"}  # fmt: skip
    # The cheap checks and consensus: how the loop ends does not depend on which checks ran
    # before the alarm (each check's alarm, with each ending, is the slow set's).
    checks = {"nan_inf": {}, "allreduce_sketch": {}, "weight_consensus": {"interval": 1}}
    ranks, proc = loop(tmp_path, 4, "--detectors", json.dumps(checks), "--inject",
                       json.dumps(fault), "--ending", "return")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["alarm"]["detector"] for r in ranks] == ["weight_consensus"] * 4
    assert ranks[0]["alarm"]["suspect_ranks"] == [3] and ranks[0]["alarm"]["step"] == 2


# Each fault at its step, naming its rank: a NaN in a local gradient, x3 on the largest gradient
# element (replay), a parameter shard scaled on its way into rank 1's forward.
FAULTS = [
    ({"site": "grad", "model": "value", "value": "nan", "ranks": [1], "steps": [2]},
     "nan_inf", 2, [1]),
    ({"site": "grad", "model": "scale", "factor": 3.0, "ranks": [2], "steps": [3],
      "select": "largest"}, "replay", 3, [2]),
    ({"site": "gather", "model": "scale", "factor": 1000.0, "ranks": [1], "steps": [2]},
     "gather_consensus", 2, [1]),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "hsdp"])
@pytest.mark.parametrize("fault, detector, step, suspects", FAULTS)
def test_a_rehearsal_in_a_sharded_loop_stops_at_its_step(
    tmp_path, parallel, fault, detector, step, suspects
):
    """Default-run twin: the HSDP weight fault above."""
    world, checks = (4, SHARDED) if parallel == "fsdp" else (6, HSDP)
    ranks, proc = loop(tmp_path, world, "--parallel", parallel, "--detectors",
                       json.dumps(checks), "--inject", json.dumps(fault))  # fmt: skip
    alarms = [r["alarm"] for r in ranks]
    assert alarms == [{"detector": detector, "step": step, "suspect_ranks": suspects,
                       "exit_code": EXIT_SUSPECT_HARDWARE}] * world  # fmt: skip
    assert exit_codes(proc) <= {EXIT_SUSPECT_HARDWARE, -15}


@pytest.mark.slow
def test_a_clean_hsdp_loop_with_every_check_trains_as_it_would_without_the_guard(tmp_path):
    """Default-run twin: the FSDP loop above."""
    ranks, proc = loop(tmp_path, 6, "--parallel", "hsdp", "--twin", "--detectors",
                       json.dumps(HSDP))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["digest"] for r in ranks] == [r["unguarded"] for r in ranks]
    assert all(r["alarm"] is None and r["alerts"] == [] for r in ranks)


DDP_FAULTS = {
    "nan_inf": {"site": "grad", "model": "value", "value": "nan", "ranks": [1], "steps": [2]},
    "replay": {"site": "grad", "model": "scale", "factor": 3.0, "ranks": [2], "steps": [3],
               "select": "largest"},
    "allreduce_sketch": {"site": "allreduce", "model": "scale", "factor": 1000.0,
                         "scope": "rank", "ranks": [2], "steps": [2], "select": "largest"},
    "weight_consensus": {"site": "weight", "model": "scale", "factor": 100.0, "ranks": [3],
                         "steps": [2], "select": "largest"},
    "matmul_checksum": {"site": "matmul", "model": "scale", "factor": 8.0, "ranks": [1],
                        "steps": [2]},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["return", "exit"])
@pytest.mark.parametrize("detector", sorted(DDP_FAULTS))
def test_a_ddp_loop_ends_cleanly_after_each_checks_alarm(tmp_path, detector, ending):
    """Default-run twin: the DDP loop that returns after consensus's alarm."""
    ranks, proc = loop(tmp_path, 4, "--detectors", json.dumps(REPLICATED), "--inject",
                       json.dumps(DDP_FAULTS[detector]), "--ending", ending)  # fmt: skip
    assert [r["alarm"]["detector"] for r in ranks] == [detector] * 4
    if ending == "return":
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        assert exit_codes(proc) <= {EXIT_SUSPECT_HARDWARE, -15}
