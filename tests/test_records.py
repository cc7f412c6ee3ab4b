"""Durable tables and checkpoints: whole rows or none, verified checkpoints."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

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


def test_a_campaign_recorded_before_fault_models_had_settings_resumes(tmp_path):
    """campaign.json written before a fault could carry its model's settings, and a trial its
    place in a fault mix, has no `settings` in its faults and no `mix` in its trials: the same
    campaign resumes from it, as from its own record; another does not."""
    run = compose_run("campaign=default")
    record = dataclasses.asdict(run)

    def without_settings(content):
        if isinstance(content, dict):
            return {k: without_settings(v) for k, v in content.items()
                    if k not in ("settings", "mix")}  # fmt: skip
        if isinstance(content, list | tuple):
            return [without_settings(v) for v in content]
        return content

    older = without_settings(record)
    assert json.dumps(older) != json.dumps(record)  # every fault holds `settings` now
    for written in (older, record):  # before settings, and as this campaign writes it
        (tmp_path / "campaign.json").write_text(json.dumps(written))
        check_out(tmp_path, run)
    (tmp_path / "campaign.json").write_text(json.dumps(record | {"seeds": run.seeds + 1}))
    with pytest.raises(ConfigError, match="different campaign"):
        check_out(tmp_path, run)


def test_a_campaign_recorded_before_the_trace_counted_elements_resumes(tmp_path):
    """campaign.json's `forward` (what one forward runs) written before the trace recorded each
    module's output elements and each product's: the same campaign resumes from it."""
    run = compose_run("campaign=single", "fault=activation_nan")
    record = dataclasses.asdict(run)
    older = record | {"forward": {k: v for k, v in record["forward"].items()
                                  if k not in ("output_sizes", "product_traces")}}  # fmt: skip
    assert older["forward"] != record["forward"] and older["forward"]["made"]
    for written in (older, record):
        (tmp_path / "campaign.json").write_text(json.dumps(written))
        check_out(tmp_path, run)
