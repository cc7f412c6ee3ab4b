"""Run a campaign: golden runs first (the reference for every effect), then every trial, each row
appended durably as soon as its trial ends. Rerunning with the same `out` resumes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from harness.campaign import coverage, overhead
from harness.campaign.fastforward import (
    drop_snapshots,
    fast_forwarded,
    golden_specs,
    has_snapshots,
)
from harness.campaign.golden_store import GoldenMismatch, GoldenStore, code_version
from harness.campaign.recovery import run_with_recovery, scratch_folders
from harness.config.schema import RunConfig, TopologyConfig, TrialSpec
from harness.config.workload import release_probes
from harness.core.values import writable
from harness.core.vocabulary import Effect, EffectSource
from harness.errors import ConfigError
from harness.launch import stacks
from harness.launch.world import World, WorldStartError
from harness.results import machine
from harness.results.folder import RunFolder, campaign_identity, identity_changes
from harness.results.judgement import Judged, golden_from, noise_band, trial_row
from harness.results.records import Records
from harness.results.schema import Golden, TrialResult
from harness.results.trial_row import TrialRow
from harness.runtime import environment, last_words

logger = logging.getLogger(__name__)


class CampaignError(RuntimeError):
    pass


def _identity(run: RunConfig) -> str:
    return campaign_identity(dataclasses.asdict(run))


@dataclass(frozen=True)
class Held:
    """What `out`'s campaign.json binds the folder to."""

    identity: str  # the campaign, as `_identity` writes it
    environment: dict | None  # None: written before environments were recorded
    code: dict | None  # its sources' digests (code_version); None: before they were recorded
    device: str | None  # the device its ranks resolved (a torchrun plan leaves it to them)


def _bound_to(out: Path) -> Held | None:
    """What `out`'s campaign.json holds (None without one, or one that cannot be read)."""
    held = RunFolder(out).campaign_record()
    if held is None:
        return None
    device = (held.get("topology") or {}).get("device")
    return Held(campaign_identity(held), held.get("environment"), held.get("code"), device)


# What Hydra's sweeper writes at the top of a sweep's folder.
SWEEP_CONFIG = "multirun.yaml"


def _written(record: Path) -> bool:
    """Whether a campaign wrote `record`: a file, or a folder holding anything but hidden files
    (a torchrun world makes the store to see that every host shares it before it binds the
    folder, and a host's probe may outlive a killed world)."""
    if record.is_dir():
        return any(not p.name.startswith(".") for p in record.iterdir())
    return record.exists()


def check_out(out: Path, run: RunConfig) -> None:
    """Refuse an `out` that cannot be written, that holds a different campaign's trials or
    another code's, or a campaign's records without its campaign.json (before any process
    starts; whether the environment matches is the ranks' to say, `bind`)."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError("out", f"{existing} is not a folder; choose an out that can be created")
    if not writable(existing):
        raise ConfigError("out", f"{existing} is not writable; choose another out")
    if (out / SWEEP_CONFIG).exists():
        raise ConfigError(
            "out", f"{out} is a sweep's folder ({SWEEP_CONFIG}), whose merged report a campaign "
            "would overwrite and whose reports would count its trials; choose a new out"
        )  # fmt: skip
    held = _bound_to(out)
    if held is None:
        left = [p.name for p in RunFolder(out).records if _written(p)]
        if left:
            raise ConfigError(
                "out", f"{out} holds a campaign's records of unknown origin ({', '.join(left)}; "
                "no readable campaign.json); choose a new out"
            )  # fmt: skip
        return
    # Its goldens, snapshots and rows are that code's: a resume by other code would mix two
    # versions' rows and judge the new against the old goldens. First: an older harness wrote
    # its config in another shape, which reads as another campaign.
    code = code_version(run.workload)
    if held.code != code:
        changed = machine.code_changes(held.code or {}, code)
        why = f"{', '.join(changed)} changed" if held.code is not None else "not recorded"
        raise ConfigError(
            "out", f"{out} was computed by other code ({why}): resume it with the code that "
            "started it, or choose a new out"
        )  # fmt: skip
    # A torchrun plan's device is the ranks' to resolve (None), and campaign.json holds what
    # they resolved: the plan written again for the same campaign is that campaign.
    if run.topology.device is None:
        resolved = dataclasses.replace(run.topology, device=held.device)
        run = dataclasses.replace(run, topology=resolved)
    identity = _identity(run)
    if held.identity != identity:
        changed = identity_changes(held.identity, identity)
        shown = "; ".join(changed[:4]) + ("; ..." if len(changed) > 4 else "")
        raise ConfigError(
            "out", f"{out} holds a different campaign's trials (this command changes {shown}); "
            "choose a new out to keep them"
        )  # fmt: skip


def bind(out: Path, run: RunConfig, ranks: list[environment.RankEnvironment]) -> None:
    """Bind `out` to this campaign and record the environment its ranks reported (after
    `check_out`, before the first trial). A resume keeps the first record, and is refused when
    the ranks now compute in an environment that gives other numbers (the trials' goldens
    would not be theirs); another CPU model, or another commit of the same sources (the
    sources' digests are `check_out`'s to compare), resumes."""
    check_out(out, run)
    now = environment.record(ranks)
    held = _bound_to(out)
    if held is not None:
        before = held.environment
        changed = [f for f in machine.differences(before, now) if f in machine.NUMERIC]
        if changed:
            was = ", ".join(f"{f} {(before or {}).get(f, '?')} -> {now[f]}" for f in changed)
            raise ConfigError(
                "out", f"{out} was computed in another environment ({was}); resume it there "
                "or choose a new out"
            )  # fmt: skip
        return
    out.mkdir(parents=True, exist_ok=True)
    content = {
        **dataclasses.asdict(run),
        "environment": now,
        "code": code_version(run.workload),
        "product_coverage": coverage.product_coverage(run).record(),
    }
    path = RunFolder(out).campaign
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(content, sort_keys=True, indent=1))
    tmp.replace(path)


class Executor(Protocol):
    """Where a campaign's trials run: spawned worlds here, torchrun's world in
    harness/launch/torchrun_world.py. `lost` names what ended a world that cannot be replaced (the
    campaign then stops after recording the trial it crashed); None while trials can run."""

    lost: str | None

    def start(self, topology: TopologyConfig) -> list[environment.RankEnvironment]: ...

    def run(self, run: RunConfig, spec: TrialSpec) -> TrialResult: ...

    def run_golden(self, run: RunConfig, spec: TrialSpec) -> TrialResult: ...

    def kill(self) -> None: ...

    def close(self) -> None: ...


class SpawnExecutor:
    """Runs trials in a spawned world, and spawns a fresh one after a crash. A world that does
    not start gets one more try in a fresh world. `log` (the run's crashes.log) gets each crash's
    cause, the stacks of the ranks that hung, and every retry."""

    lost = None  # a crash costs this world, never the next trial's: that one gets a fresh world

    def __init__(
        self,
        topology: TopologyConfig,
        workdir: Path,
        store: Path,
        log: Path,
        preload: tuple[str, ...] = (),
    ):
        self.topology = topology
        self.preload = preload
        self.workdir = workdir
        self.store = store
        self.log = log
        self.world: World | None = None

    def start(self, topology: TopologyConfig) -> list[environment.RankEnvironment]:
        """A live world of `topology` (started unless one runs); what its ranks compute with."""
        if self.world is not None and self.world.alive and self.world.topology != topology:
            self.world.close()
        if self.world is None or not self.world.alive:
            self.world = self._start(topology)
        return self.world.environments

    def run(self, run: RunConfig, spec: TrialSpec) -> TrialResult:
        """Run a trial (or a recovery segment, whose world may be smaller) in a live world."""
        self.start(run.topology)
        outcome = self.world.run(run, spec)
        if outcome.crash is not None:
            stacks.append_log(self.log, f"{spec.trial_id} crashed: {outcome.crash}", outcome.stacks)
        return outcome

    def run_golden(self, run: RunConfig, spec: TrialSpec) -> TrialResult:
        """A golden run has no fault in it: a crash came from the world, which gets one more
        try in a fresh one, unless every rank raised the same error on the same line (the
        workload's own, which a fresh world would raise again)."""
        outcome = self.run(run, spec)
        if outcome.crash is None or outcome.workload_error:
            return outcome
        self._retrying(spec.trial_id, outcome.crash)
        outcome = self.run(run, spec)
        if outcome.crash is None:
            stacks.append_log(self.log, f"{spec.trial_id} finished on its second try")
        return outcome

    def _start(self, topology: TopologyConfig) -> World:
        try:
            return World(topology, self.workdir, self.store, self.preload)
        except WorldStartError as exc:
            stacks.append_log(self.log, str(exc), exc.stacks)
            self._retrying("the world's start", str(exc))
        try:
            return World(topology, self.workdir, self.store, self.preload)
        except WorldStartError as exc:
            stacks.append_log(self.log, f"{exc} (second try)", exc.stacks)
            raise CampaignError(f"{exc}, twice (stacks in {self.log})") from None

    def _retrying(self, what: str, cause: str) -> None:
        logger.warning("%s failed (%s); retrying once", what, cause)
        stacks.append_log(self.log, f"{what} failed: retrying once in a fresh world")

    def kill(self) -> None:
        if self.world is not None:
            self.world.kill()

    def close(self) -> None:
        if self.world is not None:
            self.world.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


class Campaign:
    """The ledger of one campaign folder: what is pending, and what to do with each outcome.

    Shared by the spawned world and the torchrun world, so both write the same rows.
    """

    def __init__(self, run: RunConfig, out: Path):
        check_out(out, run)
        self.run = run
        self.folder = RunFolder(out)
        self.records = Records(out)
        done = self.records.resume()
        self.goldens = self.records.goldens()
        trials = [t for t in run.trials if t.trial_id not in done]
        # A golden run whose result is recorded runs again when trials still to run need the
        # snapshots it saves and they are gone (a finished campaign drops them): the trials
        # then start where an uninterrupted campaign's did, and give the same rows.
        starting = {t.seed for t in trials if t.fault.first_step > 0}
        self.pending = [
            g
            for g in golden_specs(run)
            if g.seed not in self.goldens
            or (g.seed in starting and not has_snapshots(self.folder.store, g, run))
        ]
        self.pending += trials
        self.store: GoldenStore | None = None

    def use_store(self, store: GoldenStore) -> list[Golden]:
        """Take every pending golden run that `store` can stand in for (its result, and the
        snapshots its trials start from); the goldens it gave."""
        self.store = store
        reused = []
        for spec in [p for p in self.pending if p.golden]:
            golden = store.reuse(spec, self.folder.store)
            if golden is None:
                continue
            self._keep(spec, golden)
            self.pending.remove(spec)
            reused.append(golden)
        return reused

    def _keep(self, spec: TrialSpec, golden: Golden) -> None:
        known = self.goldens.get(golden.seed)
        if known is None:
            self.records.add_golden(golden)
            self.goldens[golden.seed] = golden
        elif known != golden:
            raise CampaignError(
                f"golden run {spec.trial_id} did not reproduce its recorded result "
                f"({known} then {golden}): the run is not deterministic"
            )

    def prepared(self, spec: TrialSpec) -> TrialSpec:
        """The spec to run: a trial fast-forwards from its golden run's snapshot. What an
        interrupted run of it kept before a crash is no strike of this run."""
        last_words.forget(self.folder.trial_store(spec.trial_id))
        return fast_forwarded(self.run, spec, self.folder.store)

    def observe_twin(self, spec: TrialSpec) -> TrialSpec | None:
        """The same scenario and seed with every check observing, for a trial that a check may
        stop (act mode, recovery): its effect is judged on the twin, so it describes the fault,
        not how early training stopped (docs/design.md, section 5)."""
        checks = self.run.checks(spec)
        if spec.golden or spec.fault.clean or not any(c.acts for c in checks.values()):
            return None
        observing = {name: config.in_mode("observe") for name, config in checks.items()}
        return replace(spec, trial_id=f"{spec.trial_id}~observe", checks=observing)

    def record(
        self, spec: TrialSpec, outcome: TrialResult, twin: TrialResult | None = None
    ) -> TrialRow | None:
        """Store a golden result, or append a trial's row; return the row. `twin` is the
        outcome of `observe_twin(spec)`, when it has one."""
        # Only a crashed trial's ranks kept their strikes: the others return them in `parts`.
        # Read once, then gone: a kept store holds checkpoints, not these.
        kept = [] if outcome.parts else last_words.read(self.folder.trial_store(spec.trial_id))
        last_words.forget(self.folder.trial_store(spec.trial_id))
        if not self.run.checkpoint.keep and not spec.golden:
            for trial_id in (spec.trial_id, f"{spec.trial_id}~observe"):
                shutil.rmtree(self.folder.trial_store(trial_id), ignore_errors=True)
        if spec.golden:
            if outcome.parts is None and outcome.workload_error:
                raise CampaignError(
                    f"golden run {spec.trial_id}: the workload fails on every rank, the same "
                    f"way: {outcome.crash}"
                )
            if outcome.parts is None:
                raise CampaignError(f"golden run {spec.trial_id} crashed: {outcome.crash}")
            golden = golden_from(spec, outcome.parts)
            self._keep(spec, golden)
            if self.store is not None:
                try:
                    self.store.put(spec, golden, self.folder.store)
                except GoldenMismatch as exc:
                    raise CampaignError(str(exc)) from None
                except OSError as exc:  # the store is a shortcut: the campaign goes on without
                    logger.warning("golden store: cannot keep %s: %s", spec.trial_id, exc)
            return None
        band = noise_band([self.goldens[s] for s in self.run.reference_seeds])
        golden = self.goldens[spec.seed]
        judged = None if twin is None else Judged(twin.parts, twin.crash, EffectSource.OBSERVE_TWIN)
        row, events = trial_row(
            self.run, spec, outcome.parts, outcome.crash, golden, band, outcome.recovery, judged,
            kept,
        )  # fmt: skip
        self.records.add_trial(row, events)
        return row

    def finish(self) -> None:
        """Every trial has a row: drop the golden runs' snapshots (unless checkpoints are kept)."""
        drop_snapshots(self.folder.store, self.run)


def run_campaign(run: RunConfig, out: Path, executor: Executor | None = None) -> Path:
    """Run every pending trial of `run` into `out`, in spawned worlds unless `executor` says
    where; return trials.csv."""
    campaign, folder = Campaign(run, out), RunFolder(out)
    recorded = len(run.trials) - sum(not p.golden for p in campaign.pending)
    if recorded:
        logger.info("resuming %s: %d of %d trials already recorded", out, recorded,
                    len(run.trials))  # fmt: skip
    if not campaign.pending and not overhead.wanted(run, out):
        # Nothing to run: no world to start (seconds), only the report to write again, and the
        # golden snapshots to drop where a run stopped after its last row or now keeps none,
        # and the world folder such a stop left (pid files, rendezvous, stacks), which a world
        # closing removes on every other path.
        logger.info("%s: every trial is recorded; nothing to run", out)
        campaign.finish()
        shutil.rmtree(folder.world, ignore_errors=True)
        return campaign.records.trials
    if run.recovery.enabled:
        scratch_folders(out, run)
    if executor is None:
        executor = SpawnExecutor(
            run.topology, folder.world, folder.store, folder.crash_log, run.workload.imports()
        )
    bar = tqdm(total=len(campaign.pending), unit="trial", mininterval=1.0)
    alerts = crashes = 0
    try:
        ranks = executor.start(run.topology)
        bind(out, run, ranks)
        release_probes()  # validation's model, whose products campaign.json counted
        if run.golden_cache is not None:
            store = GoldenStore(Path(run.golden_cache), run, environment.record(ranks))
            reused = campaign.use_store(store)
            if reused:
                seeds = ", ".join(str(g.seed) for g in reused)
                logger.info("golden store: %d of the golden runs reused from %s (seeds %s)",
                            len(reused), run.golden_cache, seeds)  # fmt: skip
                bar.reset(total=len(campaign.pending))
        for pending in campaign.pending:
            bar.set_description(pending.trial_id)
            spec = campaign.prepared(pending)
            if spec.golden:
                outcome = executor.run_golden(run, spec)
            elif run.recovery.enabled:
                outcome = run_with_recovery(run, spec, executor.run, out)
            else:
                outcome = executor.run(run, spec)
            twin = campaign.observe_twin(pending)
            if twin is not None:
                twin = executor.run(run, campaign.prepared(twin))
            try:
                row = campaign.record(spec, outcome, twin)
            except OSError as exc:
                raise CampaignError(
                    f"cannot write results in {out}: {exc.strerror or exc}; every row written "
                    "before is intact, and a rerun resumes once there is room"
                ) from exc
            if row is not None:
                alerts += row.alerts
                crashes += row.effect == Effect.CRASH
                bar.set_postfix(alerts=alerts, crashes=crashes, refresh=False)
            bar.update()
            if executor.lost:
                raise CampaignError(
                    f"{executor.lost}; every row written before is intact, and rerunning the "
                    "same command resumes in a fresh world"
                )
        campaign.finish()
        try:
            overhead.measure(run, out, executor.run)
        except overhead.OverheadError as exc:
            raise CampaignError(f"{exc}; every trial row is intact") from exc
    except KeyboardInterrupt:
        executor.kill()
        raise
    finally:
        bar.close()
        executor.close()
    return campaign.records.trials
