"""What a trial records as it runs: one frozen dataclass per kind of event.

An event is something a rank, or the harness judging a trial, saw happen: an injection, a
check's alert or warning, a checkpoint, a stop, a retry of a reduction, a crash. Each kind is a
class with a class-level `kind` name and typed fields; `KINDS` maps each name to its class and
`ALL` lists every concrete class. A rank's events are stamped with its `rank`, `node` and `time`
by the log that records them (harness.core.plugins.EventLog), positions in the world that ran
(after a quarantine, a spare holds the replaced node's number); the harness's own events
(`trial_alert`, `crash`, `corrupt_checkpoint`) carry their time themselves. Two envelope fields
are set on the way out: `trial_id` when the trial is judged, `segment` when recovery restarted
the trial and the event came from an earlier segment.

events.jsonl holds one JSON object per line, each `to_record(event)`: the trial id first, then
`kind`, then the fields in the order the class declares them, then the segment, the envelope
fields only when set and a field declared `optional` only when it holds a value.
`from_record(record)` is its inverse, for readers of events.jsonl. Events also travel pickled,
from rank processes to the parent and between ranks of the guard.

Plain data only: no torch and nothing of the harness (analysis reads events.jsonl through this
module and may import neither).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

# Fields written to a record only when set: the trial's envelope, placed around the rest.
ENVELOPE = ("trial_id", "segment")


def optional() -> Any:
    """A field that only some events of a kind carry: absent from the record when None."""
    return field(default=None, metadata={"optional": True})


@dataclass(frozen=True, kw_only=True)
class Event:
    kind: ClassVar[str]
    trial_id: str | None = None
    segment: int | None = None  # recovery: the earlier run of the trial (0: the first) it came from

    @classmethod
    def variant(cls, record: dict[str, Any]) -> type[Event]:
        """The class that reads `record` (a kind with more than one shape picks its own)."""
        return cls


@dataclass(frozen=True, kw_only=True)
class RankEvent(Event):
    """An event one rank raised; EventLog.emit stamps the three fields here."""

    rank: int = -1
    node: int = -1
    time: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Alert(RankEvent):
    """A check found corruption at `phase` of `step` and names its suspects."""

    kind = "alert"
    step: int
    detector: str
    phase: str
    suspect_ranks: list[int]
    suspect_nodes: list[int]
    evidence: Any


@dataclass(frozen=True, kw_only=True)
class CheckWarning(RankEvent):
    """Something a check could not judge (replay: "not deterministic"), or how it ran otherwise
    than set (its C kernels not built); never an alert."""

    kind = "warning"
    step: int
    detector: str
    what: str
    evidence: Any


@dataclass(frozen=True, kw_only=True)
class Inject(RankEvent):
    """An injector changed what this rank computes; the shape of the rest depends on how."""

    kind = "inject"
    step: int
    site: str
    model: str
    tensor: str

    @classmethod
    def variant(cls, record: dict[str, Any]) -> type[Event]:
        if record.get("riders"):
            return ContributionInject
        return LaneInject if "lanes" in record else ElementInject


@dataclass(frozen=True, kw_only=True)
class ElementInject(Inject):
    """One element of `tensor` changed: its value and bit pattern (hex of its dtype) before
    and after, and the bits flipped when a flip did it."""

    index: int
    bit: int | None
    bits: list[int] | None
    old: float | str  # non-finite values as strings: JSON has no NaN
    new: float | str
    old_bits: str
    new_bits: str
    fired: bool
    phase: str | None = optional()  # matmul faults: which pass
    # matmul faults: the `fault.product`-th product the module made (a schedule needs it to
    # strike the same one again)
    product: int | None = optional()
    group: list[int] | None = optional()  # a diagnostic sub-group reduction's members
    dtype: str | None = optional()  # the struck tensor's: under autocast, not the workload's


@dataclass(frozen=True, kw_only=True)
class ContributionInject(Inject):
    """A rank's whole contribution to one reduction chunk changed (stale, dropped...): how
    many elements, and the chunk's L2 norm before and after. `index`, `bit`, `bits`, the
    values and their bit patterns stay None so that every inject record has the fields
    docs/design.md section 4 gives it."""

    bucket: int
    index: None = None
    bit: None = None
    bits: None = None
    old: None = None
    new: None = None
    old_bits: None = None
    new_bits: None = None
    elements: int
    changed: int
    riders: bool = True
    old_norm: float
    new_norm: float
    from_step: int | None  # a stale contribution's step
    fired: bool
    group: list[int] | None = optional()


@dataclass(frozen=True, kw_only=True)
class LaneInject(Inject):
    """A defective unit struck one matrix multiply (`tensor`: the innermost module whose forward
    made it; `product`: its place among the products made in the step while that module ran,
    its children's counted, from 1, as `fault.product` counts and matmul_checksum's alerts name
    it, `fc#2`): `bit` flipped
    in the outputs of lane `lane` of `lanes`, every one of its `elements`; the output's L2 norm
    before and after (non-finite as strings). `index`, `bits`, the values and their bit
    patterns stay None so that every inject record has the fields docs/design.md section 4
    gives it."""

    product: int
    index: None = None
    bit: int
    bits: None = None
    old: None = None
    new: None = None
    old_bits: None = None
    new_bits: None = None
    lane: int
    lanes: int
    elements: int
    old_norm: float | str
    new_norm: float | str
    fired: bool
    phase: str = "forward"
    dtype: str | None = optional()  # the struck output's: under autocast, not the workload's


@dataclass(frozen=True, kw_only=True)
class Checkpoint(RankEvent):
    kind = "checkpoint"
    step: int
    path: str


@dataclass(frozen=True, kw_only=True)
class Retry(RankEvent):
    """The trainer re-ran `step`'s reduction from the kept local gradients."""

    kind = "retry"
    step: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Stop(RankEvent):
    """The rank stopped training at `step` (a check in act mode, or "peer")."""

    kind = "stop"
    step: int
    detector: str


@dataclass(frozen=True, kw_only=True)
class HostReads(RankEvent):
    """Device-to-host reads of the checks' results over the trial."""

    kind = "host_reads"
    most_in_a_step: int
    total: int


@dataclass(frozen=True, kw_only=True)
class Locate(RankEvent):
    """Sub-group reductions left out each node in turn: which left-outs still summed wrong,
    and the node (and its ranks) whose absence made the sum right, if exactly one did."""

    kind = "locate"
    step: int
    wrong_without: list[int]
    suspect_ranks: list[int]
    suspect_nodes: list[int]


@dataclass(frozen=True, kw_only=True)
class Sensitivity(RankEvent):
    """The smallest change of one element a check could see in a bucket, and the bucket's
    gradient norm next to it."""

    kind = "sensitivity"
    step: int
    detector: str
    bucket: int
    bound: float
    grad_norm: float


@dataclass(frozen=True, kw_only=True)
class CorruptCheckpoint(Event):
    """Recovery found a checkpoint whose checksum does not verify and passed over it."""

    kind = "corrupt_checkpoint"
    step: int
    path: str
    time: float


@dataclass(frozen=True, kw_only=True)
class Crash(Event):
    kind = "crash"
    cause: str
    time: float


@dataclass(frozen=True, kw_only=True)
class TrialAlert(Event):
    """One alert per (step, detector, phase) of a trial, and of its recovery segment (`segment`
    as its alerts', None for the last), merged over the ranks that raised it: the earliest
    time, the first rank's evidence, the union of the suspects."""

    kind = "trial_alert"
    step: int
    detector: str
    phase: str
    time: float
    evidence: Any
    suspect_ranks: list[int]
    suspect_nodes: list[int]
    raised_by: list[int]


ALL: tuple[type[Event], ...] = (
    Alert,
    CheckWarning,
    ElementInject,
    ContributionInject,
    LaneInject,
    Checkpoint,
    Retry,
    Stop,
    HostReads,
    Locate,
    Sensitivity,
    CorruptCheckpoint,
    Crash,
    TrialAlert,
)
# Every kind name and the class that reads its records (Inject picks its variant).
KINDS: dict[str, type[Event]] = {cls.kind: cls for cls in ALL} | {Inject.kind: Inject}

E = TypeVar("E", bound=Event)


def of(cls: type[E], events: Iterable[Event]) -> list[E]:
    """The events of one kind (or family: Inject is both shapes), in order."""
    return [e for e in events if isinstance(e, cls)]


@functools.cache
def _body(cls: type[Event]) -> tuple[tuple[str, bool], ...]:
    """The fields between `kind` and the segment, in order, each with whether it is optional."""
    return tuple(
        (f.name, bool(f.metadata.get("optional")))
        for f in dataclasses.fields(cls)
        if f.name not in ENVELOPE
    )


def to_record(event: Event) -> dict[str, Any]:
    """The event as events.jsonl holds it (see the module docstring for the key order)."""
    record: dict[str, Any] = {} if event.trial_id is None else {"trial_id": event.trial_id}
    record["kind"] = event.kind
    for name, is_optional in _body(type(event)):
        value = getattr(event, name)
        if value is not None or not is_optional:
            record[name] = value
    if event.segment is not None:
        record["segment"] = event.segment
    return record


def from_record(record: dict[str, Any]) -> Event:
    """The event a record of events.jsonl holds; a record of no known kind is a ValueError."""
    kind = record.get("kind")
    if kind not in KINDS:
        raise ValueError(f"not an event record (kind {kind!r}; known: {', '.join(KINDS)})")
    cls = KINDS[kind].variant(record)
    return cls(**{k: v for k, v in record.items() if k != "kind"})
