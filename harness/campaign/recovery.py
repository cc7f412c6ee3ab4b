"""Recovery: on an alert in act mode every rank stops at the same point; the suspect node is
quarantined (replaced by a spare, or the world shrinks and keeps the global batch); training
rolls back to the newest verified checkpoint saved before the suspect interval and runs to the
planned end. A loop limit turns endless recovery into a verdict.

The fault lives on hardware (docs/design.md, section 5): a spare that takes over a quarantined
node's ranks is healthy, so re-executing the same steps does not re-inject, and a transient fault,
met once, is not met again when its step is re-executed (`Segment.unmet`). A fault that follows
the data (`fault.follows=data`) keeps striking, which is what the loop limit is for.

Every way a run gets back is a recovery in its row, of one of results.schema's RECOVERY_KINDS:
the trainer's in-step retry of a wrong reduction (harness/runtime/trainer.py, `_stop_point`),
which needs no stop here, a rollback, and a rollback that quarantined the suspect nodes.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import detectors
from harness.config.schema import RunConfig, Segment, TrialSpec
from harness.core.checks import CheckConfig
from harness.core.events import (
    Alert,
    CorruptCheckpoint,
    Event,
    Inject,
    Locate,
    Retry,
    TrialAlert,
)
from harness.errors import ConfigError
from harness.results.folder import RunFolder
from harness.results.judgement import merge_alerts
from harness.results.schema import RecoveryRecord, TrialResult
from harness.runtime import checkpoint


@dataclass
class Machines:
    """Which machine nodes hold the world's positions, which spares are left, and whose data
    each rank trains on. Machine ranks are node * ranks_per_node + local rank; spares are
    numbered after the original nodes."""

    per_node: int
    nodes: list[int]
    spares: list[int]
    data: list[tuple[int, ...]]
    quarantined: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, run: RunConfig) -> Machines:
        topo = run.topology
        spares = list(range(topo.nodes, topo.nodes + topo.spares))
        data = [(r,) for r in range(topo.world_size)]
        return cls(topo.ranks_per_node, list(range(topo.nodes)), spares, data)

    def hardware(self) -> tuple[int, ...]:
        return tuple(
            n * self.per_node + local for n in self.nodes for local in range(self.per_node)
        )

    def node_of(self, rank: int) -> int:
        return self.nodes[rank // self.per_node]

    def quarantine(self, node: int) -> None:
        """Replace `node` by a spare, or drop it and hand its ranks' data to the others."""
        position = self.nodes.index(node)
        self.quarantined.append(node)
        if self.spares:
            self.nodes[position] = self.spares.pop(0)
            return
        start = position * self.per_node
        orphaned = [d for ranks in self.data[start : start + self.per_node] for d in ranks]
        del self.nodes[position]
        del self.data[start : start + self.per_node]
        for i, source in enumerate(orphaned):
            target = i % len(self.data)
            self.data[target] = (*self.data[target], source)


def earliest_suspect(
    alerts: list[Alert] | list[TrialAlert],
    checks: dict[str, CheckConfig],
    checkpointed: Callable[[int], bool],
) -> int:
    """The earliest step any of `alerts` puts in doubt (`Detector.first_suspect_step`): checks
    that alarm at one step may suspect different steps (a value check the updates before its
    step, a product check its step), so no one alert's bound may be taken for all."""
    return min(
        detectors.detector_class(a.detector).first_suspect_step(checks[a.detector], a.step,
                                                                checkpointed)
        for a in alerts
    )  # fmt: skip


def restore_point(
    store: Path,
    before: int,
    log: list[Event],
    suspect: Callable[[int, Path], bool] | None = None,
) -> tuple[int, str]:
    """The newest checkpoint saved before step `before`, not `suspect(step, path)`, whose
    checksum verifies; (-1, "") means start over from the initial weights."""
    for step, path in reversed(checkpoint.saved(store)):
        if step >= before or (suspect is not None and suspect(step, path)):
            continue
        if checkpoint.verify(path):
            return step, str(path)
        log.append(CorruptCheckpoint(step=step, path=str(path), time=time.time()))
    return -1, ""


def run_with_recovery(
    run: RunConfig,
    spec: TrialSpec,
    execute: Callable[[RunConfig, TrialSpec], TrialResult],
    out: Path,
) -> TrialResult:
    """Run one trial; after each stop, quarantine, roll back and resume until it completes or
    the loop limit gives a verdict. `execute(run, spec)` runs a segment in a world."""
    machines = Machines.start(run)
    folder = RunFolder(out)
    store = folder.trial_store(spec.trial_id)
    record = RecoveryRecord()
    extra_events: list[Event] = []  # the stopped segments' events, each marked with its segment
    plain = set[int]()  # the steps whose wrong received sum was rolled back without quarantine
    struck = set[int]()  # the steps the fault struck at in the stopped segments
    segment_run, segment_spec = run, spec
    while True:
        started = time.monotonic()
        outcome = execute(segment_run, segment_spec)
        if record.stops:
            # Time not spent training: world start, checkpoint load, DDP setup.
            trained = max(sum(p.step_times) for p in outcome.parts) if outcome.parts else 0.0
            record.seconds += time.monotonic() - started - trained
        stop = next(
            (p.stopped_step for p in outcome.parts or [] if p.stopped_step is not None), None
        )
        record.recoveries += [f"retry at step {s}" for s in _retried(outcome, stop)]
        if stop is None:
            break
        segment = len(record.stops)
        # Every alert of the segment stopped it: in act mode each stops the first stop point
        # after it, which for a check that runs after the update (consensus) between two
        # checkpoints is the next step's, not its own.
        alerts = [
            a for a in merge_alerts([e for p in outcome.parts for e in p.events]) if a.step <= stop
        ]
        extra_events += [replace(e, segment=segment) for p in outcome.parts for e in p.events]
        struck |= {
            e.step for p in outcome.parts for e in p.events if isinstance(e, Inject) and e.fired
        }
        suspects = sorted({machines.node_of(r) for r in _suspect_ranks(outcome, alerts, stop)})
        record.stops.append((stop, tuple(suspects)))
        if _no_culprit(run, alerts, suspects, machines) and stop not in plain:
            plain.add(stop)
            suspects = []
        if len(record.stops) > run.recovery.max_recoveries:
            record.verdict = loop_verdict(record.stops, machines.quarantined)
            break
        # Consensus also runs before every checkpoint (`checkpoint.after`).
        first = earliest_suspect(alerts, run.checks(spec), run.checkpoint.after) if alerts else stop
        record.verdict = _cannot_go_on(run, spec, machines, suspects)
        if record.verdict:  # decided before any node is quarantined or checkpoint read
            break
        restore, path = restore_point(store, first, extra_events)
        for node in suspects:
            machines.quarantine(node)
            shutil.rmtree(folder.node(node), ignore_errors=True)
        topology = replace(run.topology, nodes=len(machines.nodes))
        record.restores.append(restore)
        record.steps_lost += stop - restore
        back = f"at step {stop} to step {restore}"
        nodes = ", ".join(map(str, suspects))
        record.recoveries.append(
            f"rollback+quarantine {back} (node {nodes})" if suspects else f"rollback {back}"
        )
        segment_run = replace(run, topology=topology)
        resume = Segment(
            restore + 1, path, machines.hardware(), tuple(machines.data), tuple(sorted(struck))
        )
        segment_spec = replace(spec, segment=resume)
    if outcome.parts:
        if stop is not None:  # a verdict ended it: this segment's events are in extra_events
            for part in outcome.parts:
                part.events.clear()
        outcome.parts[0].events[:0] = extra_events
    record.completed = outcome.parts is not None
    record.quarantined = tuple(machines.quarantined)
    record.final_nodes = len(machines.nodes)
    outcome.recovery = record
    return outcome


def _cannot_go_on(
    run: RunConfig, spec: TrialSpec, machines: Machines, suspects: list[int]
) -> str | None:
    """Why the world left once `suspects` are quarantined cannot run the trial, or None: no node
    left; a sharded world short of spares (its mesh keeps its size: validation asks a spare
    per recovery, and a recovery may suspect several nodes); or too few nodes for the trial's
    checks (replay's three, a majority's three replicas), whose alerts there would name
    suspects on grounds the check does not have."""
    lost = max(0, len(suspects) - len(machines.spares))
    if lost == len(machines.nodes):
        return "no healthy node left to run on"
    if lost and run.topology.parallel != "ddp":
        return (
            f"{len(suspects)} suspect nodes and {len(machines.spares)} spare(s) left: a sharded "
            "world keeps its size"
        )
    topology = replace(run.topology, nodes=len(machines.nodes) - lost)
    for name, config in run.checks(spec).items():
        try:
            detectors.detector_class(name).check_topology(config, topology)
        except ConfigError as error:
            return f"{topology.nodes} node(s) left, too few for {name}: {error.message}"
    return None


def _no_culprit(
    run: RunConfig, alerts: list[TrialAlert], suspects: list[int], machines: Machines
) -> bool:
    """Whether a stop names no node the fault can be laid on: a sharded wrong received sum
    (below), or every node of the world, named by a check that cannot tell the ranks apart (a
    NaN in one FSDP optimizer shard reaches every rank's gathered weights). Rolled back to
    without quarantine the first time at that step; a fault that strikes it again gets its
    suspects quarantined, or the verdict that the world cannot spare them. Quarantined at once,
    every node was lost: the sharded trial ended unrecovered, the DDP one on one node."""
    everyone = len(suspects) > 1 and len(suspects) == len(machines.nodes)
    return everyone or _received_sum(run, alerts, suspects)


def _received_sum(run: RunConfig, alerts: list[TrialAlert], suspects: list[int]) -> bool:
    """Whether a sharded stop is a wrong received sum that names several nodes' receivers: the
    first naming alert's, after the reduction. Rolled back to without quarantine the first time,
    as DDP's trainer re-runs such a reduction in its step (`_stop_point`): a sharded world keeps
    no contributions to re-run it from, and the receivers of one shard in every replica group
    are no node the fault can be laid on. A transient fault ends there; one that strikes the
    step again gets its receivers quarantined."""
    first = next((a for a in alerts if a.suspect_ranks and attributes(a.detector)), None)
    sharded = run.topology.parallel != "ddp"
    return sharded and len(suspects) > 1 and first is not None and first.phase == "post_allreduce"


def _retried(outcome: TrialResult, stop: int | None) -> list[int]:
    """The steps whose reduction the trainer re-ran and that then went on: a retry at the step
    the segment stopped at did not get the run back (the repeat was wrong too)."""
    steps = {e.step for p in outcome.parts or [] for e in p.events if isinstance(e, Retry)}
    return sorted(s for s in steps if s != stop)


def _suspect_ranks(outcome: TrialResult, alerts: list[TrialAlert], stop: int) -> set[int]:
    """The ranks a stop at step `stop` suspects: the node that sub-group reductions located
    when a repeated reduction fault named none (harness/runtime/locate.py), else those the
    first alert that names any names, among the checks whose alerts attribute (the guard's
    alarm too, which orders one phase's alerts by time, not by check). The row's
    `attribution_correct` judges the first alert, which may name none (a NaN seen after the
    reduction), and its `attributions` each check's first.
    Not every alert's: a check after the reduction that cannot tell the ranks apart may name
    them all, and their union quarantined every healthy node and left the faulty one."""
    located = {
        r
        for p in outcome.parts
        for e in p.events
        if isinstance(e, Locate) and e.step == stop
        for r in e.suspect_ranks
    }
    return located or attributed_ranks(alerts)


def attributed_ranks(alerts: Sequence[Alert | TrialAlert]) -> set[int]:
    """The ranks the first alert that names any names, among those of checks whose alerts
    attribute (`Detector.attributes`)."""
    named = (a.suspect_ranks for a in alerts if a.suspect_ranks and attributes(a.detector))
    return set(next(named, []))


def attributes(name: str) -> bool:
    """Whether check `name`'s alerts name culprits (`Detector.attributes`)."""
    return detectors.detector_class(name).attributes


def loop_verdict(history: list[tuple[int, tuple[int, ...]]], quarantined: list[int]) -> str:
    """Why the trial ended at the loop limit (`recovery.max_recoveries`), from its stops (step,
    suspect nodes) and the nodes its recoveries quarantined. Rollbacks that replaced no node (a
    stop no node explains: rolled back without quarantine) say nothing of the data or the code:
    the suspects of a repeat were left unquarantined by the limit."""
    steps = {s for s, _ in history}
    if not quarantined:
        step, suspects = history[-1]
        nodes = ", ".join(map(str, suspects))
        left = f"its suspects (node {nodes}) were not quarantined" if suspects else "none named"
        return (
            f"step {step} alarms again after {len(history) - 1} rollback(s) that replaced no "
            f"node, and recovery.max_recoveries allows no more: {left}"
        )
    if len(steps) == 1:
        return (
            f"step {history[0][0]} alarms after every recovery, on replaced hardware: the fault "
            "is in the data or the code, not a node"
        )
    return f"alarms continue after {len(history) - 1} recoveries: the fault is not in one node"


def scratch_folders(out: Path, run: RunConfig) -> None:
    """A local scratch folder per machine node (spares included), wiped on replacement:
    nothing a recovery needs may live there, which is why checkpoints go to out/store."""
    for node in range(run.topology.nodes + run.topology.spares):
        RunFolder(out).node(node).mkdir(parents=True, exist_ok=True)
