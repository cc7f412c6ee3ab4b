"""End to end through the public command, on real 4-rank gloo worlds."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest

from tests.conftest import FAST, events, rows, sdc_bench, without_timing

NAN_FAULT = ["fault=grad_nan", "fault.steps=[5]", "campaign.seeds=2"]


# Slow set; its default-run twins compare two runs' rows too: test_robustness's SIGKILL resume and
# test_verdicts' fast-forward tests.
@pytest.mark.slow
def test_same_config_and_seed_give_identical_rows(tmp_path, run_ok):
    args = [*FAST, "campaign.seeds=2"]
    run_ok(*args, f"out={tmp_path / 'a'}", cwd=tmp_path)
    run_ok(*args, f"out={tmp_path / 'b'}", cwd=tmp_path)
    first, second = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert len(first) == 8 * 2
    assert without_timing(first) == without_timing(second)
    assert {r["effect"] for r in first} >= {"none", "harmful"}


def test_default_run_prints_summary_and_writes_report(tmp_path, run_ok):
    out = tmp_path / "run"
    proc = run_ok(*FAST, "campaign.seeds=1", f"out={out}", cwd=tmp_path)
    assert f"report: {out / 'report.md'}" in proc.stdout
    assert "| trials | any detector | nan_inf |" in proc.stdout
    report = (out / "report.md").read_text()
    for section in ("Catch rate by detector", "Catch rate by scenario cell", "False positives"):
        assert section in report
    page = (out / "report.html").read_text()
    images = re.findall(r'<img src="(figures/[^"]+)"', page)
    assert "<table>" in page and len(images) >= 3
    for image in images:
        assert (out / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Trial checkpoints went to the off-node store and were cleaned up after each trial.
    assert not any((out / "store").glob("*/*.pt"))


# Slow set; the default-run twin is test_detectors'
# test_a_nan_in_a_local_gradient_is_caught_by_nan_inf_in_its_step_and_contained.
@pytest.mark.slow
def test_nan_in_local_gradient_is_caught_in_its_step_and_attributed(tmp_path, run_ok):
    out = tmp_path / "run"
    run_ok(*FAST, *NAN_FAULT, f"out={out}", cwd=tmp_path)
    for row in rows(out):
        assert row["fired"] == "True" and row["inject_step"] == "5"
        assert row["injected_ranks"] == "3"
        assert row["detected"] == "True" and row["first_detector"] == "nan_inf"
        assert row["detect_step"] == "5" and row["ttd_steps"] == "0"
        assert row["contained"] == "True"
        assert row["suspect_ranks"] == "3" and row["suspect_nodes"] == "3"
        assert row["attribution_correct"] == "True"
        assert row["effect"] == "harmful"
    inject = [e for e in events(out) if e["kind"] == "inject"]
    assert len(inject) == 2 and all(e["new"] == "nan" and e["rank"] == 3 for e in inject)
    first_alert = next(e for e in events(out) if e["kind"] == "alert")
    assert first_alert["phase"] == "pre_allreduce" and first_alert["suspect_ranks"] == [3]


# Slow set; the default-run twin is test_injectors'
# test_every_site_and_model_injects_exactly_what_it_records (bit patterns of every model).
@pytest.mark.slow
def test_bitflip_event_records_the_exact_bits(tmp_path, run_ok):
    out = tmp_path / "run"
    run_ok(
        *FAST, "fault=grad_bitflip", "fault.bit=22", "fault.steps=[4]", f"out={out}", cwd=tmp_path
    )
    (inject,) = [e for e in events(out) if e["kind"] == "inject"]
    assert inject["rank"] == 1 and inject["step"] == 4 and inject["bit"] == 22
    assert int(inject["old_bits"], 16) ^ int(inject["new_bits"], 16) == 1 << 22
    assert len(inject["old_bits"]) == 2 + 8  # hex of a float32 pattern
    (row,) = rows(out)
    assert row["fired"] == "True" and row["bit"] == "22" and row["detected"] == "False"
    assert row["effect"] in {"masked", "benign", "harmful"}


# tests/test_detectors.py checks the same with every detector on, in the default run.
@pytest.mark.slow
def test_detectors_only_observe(tmp_path, run_ok):
    """Golden runs have no detector; clean trials run nan_inf. Same weights, bit for bit."""
    for workload, dtype in (("mlp", "float32"), ("gpt", "bfloat16")):
        out = tmp_path / f"{workload}-{dtype}"
        args = [f"workload={workload}", f"workload.dtype={dtype}", "workload.steps=6"]
        run_ok(
            *args,
            "fault=none",
            "campaign.seeds=2",
            "campaign.noise_seeds=2",
            f"out={out}",
            cwd=tmp_path,
        )
        table = rows(out)
        assert [r["effect"] for r in table] == ["none", "none"]
        assert all(r["golden_match"] == "True" and r["alerts"] == "0" for r in table)


def test_rerun_resumes_without_duplicates_and_refuses_another_campaign(tmp_path, run_ok):
    out = tmp_path / "run"
    args = [*FAST, *NAN_FAULT, "campaign.seeds=3", "workload.steps=8"]
    run_ok(*args, f"out={out}", cwd=tmp_path)
    complete = (out / "trials.csv").read_text().splitlines(keepends=True)
    # An interruption mid-write: the last row torn, the trial before it never recorded.
    (out / "trials.csv").write_text("".join(complete[:2]) + complete[3][:25])
    resumed = run_ok(*args, f"out={out}", cwd=tmp_path)
    assert f"resuming {out}: 1 of 3 trials already recorded" in resumed.stderr
    expected = list(csv.DictReader(io.StringIO("".join(complete))))
    assert len(expected) == 3
    # The finished campaign had dropped its golden snapshots: the golden runs ran again (same
    # result, recorded once) so that the two trials start where they did the first time.
    assert without_timing(rows(out)) == without_timing(expected)
    assert {r["start_step"] for r in expected} == {"5"}
    assert len((out / "golden.jsonl").read_text().splitlines()) == 3
    ids = [r["trial_id"] for r in rows(out)]
    per_trial = {json.loads(line)["trial_id"] for line in (out / "events.jsonl").open()}
    assert per_trial == set(ids)
    # Finished: rerun, it starts no world (seconds) and writes the report again. A stop after
    # the last row but before the report (SIGTERM) left the world's folder: the rerun clears it.
    (out / "report.md").unlink()
    stale = out / "world" / "world-0"
    stale.mkdir(parents=True)
    for name in ("rank0.pid", "rendezvous", "stack-123.txt"):
        (stale / name).write_text("left by a stopped run\n")
    again = run_ok(*args, f"out={out}", cwd=tmp_path)
    assert f"{out}: every trial is recorded; nothing to run" in again.stderr
    assert (out / "report.md").exists() and without_timing(rows(out)) == without_timing(expected)
    assert not (out / "world").exists()

    before = (out / "trials.csv").read_bytes()
    proc = sdc_bench(*args, "workload.lr=0.01", f"out={out}", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "out:" in proc.stderr and "different campaign" in proc.stderr
    assert (out / "trials.csv").read_bytes() == before
