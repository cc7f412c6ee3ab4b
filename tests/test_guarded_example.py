"""examples/train_guarded.py under torchrun: a small language model in a hand-written DDP loop,
every check on, each rank its own simulated machine ("machine-0", "machine-1", ...). The default
run trains a transformers GPT-2 with dropout 0.1 and two accumulated micro-batches per step on 3
ranks (the harness's own GPT, the comm hooks, FSDP and 4 ranks in the slow set)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import detectors
from harness.guard import EXIT_SUSPECT_HARDWARE, Guard
from harness.results.costs import JobCosts
from tests.conftest import BIN, example_ranks

EXAMPLE = Path(__file__).parents[1] / "examples" / "train_guarded.py"
EVERY = {"nan_inf": {}, "grad_stats": {}, "allreduce_sketch": {}, "weight_consensus": {},
         "replay": {"interval": 1}}  # fmt: skip
STEPS = 6
# The fewest replay's tie-break needs (each rank's verifier and tiebreaker are its two peers):
# each GPT-2 rank costs the 2-core test machine about 6 s of CPU time per run.
RANKS = 3
# GPT-2 as users train it: dropout everywhere its config has one, gradient accumulation.
GPT2 = ("--model", "gpt2", "--dropout", "0.1", "--accumulate", "2")


def example(out: Path, *args: str, ranks: int = RANKS) -> tuple[dict, list[int]]:
    """Rank 0's summary and every rank's exit code; the ranks forked from one parent that
    imported the example once, with torchrun's environment (tests/loops/forked_ranks.py)."""
    env = dict(os.environ, SDC_NODE_NAME="machine-{node}")
    args = ("--out", str(out), "--steps", str(STEPS), *args)
    codes, proc = example_ranks(EXAMPLE, ranks, *args, env=env)
    assert (out / "summary.json").exists(), proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert codes == [summary["exit_code"]] * ranks, proc.stderr[-3000:]
    return summary, codes


@pytest.mark.slow
def test_the_documented_command_runs_every_check_that_applies(tmp_path):
    """docs/guard.md's command as it stands, no --detectors: every check the guard can run in a
    DDP loop of 4 one-rank nodes runs 20 clean steps silently, the one that does not apply says
    why, and what each cost lands in costs.json. Slow (18 s): the default run's guards with
    every check on 4 DDP ranks, and their costs.json, are the Lightning and Hugging Face
    examples' (tests/test_lightning.py, tests/test_hf_trainer.py)."""
    env = dict(os.environ, SDC_NODE_NAME="machine-{node}")
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=4", str(EXAMPLE),
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["steps"] == 20
    assert summary["alerts"] == [] and summary["warnings"] == []
    assert "gather_consensus" in summary["left_out"]
    assert set(summary["checks"]) | set(summary["left_out"]) == set(detectors.available())
    costs = JobCosts.read(tmp_path / "costs.json")
    assert sorted(costs.checks) == summary["checks"] and costs.steps == 17
    assert all(c.seconds_per_step > 0 for c in costs.checks.values())


@pytest.mark.slow
def test_titan_replay_in_a_guard_stops_a_scaled_gradient_at_its_step(tmp_path):
    """torchtitan's replay of every step recomputes each rank's own micro-batch (kept by
    guard.audit_batch): x4 on rank 1's largest gradient element at step 3 stops the loop there,
    naming rank 1. Default-run twin: the documented command, whose titan_replay replays step 0."""
    fault = {"site": "grad", "model": "scale", "factor": 4.0, "ranks": [1], "steps": [3],
             "select": "largest"}  # fmt: skip
    summary, _ = example(tmp_path, "--detectors", json.dumps({"titan_replay": {"num_steps": -1}}),
                         "--mode", "act", "--inject", json.dumps(fault))  # fmt: skip
    assert summary["alarm"] == {"detector": "titan_replay", "step": 3, "suspect_ranks": [1],
                                "suspect_machines": ["machine-1"]}  # fmt: skip
    assert summary["exit_code"] == EXIT_SUSPECT_HARDWARE


def guarded(out: Path, *args: str) -> dict:
    return example(out, "--detectors", json.dumps(EVERY), "--mode", "act", *args)[0]


def clean_twins(tmp_path: Path, hook: str, *model: str) -> tuple[dict, dict]:
    """The same clean loop with every check and with the guard off."""
    with_guard = guarded(tmp_path / "guarded", "--comm-hook", hook, *model)
    without, _ = example(tmp_path / "off", "--guard-off", "--comm-hook", hook, *model)
    assert with_guard["alerts"] == [] and with_guard["alarm"] is None
    assert with_guard["warnings"] == []
    assert with_guard["steps"] == without["steps"] == STEPS
    assert with_guard["replay_bytes"] > 0, "replay shipped the batches"
    return with_guard, without


# Slow set (32 s): the default run keeps the guard's bit-identity on the FSDP Qwen2 loop
# (tests/test_guard_loops.py) and the documented command below.
@pytest.mark.slow
def test_gpt2_with_dropout_and_accumulation_is_bit_identical_to_no_guard(tmp_path):
    """Replay at every step recomputes each peer's two micro-batches under the random state
    each was trained under (its dropout masks): no alert, and the guard changes no bit. Three
    ranks: DDP scales each gradient by 1/3 as it fills the bucket, which a division by 3 does
    not reproduce bit for bit (the guard's hook once divided)."""
    with_guard, without = clean_twins(tmp_path, "none", *GPT2)
    assert with_guard["digest"] == without["digest"]


@pytest.mark.slow
@pytest.mark.parametrize("hook", ["none", "fp16", "bf16"])
def test_a_clean_run_with_every_check_is_bit_identical_to_no_guard(tmp_path, hook):
    """Slow twins of the GPT-2 test above, on the harness's GPT, with each of torch's linear
    comm hooks wrapped too."""
    with_guard, without = clean_twins(tmp_path, hook)
    assert with_guard["digest"] == without["digest"]


@pytest.mark.slow
def test_llama_under_the_llm_recipe_raises_no_alert(tmp_path):
    """A transformers Llama with autocast to bfloat16, clipping at 1.0, dropout 0.1 and two
    accumulated micro-batches: every check (the example's default, "all"), no alert; then
    with replay at every step too."""
    llm = ("--model", "llama", "--amp", "--clip", "1.0", "--dropout", "0.1", "--accumulate", "2")
    summary, _ = example(tmp_path / "all", *llm)
    assert summary["exit_code"] == 0 and summary["alerts"] == [] and summary["warnings"] == []
    summary = guarded(tmp_path / "every", *llm)
    assert summary["alerts"] == [] and summary["warnings"] == [] and summary["steps"] == STEPS


@pytest.mark.slow
def test_titan_replay_of_the_first_step_is_silent_in_a_clean_run(tmp_path):
    """Default-run twin: the documented command, which runs it among every check."""
    summary, _ = example(tmp_path, "--detectors", '["titan_replay"]', ranks=4)
    assert summary["exit_code"] == 0 and summary["alerts"] == [] and summary["steps"] == STEPS


# The largest gradient element on rank 1 times 4: within grad_stats' spread, and the sketch
# verifies only the sum of what was sent; replay recomputes rank 1's gradient elsewhere.
SCALED = {"site": "grad", "model": "scale", "factor": 4.0, "ranks": [1], "steps": [4],
          "select": "largest"}  # fmt: skip


@pytest.fixture(scope="module")
def scaled_gradient(tmp_path_factory) -> tuple[Path, dict, list[int]]:
    out = tmp_path_factory.mktemp("scaled")
    summary, codes = example(
        out, "--detectors", json.dumps(EVERY), "--mode", "act", "--checkpoint-every", "2",
        "--inject", json.dumps(SCALED), *GPT2,
    )  # fmt: skip
    return out, summary, codes


def test_replay_stops_a_scaled_gradient_and_quarantines_its_machine(scaled_gradient):
    out, summary, codes = scaled_gradient
    assert summary["alarm"] == {"detector": "replay", "step": 4, "suspect_ranks": [1],
                                "suspect_machines": ["machine-1"]}  # fmt: skip
    assert summary["exit_code"] == EXIT_SUSPECT_HARDWARE
    assert codes == [EXIT_SUSPECT_HARDWARE] * RANKS, "each rank exits with it"
    record = json.loads((out / "checkpoints" / "quarantine.json").read_text())
    assert record["suspect_machines"] == ["machine-1"] and record["suspect_ranks"] == [1]
    # Replay audits every step: its audit of step 3 vouched for the weights step 3 began with,
    # not for step 3's update, which wrote the checkpoint of step 3 (set aside), nor for the
    # moments step 2 left.
    assert record["step"] == 4 and record["first_suspect_step"] == 2
    assert record["detector"] == "replay" and record["evidence"]["verifier"] == 0
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*.pt"))
    assert saved == ["step_000001.pt"], "nothing saved from step 4 on, and 3's set aside"
    assert [p.name for p in (out / "checkpoints" / "suspect").glob("step_*.pt")] == [
        "step_000003.pt"
    ]


def test_a_restart_from_the_restore_point_trains_on_cleanly(scaled_gradient, tmp_path):
    out, _, _ = scaled_gradient
    assert Guard.restore_point(out / "checkpoints")[0] == 1
    summary, _ = example(out, "--detectors", json.dumps(EVERY), "--mode", "act",
                         "--checkpoint-every", "2", "--resume", *GPT2)  # fmt: skip
    assert summary["exit_code"] == 0 and summary["alarm"] is None and summary["alerts"] == []
    assert summary["steps"] == STEPS and len(summary["losses"]) == STEPS - 2
    assert all(math.isfinite(x) for x in summary["losses"])
    # The same command again, as a requeued job runs it: the run is done, nothing to train (its
    # end, --steps, bounded a guard that would start there, which refused it).
    again, codes = example(out, "--detectors", json.dumps(EVERY), "--mode", "act",
                           "--checkpoint-every", "2", "--resume", *GPT2)  # fmt: skip
    assert codes == [0] * RANKS and again["steps"] == STEPS and again["losses"] == [], again


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, detector, step, rank",
    [
        # A wrong value delivered to rank 2 alone: the sketch on that receiver.
        ({"site": "allreduce", "model": "scale", "factor": 1000.0, "scope": "rank",
          "ranks": [2], "steps": [3], "select": "largest"}, "allreduce_sketch", 3, 2),
        # A weight of rank 3 scaled after the update of step 3, a checkpoint step: consensus
        # before the checkpoint, before replay sees the wrong weight at step 4.
        ({"site": "weight", "model": "scale", "factor": 1000.0, "ranks": [3], "steps": [3],
          "select": "largest"}, "weight_consensus", 3, 3),
        ({"site": "grad", "model": "value", "value": "nan", "ranks": [1], "steps": [2]},
         "nan_inf", 2, 1),
    ],
)  # fmt: skip
def test_a_rehearsal_stops_at_its_step_naming_its_machine(tmp_path, fault, detector, step, rank):
    """Slow twins of the replay rehearsal above, on 4 ranks (rank 3 is one's target)."""
    summary, _ = example(
        tmp_path, "--detectors", json.dumps(EVERY), "--mode", "act", "--checkpoint-every", "2",
        "--inject", json.dumps(fault), ranks=4,
    )  # fmt: skip
    assert summary["alarm"] == {"detector": detector, "step": step, "suspect_ranks": [rank],
                                "suspect_machines": [f"machine-{rank}"]}  # fmt: skip
    assert summary["exit_code"] == EXIT_SUSPECT_HARDWARE
    saved = [int(p.stem.split("_")[1]) for p in (tmp_path / "checkpoints").glob("step_*.pt")]
    assert all(s < step for s in saved)


@pytest.mark.slow
def test_under_fsdp_a_rehearsal_quarantines_and_a_restart_resumes_from_the_sharded_checkpoint(
    tmp_path,
):
    """Default-run twins: the GPT-2 replay rehearsal and its restart above (DDP). Under
    --parallel fsdp the guard saves torch.distributed.checkpoint folders, sealed with their
    checksums; the alarm sets none aside before its step, and the restart loads the newest."""
    checks = json.dumps({"nan_inf": {}, "replay": {"interval": 1}, "gather_consensus": {}})
    common = ("--parallel", "fsdp", "--detectors", checks, "--mode", "act",
              "--checkpoint-every", "2")  # fmt: skip
    summary, _ = example(tmp_path, *common, "--inject", json.dumps(SCALED), ranks=4)
    assert summary["alarm"] == {"detector": "replay", "step": 4, "suspect_ranks": [1],
                                "suspect_machines": ["machine-1"]}  # fmt: skip
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*.dcp"))
    assert saved == ["step_000001.dcp", "step_000003.dcp"]
    assert Guard.restore_point(tmp_path / "checkpoints")[0] == 3
    summary, _ = example(tmp_path, *common, "--resume", ranks=4)
    assert summary["exit_code"] == 0 and summary["alerts"] == [] and summary["steps"] == STEPS
    assert len(summary["losses"]) == STEPS - 4


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("--parallel", "hsdp", "--shard-size", "2"),
         "--shard-size: 2 must divide the world of 2 ranks into two or more groups"),
        # A ZeroDivisionError traceback. In the slow set (8 s): the default run keeps the same
        # refusal of a shard size above.
        pytest.param(("--parallel", "hsdp", "--shard-size", "0"),
                     "--shard-size: 0 must divide the world of 2 ranks", marks=pytest.mark.slow),
        # Checked on the loop's first forward: bit 25 of a bfloat16 product (--amp) crashed the
        # striking rank at its step with an int16 overflow, the others on a closed connection.
        (("--parallel", "fsdp", "--amp", "--inject", json.dumps(
            {"site": "matmul", "model": "bitflip", "bit": 25, "ranks": [1], "steps": [2],
             "tensor": "blocks.0.fc"})),
         "inject.bit: 25 is outside bfloat16, the dtype of the product 1 of 'blocks.0.fc'"),
    ],
    ids=["one-replica-group", "no-shard", "bit-past-the-product"],
)  # fmt: skip
def test_a_setting_the_example_cannot_run_exits_2_on_every_rank_in_one_line(tmp_path, args, error):
    codes, proc = example_ranks(EXAMPLE, 2, "--out", str(tmp_path), "--steps", "4", *args)
    assert codes == [2, 2], proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "train_guarded.py: error:" in line]
    assert len(lines) == 1 and error in lines[0], proc.stderr[-3000:]
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("--checkpoint-every", "0"), "--checkpoint-every: 0 must be at least 1"),
        (("--checkpoint-every", "-2"), "--checkpoint-every: -2 must be at least 1"),
        (("--clip", "-1"), "--clip: -1.0 must be above 0"),
        (("--hidden", "66"), "--hidden: 66 must be a multiple of --heads 4"),
    ],
)
def test_a_value_the_example_cannot_train_with_exits_2_before_any_process_group(
    tmp_path, monkeypatch, capsys, args, error
):
    """Refused where the arguments are read, in this process (no group is made before):
    `--checkpoint-every 0` trained a step and died of a ZeroDivisionError on every rank, -2
    checkpointed every 2 steps, `--clip -1` turned every gradient (clip_grad_norm_ scaled by a
    negative factor: the loss rose), and `--hidden 66` with 4 heads crashed in the first
    forward."""
    spec = importlib.util.spec_from_file_location("train_guarded", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "argv", ["train_guarded.py", "--out", str(tmp_path), *args])
    monkeypatch.setenv("SDC_NODE_NAME", "host{node}")  # what main sets, undone after the test
    with pytest.raises(SystemExit) as refused:
        example.main()
    assert refused.value.code == 2 and not dist.is_initialized()
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith(f"train_guarded.py: error: {error}"), lines
