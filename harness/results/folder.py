"""A run folder's layout: every path a campaign writes under `out`, and the campaign.json that
binds the folder to one campaign. The campaign, recovery, the torchrun worker and the report
all find their files here, so the layout has one owner.

    out/campaign.json    the campaign's config, the environment its ranks computed in, the
                         digests of the code that computed it (`code`), and the share of a
                         step's product FLOPs matmul_checksum checks (`product_coverage`)
    out/trials.csv       one row per trial (harness/results/trial_row.py)
    out/events.jsonl     every trial's events, one JSON object per line
    out/golden.jsonl     the golden runs' results
    out/crashes.log      crashed trials' causes and stacks
    out/store/           the off-node store: checkpoints and snapshots (store/TRIAL/, ...)
    out/nodes/nodeN/     each machine node's scratch, wiped when the node is replaced
    out/world/           the spawned world's rendezvous and pid files
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CAMPAIGN_FILE = "campaign.json"
TRIALS_FILE = "trials.csv"
EVENTS_FILE = "events.jsonl"
# What campaign.json holds beside the campaign itself: where and by what code it ran, a figure
# measured from its config, and the golden store it read; none of them changes a row.
BESIDE_CAMPAIGN = ("environment", "code", "product_coverage", "golden_cache")


# How a run starts and is tidied, not what it computes: a resume may change them (a timeout
# raised after a world was slow to start). campaign.json keeps the first run's. A trial's own
# timeout is not among them: a trial past it is a crash row that names it.
LIVENESS = {"topology": ("startup_timeout_s",), "checkpoint": ("keep",)}


# What campaign.json derives from its other settings (the trials from the scenarios and seeds,
# the forward's trace from the workload): named last, and by name alone, in a refusal.
DERIVED = ("trials", "scenarios", "forward")


def campaign_identity(record: dict[str, Any]) -> str:
    """The campaign a config or a campaign.json record describes: its trials' rows follow from
    it, so two folders of one identity hold the same rows."""
    held = {k: v for k, v in record.items() if k not in BESIDE_CAMPAIGN}
    for section, keys in LIVENESS.items():
        if isinstance(held.get(section), dict):
            held[section] = {k: v for k, v in held[section].items() if k not in keys}
    return json.dumps(_canonical(held), sort_keys=True, indent=1)


# What picks which trials a campaign runs (its seeds: `campaign.seeds` counts them from
# `workload.seed`, and `trials` lists them), and what is documented to change no row but
# `start_step` (`campaign.fast_forward`, docs/configuration.md): two campaigns alike but for
# these run the same trial wherever they run one of a seed both hold, and write it the same row.
PICKS_TRIALS = {"": ("seeds", "trials", "fast_forward"), "workload": ("seed",)}


def rows_identity(record: dict[str, Any]) -> str:
    """What decides a trial's row in a campaign (a config or a campaign.json record): its
    identity (`campaign_identity`) less which seeds it runs and the settings that change no
    row. Two campaigns of one rows identity hold the same row for each trial they share."""
    held = json.loads(campaign_identity(record))
    for section, keys in PICKS_TRIALS.items():
        within = held.get(section) if section else held
        if isinstance(within, dict):
            for key in keys:
                within.pop(key, None)
    return json.dumps(held, sort_keys=True, indent=1)


def shared_seeds(first: dict[str, Any], second: dict[str, Any]) -> list[int]:
    """The seeds of the trials two campaigns (configs or campaign.json records) both run: the
    same scenario and checks on the same seed under settings that decide its row alike, so the
    same trial, counted twice where their tables are read together. Empty where they share
    none, or differ in a setting that decides a row."""
    if rows_identity(first) != rows_identity(second):
        return []
    ran = {_trial_key(t) for t in first.get("trials") or []}
    return sorted({t["seed"] for t in second.get("trials") or [] if _trial_key(t) in ran})


def _trial_key(trial: dict[str, Any]) -> str:
    return json.dumps(_canonical(trial), sort_keys=True)


def seeds_text(seeds: list[int]) -> str:
    """Seeds as their runs, named: [0, 1, 2, 5] as "seeds 0-2, 5", [3] as "seed 3"."""
    runs: list[list[int]] = []
    for seed in sorted(seeds):
        if runs and seed == runs[-1][-1] + 1:
            runs[-1].append(seed)
        else:
            runs.append([seed])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"seed{'s' if len(seeds) > 1 else ''} {text}"


def _canonical(value: Any) -> Any:
    """A whole float as the integer it equals: 30.0 given on the command line is the YAML's 30."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def identity_changes(before: str, after: str) -> list[str]:
    """The settings two identities differ in, by their dotted names ("workload.lr 0.003 ->
    0.5"), what derives from them (DERIVED) last and by name alone."""
    found: list[str] = []
    _changes("", json.loads(before), json.loads(after), found)
    return sorted(found, key=lambda change: change.split(".")[0].split(" ")[0] in DERIVED)


def _changes(name: str, was: Any, now: Any, found: list[str]) -> None:
    if was == now:
        return
    if isinstance(was, dict) and isinstance(now, dict) and name not in DERIVED:
        for key in sorted(set(was) | set(now)):
            _changes(f"{name}.{key}" if name else key, was.get(key), now.get(key), found)
    elif (
        name.split(".")[0] in DERIVED
        or isinstance(was, list | dict)
        or isinstance(now, list | dict)
    ):
        found.append(name)
    else:
        found.append(f"{name} {was} -> {now}")


@dataclass(frozen=True)
class RunFolder:
    root: Path

    @property
    def campaign(self) -> Path:
        return self.root / CAMPAIGN_FILE

    @property
    def trials(self) -> Path:
        return self.root / TRIALS_FILE

    @property
    def events(self) -> Path:
        return self.root / EVENTS_FILE

    @property
    def goldens(self) -> Path:
        return self.root / "golden.jsonl"

    @property
    def crash_log(self) -> Path:
        return self.root / "crashes.log"

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def world(self) -> Path:
        return self.root / "world"

    def trial_store(self, trial_id: str) -> Path:
        """Where one trial's checkpoints go."""
        return self.store / trial_id

    def node(self, node: int) -> Path:
        """A machine node's scratch folder."""
        return self.root / "nodes" / f"node{node}"

    @property
    def records(self) -> tuple[Path, ...]:
        """What a campaign writes once campaign.json binds the folder to it."""
        return (self.trials, self.events, self.goldens, self.store)

    def campaign_record(self) -> dict[str, Any] | None:
        """campaign.json as written (None when the folder has none, or it cannot be read)."""
        try:
            return json.loads(self.campaign.read_text())
        except (OSError, ValueError):
            return None

    def trial_checks(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Each trial's checks' settings as campaign.json records them (its scenario's, else
        the run's), by trial id; empty where the folder has no readable campaign.json."""
        record = self.campaign_record() or {}
        run_checks = record.get("detectors") or {}
        return {t["trial_id"]: t.get("checks") or run_checks for t in record.get("trials", [])}
