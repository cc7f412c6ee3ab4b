"""Events: every kind's record has the keys events.jsonl has always had, in the same order, and
reads back to the same event; the module needs neither torch nor the harness."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

from harness.core import events
from harness.core.events import ContributionInject, ElementInject, from_record, to_record
from harness.core.plugins import EventLog

STAMP = {"rank": 1, "node": 0, "time": 2.5}
# One record of each shape, as the code wrote them before events were classes.
RECORDS = [
    {"kind": "alert", **STAMP, "step": 3, "detector": "nan_inf", "phase": "pre_allreduce",
     "suspect_ranks": [1], "suspect_nodes": [0], "evidence": {"value": "nan"}},
    {"kind": "warning", **STAMP, "step": 3, "detector": "replay", "what": "not deterministic",
     "evidence": {}},
    {"kind": "inject", **STAMP, "step": 3, "site": "grad", "model": "bitflip", "tensor": "w",
     "index": 7, "bit": 30, "bits": [30], "old": 0.5, "new": "inf", "old_bits": "3f000000",
     "new_bits": "7f000000", "fired": True},
    {"kind": "inject", **STAMP, "step": 3, "site": "matmul", "model": "scale", "tensor": "0",
     "index": 7, "bit": None, "bits": None, "old": 0.5, "new": 5.0, "old_bits": "3f000000",
     "new_bits": "40a00000", "fired": True, "phase": "backward", "group": [0, 1]},
    {"kind": "inject", **STAMP, "step": 3, "site": "allreduce", "model": "stale",
     "tensor": "bucket0", "bucket": 0, "index": None, "bit": None, "bits": None, "old": None,
     "new": None, "old_bits": None, "new_bits": None, "elements": 9, "changed": 4,
     "riders": True, "old_norm": 1.0, "new_norm": 2.0, "from_step": 2, "fired": True},
    {"kind": "checkpoint", **STAMP, "step": 9, "path": "store/t/step_000009.pt"},
    {"kind": "retry", **STAMP, "step": 5, "reason": "every rank alarmed on the received sum"},
    {"kind": "stop", **STAMP, "step": 5, "detector": "allreduce_sketch"},
    {"kind": "host_reads", **STAMP, "most_in_a_step": 2, "total": 11},
    {"kind": "locate", **STAMP, "step": 5, "wrong_without": [0, 2], "suspect_ranks": [1],
     "suspect_nodes": [1]},
    {"kind": "sensitivity", **STAMP, "step": 0, "detector": "allreduce_sketch", "bucket": 0,
     "bound": 1e-4, "grad_norm": 0.3},
    {"kind": "corrupt_checkpoint", "step": 5, "path": "store/t/step_000005.pt", "time": 2.5},
    {"kind": "crash", "cause": "rank 1 hung", "time": 0.0},
    {"kind": "trial_alert", "step": 3, "detector": "nan_inf", "phase": "pre_allreduce",
     "time": 2.5, "evidence": {}, "suspect_ranks": [1], "suspect_nodes": [0], "raised_by": [1]},
]  # fmt: skip


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r["kind"])
def test_a_record_reads_back_and_writes_the_same_line(record):
    for original in (record, {"trial_id": "t", **record, "segment": 0}):
        event = from_record(original)
        assert json.dumps(to_record(event)) == json.dumps(original)
        assert pickle.loads(pickle.dumps(event)) == event


def test_every_kind_has_a_class_and_an_inject_reads_as_its_own_shape():
    assert {cls.kind for cls in events.ALL} == {r["kind"] for r in RECORDS}
    shapes = [type(from_record(r)) for r in RECORDS if r["kind"] == "inject"]
    assert shapes == [ElementInject, ElementInject, ContributionInject]
    assert all(isinstance(from_record(r), events.Inject) for r in RECORDS[2:5])
    with pytest.raises(ValueError, match="'nope'"):
        from_record({"kind": "nope"})


# The fields docs/design.md section 4 gives every `inject` record.
INJECT_FIELDS = ("step", "rank", "site", "tensor", "index", "bit", "old", "new", "old_bits",
                 "new_bits")  # fmt: skip


def test_every_inject_shape_carries_the_contracts_fields():
    """A whole contribution (drop, duplicate, stale) or a defective unit's lane has no one
    element: its `index`, `bit`, values and bit patterns are null, present as the contract's
    every inject record has them, so a reader of events.jsonl can take them from any inject
    (a drop's record had no `old` or `old_bits`)."""
    shapes = [
        ElementInject(step=3, site="grad", model="bitflip", tensor="w", index=7, bit=30,
                      bits=[30], old=0.5, new="inf", old_bits="0x3f000000",
                      new_bits="0x7f000000", fired=True),
        ContributionInject(step=3, site="allreduce", model="drop", tensor="bucket0", bucket=0,
                           elements=9, changed=9, old_norm=1.0, new_norm=0.0, from_step=None,
                           fired=True),
        events.LaneInject(step=3, site="matmul", model="defective_unit", tensor="fc",
                          product=1, bit=30, lane=0, lanes=16, elements=4, old_norm=1.0,
                          new_norm=2.0, fired=True),
    ]  # fmt: skip
    for event in shapes:
        record = to_record(event)
        missing = [f for f in INJECT_FIELDS if f not in record]
        assert not missing, (type(event).__name__, missing)
        assert type(from_record(record)) is type(event)
    # A record written before the fields were there reads as the same event.
    for event in shapes[1:]:
        record = to_record(event)
        older = {k: v for k, v in record.items() if k not in ("old", "new", "old_bits", "new_bits")}
        assert from_record(older) == event


def test_the_log_stamps_rank_node_and_time():
    log = EventLog(rank=3, node=1)
    log.emit(events.Retry(step=4, reason="r"))
    (event,) = log.events
    record = to_record(event)
    assert list(record)[:4] == ["kind", "rank", "node", "time"]
    assert (record["rank"], record["node"], record["step"]) == (3, 1, 4) and record["time"] > 0


def test_the_module_imports_neither_torch_nor_the_harness():
    code = (
        "import sys, harness.core.events; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'harness')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['harness',", "'harness.core',", "'harness.core.events']"]
