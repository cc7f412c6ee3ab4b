"""Judge one trial after the fact: join its alerts with its injections and compare it with the
golden run, exactly as docs/design.md section 5 defines fired, effect, detected, contained and
attribution. Detectors never see any of this; only the harness, once the trial is over.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, replace
from typing import TypeVar

from harness.config.schema import FaultConfig, RunConfig, TrialSpec
from harness.core.events import (
    Alert,
    Checkpoint,
    CheckWarning,
    Crash,
    ElementInject,
    Event,
    Inject,
    LaneInject,
    TrialAlert,
)
from harness.core.formats import classify_bit
from harness.core.phases import PHASE_ORDER, STRIKE_PHASE
from harness.core.vocabulary import (
    GRADIENT_SITES,
    Effect,
    EffectSource,
    Parallel,
    Persistence,
    Scope,
    Site,
)
from harness.results.schema import Golden, RankResult, RecoveryRecord
from harness.results.trial_row import TrialRow

V = TypeVar("V", int, bool)  # a `name=value` column's values


def noise_band(goldens: list[Golden]) -> float:
    """Seed-to-seed spread of the golden final loss: max minus min over the reference seeds
    (`RunConfig.reference_seeds`, a fixed set: a range only widens with more runs, so a
    threshold over every seed a campaign runs would relabel trials as campaigns grow)."""
    losses = [g.final_loss for g in goldens]
    return max(losses) - min(losses)


def golden_from(spec: TrialSpec, parts: list[RankResult]) -> Golden:
    digests = {p.weights_digest for p in parts}
    assert len(digests) == 1, f"golden replicas diverged in {spec.trial_id}"
    return Golden(spec.seed, parts[0].final_loss, digests.pop())


def merge_alerts(events: list[Event]) -> list[TrialAlert]:
    """One alert per (segment, step, detector, phase) (a `trial_alert`), its suspects the union
    over the ranks that raised it, ordered as they happened: segment by segment (recovery's
    earlier runs of the trial first, whose worlds number their ranks otherwise), then in the
    step."""
    groups: dict[tuple, list[Alert]] = {}
    for e in events:
        if isinstance(e, Alert):
            groups.setdefault((_segment_order(e), e.step, e.detector, e.phase), []).append(e)
    merged = [
        (order, TrialAlert(
            step=step,
            detector=detector,
            phase=phase,
            time=min(a.time for a in alerts),
            evidence=alerts[0].evidence,
            suspect_ranks=sorted({r for a in alerts for r in a.suspect_ranks}),
            suspect_nodes=sorted({n for a in alerts for n in a.suspect_nodes}),
            raised_by=sorted({a.rank for a in alerts}),
            segment=alerts[0].segment,
        ))
        for (order, step, detector, phase), alerts in groups.items()
    ]  # fmt: skip
    merged.sort(key=lambda oa: (oa[0], oa[1].step, PHASE_ORDER[oa[1].phase], oa[1].detector))
    return [alert for _, alert in merged]


def _segment_order(event: Event) -> float:
    """Where an event's segment comes: the stopped segments in order, then the last (its events
    carry none)."""
    return math.inf if event.segment is None else event.segment


def _bit(
    fault: FaultConfig, injections: list[Inject], workload_dtype: str
) -> tuple[int | str | None, str | None]:
    """The bit actually flipped when it was one bit of one dtype, with that dtype where it is
    not the workload's; else the configured bit, class or None, and no dtype."""
    flipped = {(e.bit, e.dtype) for e in injections if isinstance(e, ElementInject | LaneInject)}
    if len(flipped) == 1:
        bit, dtype = flipped.pop()
        if bit is not None:
            return bit, None if dtype in (None, workload_dtype) else dtype
    return fault.bit, None


def _bit_class(configured: int | str | None, bit: int | str | None, dtype: str) -> str | None:
    """The class of the trial's scenario: the configured class, else the bit's in `dtype`."""
    if isinstance(configured, str):
        return configured
    return None if bit is None else classify_bit(dtype, int(bit))


def _sorted(values) -> tuple:
    return tuple(sorted(values))


def _number(x: float) -> float | None:
    """A loss as a cell: None when it is not a number (the column is blank)."""
    return None if math.isnan(x) else x


@dataclass(frozen=True)
class Judged:
    """The run an effect is judged on: the trial itself, or its observe twin when a check
    stopped the trial (docs/design.md, section 5: the effect describes the fault)."""

    parts: list[RankResult] | None
    crash: str | None
    source: EffectSource = EffectSource.RUN


def trial_row(
    run: RunConfig,
    spec: TrialSpec,
    parts: list[RankResult] | None,
    crash: str | None,
    golden: Golden,
    band: float,
    recovery: RecoveryRecord | None = None,
    judged: Judged | None = None,
    kept: list[Event] | None = None,
) -> tuple[TrialRow, list[Event]]:
    """The trial's row for trials.csv and its events for events.jsonl; `recovery` holds what
    harness.campaign.recovery did (None: recovery was off); `judged` the observe twin's result when
    a check stopped this trial; `kept` what crashed ranks kept before they went down."""
    judged = judged or Judged(parts, crash)
    fault: FaultConfig = spec.fault
    events: list[Event] = [e for p in parts or [] for e in p.events] + (kept or [])
    events.sort(key=lambda e: (getattr(e, "step", -1), e.time))
    injections = [e for e in events if isinstance(e, Inject) and e.fired]
    alerts = merge_alerts(events)
    checkpoints = sorted({e.step for e in events if isinstance(e, Checkpoint)})

    fired = bool(injections)
    inject_step = min((e.step for e in injections), default=None)
    injected_ranks = {e.rank for e in injections}
    caught = [a for a in alerts if fired and after_injection(a, fault, inject_step)]
    first = caught[0] if caught else None
    own_first = _first_alert_by_check(caught)

    final_loss = worst_loss(parts)
    bit, bit_dtype = _bit(fault, injections, run.workload.dtype)
    row = TrialRow(
        trial_id=spec.trial_id,
        seed=spec.seed,
        workload=run.workload.name,
        dtype=run.workload.dtype,
        nodes=run.topology.nodes,
        ranks_per_node=run.topology.ranks_per_node,
        parallel=Parallel(run.topology.parallel),
        shard_size=run.topology.shard_size or None,
        site=Site(fault.site),
        model=fault.model,
        bit=bit,
        factor=fault.factor,
        value=fault.value or None,
        scope=Scope(fault.scope) if fault.scope else None,
        persistence=None if fault.clean else Persistence(fault.persistence),
        fired=fired,
        inject_step=inject_step,
        injected_ranks=_sorted(injected_ranks),
        effect=classify(fault, judged.parts, judged.crash, golden, band, fired),
        detected=bool(first),
        first_detector=first.detector if first else None,
        detect_step=first.step if first else None,
        ttd_steps=first.step - inject_step if first else None,
        ttd_seconds=first.time - min(e.time for e in injections) if first else None,
        contained=contained(fault, inject_step, first, checkpoints) if fired else None,
        alerts=len(alerts),
        suspect_ranks=_sorted(first.suspect_ranks) if first else (),
        suspect_nodes=_sorted(first.suspect_nodes) if first else (),
        attribution_correct=attribution(first, culprits(fault, struck_by(first, injections)), run)
        if first
        else None,
        final_loss=_number(final_loss),
        golden_final_loss=golden.final_loss,
        loss_delta=_number(final_loss - golden.final_loss),
        step_time_s=step_time(parts),
        campaign=run.campaign,
        detectors=_sorted(run.detectors),
        detected_by=_sorted({a.detector for a in caught}),
        alert_detectors=_sorted({a.detector for a in alerts}),
        fault_ranks=_sorted(fault.ranks),
        fault_steps=_sorted(fault.steps),
        golden_match=matches_golden(parts, golden),
        replicas_agree=None if parts is None else len({p.weights_digest for p in parts}) == 1,
        divergent_ranks=_sorted(divergent_ranks(parts, golden)),
        noise_band=band,
        stopped_step=next(
            (p.stopped_step for p in parts or [] if p.stopped_step is not None), None
        ),
        crash_cause=crash or None,
        # Where training began: a fast-forwarded trial starts from its golden run's snapshot.
        start_step=spec.segment.start_step if spec.segment else 0,
        damage=_sorted(damage(judged.parts)),
        effect_from=judged.source,
        # Each check's own first alert at or after the injection: its time to detection and
        # its attribution even when another check alerted first.
        detect_steps=_by_entry({d: a.step for d, a in own_first.items()}),
        attributions=_by_entry(
            {
                d: attribution(a, culprits(fault, struck_by(a, injections)), run)
                for d, a in own_first.items()
            }
        ),  # fmt: skip
        # The audit interval of each periodic check in this trial (a scenario may set them).
        check_intervals=_by_entry(
            {
                name: every
                for name, config in run.checks(spec).items()
                if (every := config.every) is not None
            }
        ),
        # What a check could not judge (replay: "not deterministic"), never counted as alerts;
        # `;` separates the cell's entries, so a text's own becomes `,`.
        warnings=_sorted(
            {
                f"{e.detector}: {e.what}".replace(";", ",")
                for e in events
                if isinstance(e, CheckWarning)
            }
        ),
        fault_class=spec.mix.name if spec.mix else None,
        weight=spec.mix.weight if spec.mix else None,
        bit_dtype=bit_dtype,
        bit_class=_bit_class(fault.bit, bit, bit_dtype or run.workload.dtype),
        precision=run.workload.precision,
        fault_phase=fault.phase if fault.site == Site.MATMUL else None,
        fault_settings=fault.settings_text() or None,
        alert_counts=_by_entry(dict(Counter(a.detector for a in alerts))),
        **(recovery.fields() if recovery else {}),
    )
    if crash:
        events.append(Crash(cause=crash, time=0.0))
    events += alerts
    return row, [replace(e, trial_id=spec.trial_id) for e in events]


def after_injection(alert: TrialAlert, fault: FaultConfig, inject_step: int) -> bool:
    """Whether `alert` came at or after the fault first struck: a later step, or the injection
    step from the phase the fault strikes in on (STRIKE_PHASE; a site without one, from the
    step's start)."""
    if alert.step != inject_step:
        return alert.step > inject_step
    backward = fault.site == Site.MATMUL and fault.phase == "backward"
    strikes = STRIKE_PHASE.get(f"{fault.site} backward" if backward else str(fault.site))
    return strikes is None or PHASE_ORDER[alert.phase] >= PHASE_ORDER[strikes]


def struck_by(alert: Alert, injections: list[Inject]) -> set[int]:
    """The ranks the fault had struck in the run (recovery's segment) that raised `alert`: a
    fault that follows the data strikes other ranks once recovery has moved the data, and the
    first alert named the ranks struck when it came."""
    return {e.rank for e in injections if e.segment == alert.segment}


def _by_entry(mapping: dict[str, V]) -> dict[str, V]:
    """A `name=value` column's entries in the order of their text, as the table has always
    listed them."""
    return dict(sorted(mapping.items(), key=lambda kv: f"{kv[0]}={kv[1]}"))


def _first_alert_by_check(caught: list[TrialAlert]) -> dict[str, TrialAlert]:
    first: dict[str, TrialAlert] = {}
    for alert in caught:
        first.setdefault(alert.detector, alert)
    return first


def worst_loss(parts: list[RankResult] | None) -> float:
    """The highest final loss over the replicas (NaN when any is NaN or the trial crashed)."""
    if parts is None:
        return math.nan
    losses = [p.final_loss for p in parts]
    return math.nan if any(math.isnan(x) for x in losses) else max(losses)


def matches_golden(parts: list[RankResult] | None, golden: Golden) -> bool:
    return parts is not None and all(p.weights_digest == golden.weights_digest for p in parts)


def damage(parts: list[RankResult] | None) -> list[str]:
    """What is wrong with the final state whatever the loss says: a broken data-parallel
    invariant, or values that can no longer train."""
    if not parts:
        return []
    found = []
    if len({p.weights_digest for p in parts}) > 1:
        found.append("replicas diverged")
    if not all(p.weights_finite for p in parts):
        found.append("non-finite weights")
    frozen = max(p.optimizer_nonfinite for p in parts)
    if frozen:
        found.append(f"non-finite optimizer state ({frozen} elements)")
    return found


def classify(
    fault: FaultConfig,
    parts: list[RankResult] | None,
    crash: str | None,
    golden: Golden,
    band: float,
    fired: bool = True,
) -> Effect:
    """The effect (docs/design.md, section 5): crash, none, masked, harmful, latent, benign.
    A planned fault that never struck (`fired` False: say, an intermittent one whose draws all
    missed) and left the run its golden run had no effect: `none`, as a clean trial, never
    `masked`, which would count it as a fault the model absorbed."""
    if crash or parts is None:
        return Effect.CRASH
    if fault.clean:
        return Effect.NONE
    if matches_golden(parts, golden):
        # Beside a damaged state (a non-finite moment struck at the last step): latent, as
        # the next update would spread it.
        if fired and damage(parts):
            return Effect.LATENT
        return Effect.MASKED if fired else Effect.NONE
    final_loss = worst_loss(parts)
    if not math.isfinite(final_loss) or abs(final_loss - golden.final_loss) > band:
        return Effect.HARMFUL
    return Effect.LATENT if damage(parts) else Effect.BENIGN


def contained(
    fault: FaultConfig, inject_step: int, first: TrialAlert | None, checkpoints: list[int]
) -> bool:
    """Alerted before any checkpoint holding the corruption and, for faults that enter the
    gradient, before the optimizer step of the injection step."""
    if first is None:
        return False
    if fault.site in GRADIENT_SITES and (
        first.step != inject_step or PHASE_ORDER[first.phase] >= PHASE_ORDER["optimizer"]
    ):
        return False
    # A checkpoint at step c is written after every check of step c, so it holds a corruption
    # injected at or before c, and comes after an alert raised in step c.
    return not any(inject_step <= c < first.step for c in checkpoints)


def culprits(fault: FaultConfig, injected_ranks: set[int]) -> set[int]:
    """The ranks whose hardware the fault models as broken: those it struck, but for a broken
    reduction (scope reduction), which strikes every receiver of its sum and is the hardware of
    the rank `fault.ranks` names (a contribution model's sender, node N's reduction)."""
    if fault.scope == Scope.REDUCTION and fault.ranks:
        return set(fault.ranks)
    return injected_ranks


def attribution(first: TrialAlert, culprits: set[int], run: RunConfig) -> bool:
    """The suspect set names the culprits (or their nodes) and nothing else."""
    if first.suspect_ranks:
        return set(first.suspect_ranks) == culprits
    nodes = {r // run.topology.ranks_per_node for r in culprits}
    return bool(first.suspect_nodes) and set(first.suspect_nodes) == nodes


def divergent_ranks(parts: list[RankResult] | None, golden: Golden) -> list[int]:
    """Ranks whose final weights differ from those a strict majority of the replicas holds, or,
    with no strict majority (an HSDP world's two replica groups split 2 against 2), from the
    golden run's: the most common digest of a tie is the first rank's, which named the healthy
    group whenever rank 0's was struck. Where no replica holds the golden weights either, no
    side can be called the healthy one, and every rank is named."""
    if not parts:
        return []
    common, count = Counter(p.weights_digest for p in parts).most_common(1)[0]
    reference = common if 2 * count > len(parts) else golden.weights_digest
    return [p.rank for p in parts if p.weights_digest != reference]


def step_time(parts: list[RankResult] | None) -> float | None:
    """Median over steps of the slowest rank's step time: the world moves at its slowest rank.
    None when no step completed (a fast-forwarded trial stopped in its first step)."""
    if not parts or not parts[0].step_times:
        return None
    return statistics.median(max(ts) for ts in zip(*(p.step_times for p in parts), strict=True))
