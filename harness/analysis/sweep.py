"""The merged report of a sweep (`sdc-bench -m ...`): one report over every job folder's
trials.csv, written at the top of the sweep folder, plus sweep.md, which lists each job, what it
varied and how many trials it wrote.

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


def _varied(jobs: list[Path]) -> dict[Path, str]:
    """Each job's overrides, less those that every job shares."""
    overrides = {}
    for job in jobs:
        saved = job / ".hydra" / "overrides.yaml"
        overrides[job] = list(OmegaConf.load(saved)) if saved.exists() else []
    shared = set.intersection(*(set(o) for o in overrides.values())) if overrides else set()
    return {job: " ".join(o for o in found if o not in shared) for job, found in overrides.items()}


def write_merged_report(sweep_dir: Path) -> Path | None:
    """report.md/html and figures/ over all jobs, and sweep.md; None when no job wrote trials.

    A job without trials.csv (it failed, or only wrote a torchrun plan) is listed as missing.
    Raises tables.ReportError for a trials.csv that cannot be read.
    """
    jobs = job_dirs(sweep_dir)
    missing = [job for job in jobs if not RunFolder(job).trials.exists()]
    if not jobs or len(missing) == len(jobs):
        logger.warning("no job of %s wrote trials.csv; no merged report", sweep_dir)
        return None
    df = tables.load_trials([sweep_dir])
    path = report.write_report(df, sweep_dir, [sweep_dir])
    counts = df["run"].value_counts()
    lines = [
        f"# Sweep {sweep_dir}\n",
        f"{len(df)} trials from {len(jobs) - len(missing)} of {len(jobs)} jobs; report.md merges "
        "them.\n",
        "| job | overrides | trials | status |",
        "|---|---|---|---|",
    ]
    for job, varied in _varied(jobs).items():
        status = "**no trials.csv**" if job in missing else "ok"
        lines.append(
            f"| {job.relative_to(sweep_dir)} | `{varied or '-'}` | "
            f"{int(counts.get(str(job), 0))} | {status} |"
        )
    (sweep_dir / SWEEP_FILE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"merged report: {path} ({len(df)} trials from {len(jobs) - len(missing)} jobs)")
    if missing:
        names = ", ".join(str(job.relative_to(sweep_dir)) for job in missing)
        logger.warning("jobs without trials.csv: %s", names)
    return path


class MergedReport(Callback):
    """Registered under hydra.callbacks in experiments/config.yaml."""

    def __init__(self) -> None:
        self.sweep_dir: Path | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Resolved now, from the config the sweeper also uses: ${now:...} gives the same folder.
        self.sweep_dir = Path(str(config.hydra.sweep.dir))
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
            write_merged_report(self.sweep_dir)
        except tables.ReportError as exc:
            logger.error("merged report failed: %s", exc)
            return False
        return True
