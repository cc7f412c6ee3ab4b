"""The guard in a plain, hand-written DDP loop under torchrun (tests/loops/plain_ddp.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import BIN

LOOP = Path(__file__).parent / "loops" / "plain_ddp.py"


def _loop(out: Path, *args: str) -> list[dict]:
    env = dict(os.environ, SDC_NODE_NAME="machine-a")
    proc = subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=4", str(LOOP), str(out), *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_a_clean_loop_with_the_guard_trains_bit_identically_to_one_without(tmp_path):
    plain = _loop(tmp_path / "plain")
    guarded = _loop(tmp_path / "guarded", "--guard", "--mode", "act")
    assert len({r["digest"] for r in plain}) == 1
    assert [r["digest"] for r in guarded] == [r["digest"] for r in plain]
    assert all(r["alarm"] is None and r["alerts"] == [] for r in guarded)


def test_a_user_comm_hook_is_wrapped_not_replaced(tmp_path):
    compressed = _loop(tmp_path / "fp16", "--fp16-hook")
    guarded = _loop(tmp_path / "fp16-guarded", "--fp16-hook", "--guard")
    assert [r["digest"] for r in guarded] == [r["digest"] for r in compressed]
    # A clean run: no check may alarm (the sketch once expected world-size times what arrived).
    assert [r["alerts"] for r in guarded] == [[]] * 4
    plain = _loop(tmp_path / "plain")
    assert compressed[0]["digest"] != plain[0]["digest"], "the fp16 hook really ran"


def test_a_rehearsed_fault_raises_at_its_step_naming_its_rank(tmp_path):
    fault = {"site": "grad", "model": "scale", "factor": 1000.0, "ranks": [1], "steps": [5],
             "select": "largest"}  # fmt: skip
    results = _loop(tmp_path / "rehearsal", "--guard", "--mode", "act", "--inject",
                    json.dumps(fault))  # fmt: skip
    alarms = [r["alarm"] for r in results]
    assert all(a == alarms[0] for a in alarms), "every rank raises the same alarm"
    assert alarms[0]["step"] == 5 and alarms[0]["suspect_ranks"] == [1]
    assert alarms[0]["detector"] == "grad_stats" and alarms[0]["machines"] == ["machine-a"]
    wrong_receiver = {"site": "allreduce", "model": "scale", "factor": 1000.0, "scope": "rank",
                      "ranks": [2], "steps": [3]}  # fmt: skip
    results = _loop(tmp_path / "receiver", "--guard", "--mode", "act", "--inject",
                    json.dumps(wrong_receiver))  # fmt: skip
    alarm = results[0]["alarm"]
    assert alarm["detector"] == "allreduce_sketch" and alarm["step"] == 3
    assert alarm["suspect_ranks"] == [2]
