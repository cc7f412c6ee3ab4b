"""Run a campaign: golden runs first (the reference for every effect), then every trial, each row
appended durably as soon as its trial ends. Rerunning with the same `out` resumes.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from tqdm import tqdm

from harness.config import ConfigError, RunConfig, TopologyConfig, TrialSpec
from harness.outcome import golden_from, noise_band, trial_row
from harness.records import Records
from harness.world import Outcome, World

CAMPAIGN_FILE = "campaign.json"


class CampaignError(RuntimeError):
    pass


def _identity(run: RunConfig) -> str:
    return json.dumps(dataclasses.asdict(run), sort_keys=True, indent=1)


def check_out(out: Path, run: RunConfig) -> None:
    """Refuse an `out` that holds a different campaign's trials; the same campaign resumes."""
    path = out / CAMPAIGN_FILE
    if path.exists() and path.read_text() != _identity(run):
        raise ConfigError(
            "out", f"{out} holds a different campaign's trials; choose a new out to keep them"
        )
    if not path.exists() and (out / "trials.csv").exists():
        raise ConfigError("out", f"{out} holds trials of unknown origin; choose a new out")


def claim(out: Path, run: RunConfig) -> None:
    """Bind `out` to this campaign (after `check_out`)."""
    check_out(out, run)
    identity = _identity(run)
    path = out / CAMPAIGN_FILE
    if path.exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{CAMPAIGN_FILE}.tmp"
    tmp.write_text(identity)
    tmp.replace(path)


class SpawnExecutor:
    """Runs trials in a spawned world, and spawns a fresh one after a crash."""

    def __init__(self, topology: TopologyConfig, workdir: Path, store: Path):
        self.topology = topology
        self.workdir = workdir
        self.store = store
        self.world: World | None = None

    def run(self, run: RunConfig, spec: TrialSpec) -> Outcome:
        if self.world is None or not self.world.alive:
            self.world = World(self.topology, self.workdir, self.store)
        return self.world.run(run, spec)

    def close(self) -> None:
        if self.world is not None:
            self.world.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def run_campaign(run: RunConfig, out: Path) -> Path:
    """Run every pending trial of `run` into `out`; return the path of trials.csv."""
    claim(out, run)
    records = Records(out)
    done = records.resume()
    goldens = records.goldens()
    pending_golden = [g for g in run.golden_specs() if g.seed not in goldens]
    pending = [t for t in run.trials if t.trial_id not in done]
    executor = SpawnExecutor(run.topology, out / "world", out / "store")
    bar = tqdm(total=len(pending_golden) + len(pending), unit="trial", mininterval=1.0)
    alerts = crashes = 0
    try:
        for spec in pending_golden:
            bar.set_description(f"golden {spec.trial_id}")
            outcome = executor.run(run, spec)
            if outcome.parts is None:
                raise CampaignError(f"golden run {spec.trial_id} crashed: {outcome.crash}")
            golden = golden_from(spec, outcome.parts)
            records.add_golden(golden)
            goldens[golden.seed] = golden
            _drop_checkpoints(out, spec, run)
            bar.update()
        band = noise_band(list(goldens.values()))
        for spec in pending:
            bar.set_description(spec.trial_id)
            outcome = executor.run(run, spec)
            row, events = trial_row(
                run, spec, outcome.parts, outcome.crash, goldens[spec.seed], band
            )
            records.add_trial(row, events)
            _drop_checkpoints(out, spec, run)
            alerts += row["alerts"]
            crashes += row["effect"] == "crash"
            bar.set_postfix(alerts=alerts, crashes=crashes, refresh=False)
            bar.update()
    finally:
        bar.close()
        executor.close()
    return records.trials


def _drop_checkpoints(out: Path, spec: TrialSpec, run: RunConfig) -> None:
    if not run.checkpoint.keep:
        shutil.rmtree(out / "store" / spec.trial_id, ignore_errors=True)
