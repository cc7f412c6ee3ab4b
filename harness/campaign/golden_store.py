"""The golden store: each golden run computed once, then reused by every campaign folder and
sweep job that needs the same one (docs/design.md, section 6).

A golden run's numbers are a function of what its key covers and nothing else: the workload
with the golden's seed, the topology's numeric settings (world, backend, threads, kernels,
numerics, device), the environment's numeric fields (harness/results/machine.py), and the
code: every source file of the harness, the detectors and the injectors (the training step,
the reduction layout, the checks that observe it), plus a custom workload's own packages (their
sources, or their installed versions). The checks observe and never change those numbers, so
the result is keyed without them; what the golden run leaves in its store folder (fast-forward
snapshots with each rank's check state, recovery's checkpoints) does depend on the checks and
the checkpoint interval, and is keyed by those as well:

    ROOT/RUN_KEY/sSEED/golden.json         the result, the inputs its key covers, a checksum
    ROOT/RUN_KEY/sSEED/STATE_KEY/          the golden's store files (each with its .sha256)
    ROOT/RUN_KEY/sSEED/STATE_KEY/files.json  the snapshot steps and files held

Nothing is trusted on its key alone: an entry is used only when its recorded inputs equal this
campaign's and every file matches its checksum. A corrupt or mismatched entry is dropped, with
a line saying so, and the golden runs again. Files are written by rename and hard-linked into
campaign folders (copied across file systems), so a reader never sees half a file, and deleting
a campaign folder never touches the store.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import detectors
from harness.config.schema import RunConfig, TrialSpec, WorkloadConfig
from harness.results import machine
from harness.results.schema import Golden
from harness.runtime import checkpoint, snapshots

logger = logging.getLogger(__name__)

# The packages whose code makes a golden run's numbers; their sources are hashed.
OWN_PACKAGES = ("harness", "detectors", "injectors")
# The topology's settings that change what a run computes (not its timeouts or spare nodes).
NUMERIC_TOPOLOGY = (
    "nodes", "ranks_per_node", "backend", "threads_per_rank", "cpu_kernels", "cpu_numerics",
    "device", "deterministic", "parallel", "shard_size",
)  # fmt: skip
MANIFEST = "files.json"


class GoldenMismatch(RuntimeError):
    """A golden run gave another result than the store's entry for the same inputs."""


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _sources_digest(paths: list[Path], root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def package_version(name: str) -> str:
    """What identifies a top-level package's code: the digest of its Python and C sources (the
    checks' kernels) where they lie in a folder of their own (the project's packages, a user's
    local ones), else the installed distribution's name and version."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return "missing"
    if spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations)))
        if "site-packages" not in root.parts and "dist-packages" not in root.parts:
            return _sources_digest([*root.rglob("*.py"), *root.rglob("*.c")], root.parent)
    elif spec.origin and "site-packages" not in Path(spec.origin).parts:
        return _sources_digest([Path(spec.origin)], Path(spec.origin).parent)
    dists = importlib.metadata.packages_distributions().get(name, [])
    return ",".join(f"{d}=={importlib.metadata.version(d)}" for d in sorted(set(dists))) or "?"


def code_version(workload: WorkloadConfig) -> dict[str, str]:
    return {name: package_version(name) for name in (*OWN_PACKAGES, *workload.imports())}


def golden_inputs(run: RunConfig, environment: dict[str, str], seed: int) -> dict[str, Any]:
    """Everything the golden run of `seed` computes from, as recorded in its entry."""
    topology = dataclasses.asdict(run.topology)
    return {
        "workload": dataclasses.asdict(dataclasses.replace(run.workload, seed=seed)),
        "topology": {k: topology[k] for k in NUMERIC_TOPOLOGY},
        "environment": {k: environment.get(k) for k in machine.NUMERIC},
        "code": code_version(run.workload),
    }


def state_inputs(run: RunConfig) -> dict[str, Any]:
    """What else the golden's store files depend on: the checks it carries (their settings and
    code) and when it checkpoints."""
    checks = {
        name: {
            "config": dataclasses.asdict(config),
            "code": package_version(detectors.detector_class(name).__module__.split(".")[0]),
        }
        for name, config in run.detectors.items()
    }
    return {"checks": checks, "checkpoint_interval": run.checkpoint.interval}


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


@dataclass
class GoldenStore:
    """The store at `root` as one campaign sees it: its goldens' entries, found and filled."""

    root: Path
    run: RunConfig
    environment: dict[str, str]

    def __post_init__(self) -> None:
        self._state = state_inputs(self.run)
        self._state_key = _digest(self._state)[:16]

    def _entry(self, seed: int) -> tuple[Path, dict[str, Any]]:
        inputs = golden_inputs(self.run, self.environment, seed)
        return self.root / _digest(inputs)[:20] / f"s{seed}", inputs

    def _drop(self, path: Path, spec: TrialSpec, why: str) -> None:
        logger.warning("golden store: %s %s; %s runs again", path, why, spec.trial_id)
        shutil.rmtree(path, ignore_errors=True)

    def result(self, spec: TrialSpec) -> Golden | None:
        """The stored result of `spec`'s golden run, if an entry holds it for these inputs."""
        entry, inputs = self._entry(spec.seed)
        path = entry / "golden.json"
        if not path.exists():
            return None
        try:
            held = json.loads(path.read_text(encoding="utf-8"))
            content = {"golden": held["golden"], "inputs": held["inputs"]}
            intact = held["sha256"] == _digest(content)
        except (OSError, ValueError, KeyError, TypeError):
            intact = False
        if not intact:
            self._drop(entry, spec, "is corrupt (its checksum does not match)")
            return None
        if held["inputs"] != inputs:
            self._drop(entry, spec, "was computed from other inputs than its key says")
            return None
        return Golden(**held["golden"], reused_from=str(entry))

    def state(self, spec: TrialSpec) -> tuple[Path, list[str]] | None:
        """The folder holding the files `spec`'s golden run leaves in its store, and their
        names, verified, when it holds the snapshots this campaign's trials start from."""
        entry, _ = self._entry(spec.seed)
        folder = entry / self._state_key
        if not (folder / MANIFEST).exists():
            return None
        held = self._manifest(folder)
        files = held.get("files", []) if held else []
        if not held or not all(checkpoint.verify(folder / name) for name in files):
            self._drop(folder, spec, "holds a file that does not match its checksum")
            return None
        return (folder, files) if set(spec.snapshots) <= set(held.get("snapshots", [])) else None

    def reuse(self, spec: TrialSpec, store: Path) -> Golden | None:
        """The golden result of `spec` with its store files linked into `store` (the campaign's
        store folder for that golden), or None when the store cannot stand in for the run."""
        golden = self.result(spec)
        if golden is None or not spec.snapshots:  # a golden no trial starts from: its result
            return golden
        held = self.state(spec)
        if held is None:
            return None
        folder, files = held
        target = store / spec.trial_id
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            checkpoint.place(folder / name, target)
        return golden

    def put(self, spec: TrialSpec, golden: Golden, store: Path) -> None:
        """Keep a golden run's result and the files it left in `store` (the campaign's store
        folder for that golden). A result that differs from the entry's is refused: the run is
        not a function of its key."""
        entry, inputs = self._entry(spec.seed)
        known = self.result(spec)
        plain = {"seed": golden.seed, "final_loss": golden.final_loss,
                 "weights_digest": golden.weights_digest}  # fmt: skip
        if known is not None and known != golden:
            raise GoldenMismatch(
                f"golden run {spec.trial_id} gave {plain}, where the golden store holds "
                f"{known} for the same inputs ({entry}): the run is not deterministic, or its "
                "numbers depend on something its key does not cover; rerun with "
                "campaign.golden_cache=false"
            )
        folder = entry / self._state_key
        folder.mkdir(parents=True, exist_ok=True)
        if known is None:
            content = {"golden": plain, "inputs": inputs}
            _write(entry / "golden.json", json.dumps({**content, "sha256": _digest(content)}))
        source = store / spec.trial_id
        found = [*source.glob("*.pt"), *source.glob("*.dcp")]
        written = sorted(p.name for p in found if checkpoint.verify(p))
        # A snapshot the run could not write (a full disk) is not held: its trials then need
        # the golden run again.
        saved = [step for step in spec.snapshots if self._files(store, spec, step) <= set(written)]
        held = self._manifest(folder) or {}
        for name in written:
            checkpoint.place(source / name, folder)
        manifest = {
            "inputs": self._state,
            "snapshots": sorted(set(held.get("snapshots", [])) | set(saved)),
            "files": sorted(set(held.get("files", [])) | set(written)),
        }
        _write(folder / MANIFEST, json.dumps(manifest, sort_keys=True, indent=1))

    def _files(self, store: Path, spec: TrialSpec, step: int) -> set[str]:
        """The names of the files a snapshot of `spec`'s golden run after `step` consists of."""
        snapshot = snapshots.snapshot_path(store, spec.seed, step)
        ranks = range(self.run.topology.world_size)
        return {snapshot.name, *(snapshots.checks_path(snapshot, r).name for r in ranks)}

    def _manifest(self, folder: Path) -> dict[str, Any] | None:
        """`folder`'s files.json, when it reads and was written for this campaign's checks."""
        try:
            held = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return held if isinstance(held, dict) and held.get("inputs") == self._state else None
