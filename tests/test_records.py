"""Durable tables and checkpoints: whole rows or none, verified checkpoints."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from harness.campaign.golden_store import code_version
from harness.campaign.run import check_out
from harness.core.events import Crash
from harness.errors import ConfigError
from harness.results.records import Records
from harness.results.schema import Golden
from harness.runtime import checkpoint
from tests.conftest import compose_run
from tests.rows import row


def _row(trial_id):
    return row(trial_id=trial_id)


def test_resume_drops_a_torn_row_and_the_events_of_unfinished_trials(tmp_path):
    records = Records(tmp_path)
    records.add_trial(_row("a"), [Crash(trial_id="a", cause="hung", time=0.0)])
    records.add_golden(Golden(0, 1.0, "d"))
    with open(records.events, "a") as f:
        f.write('{"trial_id": "b", "kind": "inject"}\n{"trial_id": "b", "ki')
    with open(records.trials, "a") as f:
        f.write("b,0,mlp")
    assert Records(tmp_path).resume() == {"a"}
    assert records.trials.read_text().count("\n") == 2
    assert [line for line in records.events.read_text().splitlines()] == [
        '{"trial_id": "a", "kind": "crash", "cause": "hung", "time": 0.0}'
    ]
    assert records.goldens() == {0: Golden(0, 1.0, "d")}


@pytest.mark.parametrize(
    ("damaged", "says"),
    [
        ("trials", "trials.csv, line 2: its cells do not match the header's"),
        ("events", "events.jsonl, line 1: not a whole JSON record"),
        ("goldens", "golden.jsonl, line 1: not a whole JSON record"),
    ],
)
def test_resume_refuses_a_record_damaged_before_its_last_line(tmp_path, damaged, says):
    """A row cut short but ending in a newline read as a finished trial: the trial never ran
    again, and the campaign died with a traceback after every other trial. A cut line of
    events or goldens raised JSONDecodeError. Each is one line, before anything runs."""
    records = Records(tmp_path)
    for trial_id in ("a", "b"):
        records.add_trial(_row(trial_id), [Crash(trial_id=trial_id, cause="hung", time=0.0)])
    records.add_golden(Golden(0, 1.0, "d"))
    records.add_golden(Golden(1, 1.0, "e"))
    path = {"trials": records.trials, "events": records.events, "goldens": records.golden_file}
    lines = path[damaged].read_text().splitlines(keepends=True)
    at = 1 if damaged == "trials" else 0  # the trials' header first
    lines[at] = lines[at][:20] + "\n"
    path[damaged].write_text("".join(lines))
    with pytest.raises(ConfigError, match="damaged") as refused:
        Records(tmp_path).resume()
    assert refused.value.key == "out" and says in str(refused.value)


def test_resume_takes_an_empty_trials_file_for_no_trial_yet(tmp_path):
    """A header torn by an interruption is cut to nothing: no row, not a damaged one."""
    records = Records(tmp_path)
    records.trials.write_text("trial_id,se")
    records.events.write_text("")
    assert Records(tmp_path).resume() == set() and records.trials.read_text() == ""
    records.add_trial(_row("a"), [])
    assert Records(tmp_path).resume() == {"a"}


def test_checkpoint_round_trip_and_a_flipped_byte_is_caught(tmp_path):
    path = tmp_path / "store" / "step_000009.pt"
    state = {"step": 9, "model": {"w": torch.arange(6, dtype=torch.float32)}}
    checkpoint.save(path, state)
    assert torch.equal(checkpoint.load(path)["model"]["w"], state["model"]["w"])
    assert not list(path.parent.glob(".*tmp"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CorruptCheckpoint, match="checksum mismatch"):
        checkpoint.load(path)


def test_a_sharded_checkpoint_verifies_only_whole_and_as_written(tmp_path):
    """A torch.distributed.checkpoint folder: its listed checksums verify; a changed byte, a file
    missing or added, or no list (a save cut short) does not; placed elsewhere it verifies too."""
    folder = tmp_path / "store" / "step_000003.dcp"
    folder.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        (folder / name).write_bytes(name.encode() * 100)
    assert not checkpoint.verify(folder)
    checkpoint.seal_shards(folder)
    assert checkpoint.verify(folder)
    assert checkpoint.saved(folder.parent) == [(3, folder)]
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    checkpoint.place(folder, copy)
    assert checkpoint.verify(copy / folder.name)
    data = bytearray((folder / "__1_0.distcp").read_bytes())
    data[7] ^= 0x01
    (folder / "__1_0.distcp").write_bytes(bytes(data))
    assert not checkpoint.verify(folder)
    (copy / folder.name / "__2_0.distcp").write_bytes(b"x")
    assert not checkpoint.verify(copy / folder.name)


def test_a_campaign_recorded_by_an_older_harness_is_refused_as_other_code(tmp_path):
    """campaign.json written before the sources' digests were recorded came from another
    harness, whose record may lack later fields (a fault's `settings`, the trace's element
    counts): refused as other code, not as another campaign; the same record by this code
    resumes, and another campaign's is named as such."""
    run = compose_run("campaign=single", "fault=activation_nan")
    record = {**dataclasses.asdict(run), "code": code_version(run.workload)}
    older = {k: v for k, v in record.items() if k != "code"}
    older["forward"] = {k: v for k, v in older["forward"].items() if k != "output_sizes"}
    (tmp_path / "campaign.json").write_text(json.dumps(older))
    with pytest.raises(ConfigError, match=r"other code \(not recorded\)"):
        check_out(tmp_path, run)
    (tmp_path / "campaign.json").write_text(json.dumps(record))
    check_out(tmp_path, run)
    (tmp_path / "campaign.json").write_text(json.dumps(record | {"seeds": run.seeds + 1}))
    with pytest.raises(
        ConfigError, match=r"different campaign's trials \(this command changes seeds 2 -> 1"
    ):
        check_out(tmp_path, run)


def test_a_resume_may_change_how_a_run_is_kept_alive_not_what_it_computes(tmp_path):
    """A world slow to start names topology.startup_timeout_s; raised, the resume was refused
    as another campaign's. Timeouts and checkpoint.keep change no row; a setting that does is
    named in the refusal."""
    run = compose_run("campaign=single", "fault=grad_nan")
    record = {**dataclasses.asdict(run), "code": code_version(run.workload)}
    (tmp_path / "campaign.json").write_text(json.dumps(record))
    kept_alive = dataclasses.replace(
        run,
        topology=dataclasses.replace(run.topology, startup_timeout_s=120.0),
        checkpoint=dataclasses.replace(run.checkpoint, keep=not run.checkpoint.keep),
    )
    check_out(tmp_path, kept_alive)
    # A trial past its own timeout is a crash row that names it: rows judged under two cutoffs.
    patient = dataclasses.replace(
        run, topology=dataclasses.replace(run.topology, trial_timeout_s=900.0)
    )
    with pytest.raises(ConfigError, match=r"changes topology.trial_timeout_s"):
        check_out(tmp_path, patient)
    steps = dataclasses.replace(run, workload=dataclasses.replace(run.workload, lr=0.5))
    with pytest.raises(ConfigError, match=r"\(this command changes workload.lr 0.003 -> 0.5\)"):
        check_out(tmp_path, steps)


def test_a_refusal_names_the_settings_before_what_derives_from_them(tmp_path):
    """A whole float given for an integer (30.0 for the YAML's 30) is the same campaign; it read
    as another one naming nothing. A workload's width is named before the forward's trace
    and the trials it changes, which are named alone (they printed whole, a thousand
    characters, first)."""
    run = compose_run("campaign=smoke")
    record = {**dataclasses.asdict(run), "code": code_version(run.workload)}
    (tmp_path / "campaign.json").write_text(json.dumps(record))
    check_out(tmp_path, compose_run("campaign=smoke", "topology.collective_timeout_s=30.0"))
    with pytest.raises(ConfigError) as refused:
        check_out(tmp_path, compose_run("campaign=smoke", "workload.hidden=48"))
    assert "(this command changes workload.hidden 256 -> 48; forward); choose" in str(refused.value)
