"""The merged report of a sweep (`sdc-bench -m ...`): one report over every job folder's
trials.csv, written at the top of the sweep folder, plus sweep.md, which lists each job, what it
varied and how many trials it wrote, and the jobs a failed one kept from starting (the sweeper
launches them in order and stops at the first that fails).

The report itself is exactly what `sdc-report SWEEP_DIR` writes (same call), so either can
rebuild it; sweep.md is a separate file so that such a rebuild leaves it alone.
"""

from __future__ import annotations

import atexit
import logging
import re
import sys
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from harness.analysis import report, tables
from harness.results.folder import RunFolder

logger = logging.getLogger(__name__)
SWEEP_FILE = "sweep.md"


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Every job folder of the sweep: Hydra saves a job's .hydra/ before the job runs, so a job
    that failed has one too."""
    found = [p.parent for p in sweep_dir.rglob(".hydra") if p.is_dir()]
    return sorted(found, key=_natural)


def _natural(path: Path) -> list[object]:
    # Jobs are numbered: 10 comes after 9.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def planned_jobs(task: list[str]) -> list[list[str]] | None:
    """The overrides of each job a sweep of these command-line overrides launches, in order, as
    Hydra's basic sweeper splits them (its own split, from hydra._internal: the order is the
    job numbers'); None where they cannot be known here: a sweep that needs the config to
    expand (glob), or a shuffled one, whose order each split draws anew."""
    try:
        parsed = OverridesParser.create().parse_overrides(task)
        if any(o.is_sweep_override() and getattr(o.value(), "shuffle", False) for o in parsed):
            return None
        return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except HydraException:
        return None


def _varied(overrides: dict[str, list[str]]) -> dict[str, str]:
    """Each job's overrides, less those that every job shares."""
    shared = set.intersection(*(set(o) for o in overrides.values())) if overrides else set()
    return {job: " ".join(o for o in found if o not in shared) for job, found in overrides.items()}


def saved_overrides(job: Path) -> list[str]:
    saved = job / ".hydra" / "overrides.yaml"
    return list(OmegaConf.load(saved)) if saved.exists() else []


def write_merged_report(sweep_dir: Path, planned: list[list[str]] | None = None) -> Path | None:
    """report.md/html and figures/ over all jobs, and sweep.md; None when no job wrote trials.

    A job without trials.csv (it failed, or only wrote a torchrun plan) is listed as missing;
    given the sweep's `planned` jobs (planned_jobs), those past the ones that started are
    listed as not started. Raises tables.ReportError for a trials.csv that cannot be read.
    """
    jobs = job_dirs(sweep_dir)
    missing = [job for job in jobs if not RunFolder(job).trials.exists()]
    if not jobs or len(missing) == len(jobs):
        logger.warning("no job of %s wrote trials.csv; no merged report", sweep_dir)
        return None
    df = tables.load_trials([sweep_dir])
    path = report.write_report(df, sweep_dir, [sweep_dir])
    counts = df["run"].value_counts()
    unstarted = planned[len(jobs) :] if planned else []
    overrides = {str(job.relative_to(sweep_dir)): saved_overrides(job) for job in jobs}
    overrides |= {f"not started {i}": job for i, job in enumerate(unstarted)}
    varied = _varied(overrides)
    lines = [
        f"# Sweep {sweep_dir}\n",
        f"{len(df)} trials from {len(jobs) - len(missing)} of {len(jobs) + len(unstarted)} jobs; "
        "report.md merges them.\n",
        "| job | overrides | trials | status |",
        "|---|---|---|---|",
    ]
    for job in jobs:
        name = str(job.relative_to(sweep_dir))
        held = int(counts.get(str(job), 0))
        # An interrupted job (rerunning the sweep resumes it) holds fewer than it plans.
        planned = len((RunFolder(job).campaign_record() or {}).get("trials", []))
        status = "**no trials.csv**" if job in missing else "ok"
        if job not in missing and held < planned:
            status = f"**incomplete** ({held} of {planned} planned trials)"
        lines.append(f"| {name} | `{varied[name] or '-'}` | {held} | {status} |")
    for i in range(len(unstarted)):
        lines.append(f"| - | `{varied[f'not started {i}'] or '-'}` | 0 | **not started** |")
    (sweep_dir / SWEEP_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"merged report: {path} ({len(df)} trials from {len(jobs) - len(missing)} jobs)")
    if missing:
        names = ", ".join(str(job.relative_to(sweep_dir)) for job in missing)
        logger.warning("jobs without trials.csv: %s", names)
    if unstarted:
        logger.warning("jobs not started after the failed one: %d (sweep.md lists them)",
                       len(unstarted))  # fmt: skip
    return path


class MergedReport(Callback):
    """Registered under hydra.callbacks in experiments/config.yaml."""

    def __init__(self) -> None:
        self.sweep_dir: Path | None = None
        self.planned: list[list[str]] | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Resolved now, from the config the sweeper also uses: ${now:...} gives the same folder.
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
        self.planned = planned_jobs(list(config.hydra.overrides.task))
        # A job that exits (sdc-bench exits on a config error or a failed campaign) or fails
        # ends the whole multirun before on_multirun_end; the jobs that finished still get
        # their merged report.
        atexit.register(self.build)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self.build)
        if not self.build():
            sys.exit(1)

    def build(self) -> bool:
        """False when a trials.csv could not be read."""
        assert self.sweep_dir is not None, "on_multirun_start sets it"
        try:
            write_merged_report(self.sweep_dir, self.planned)
        except tables.ReportError as exc:
            logger.error("merged report failed: %s", exc)
            return False
        return True
