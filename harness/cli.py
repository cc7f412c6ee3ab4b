"""`sdc-bench`: the Hydra app. This process only orchestrates: it validates the composed config,
hands the ranks plain dataclasses, and writes the report at the end.

A config mistake exits 2 with one line naming the key and what is allowed, before any rank is
spawned and before anything in `out` is touched.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
from pathlib import Path
from typing import NoReturn

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

import detectors
import injectors
from harness.campaign.run import CampaignError, check_out, run_campaign
from harness.config.faults import FAULT_KEYS
from harness.config.load import run_config
from harness.config.schema import RunConfig
from harness.core import logs, registry
from harness.errors import ConfigError
from harness.launch import stacks  # noqa: F401 - first: the rank server's stack dump (harness/launch/stacks.py)
from harness.results.folder import campaign_identity, rows_identity, seeds_text, shared_seeds

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "experiments")
GROUPS = ("workload", "topology", "fault", "detectors", "campaign")
LAUNCHER = "hydra/launcher"  # how a sweep's jobs run (docs/campaigns.md)


def fail(message: str) -> None:
    print(f"sdc-bench: error: {message}", file=sys.stderr)
    sys.exit(2)


def store_installed_detectors() -> None:
    """A built-in check's defaults are experiments/detectors/NAME.yaml; an installed package's
    check (harness/core/registry.py) has its defaults in its own `Config`, stored here as the
    same group option, so that `detectors=[nan_inf,NAME]` composes like a built-in."""
    store = ConfigStore.instance()
    for name in registry.installed(registry.DETECTORS):
        if name not in detectors.built_in():
            # Its mode unset, as the built-ins' files leave it: observe, and act under recovery.
            defaults = {**detectors.detector_class(name).Config().params(), "mode": None}
            store.store(group="detectors", name=name, node={name: defaults})


def check_group_choices(argv: list[str]) -> None:
    """Hydra answers an unknown group option with a multi-line error and exit 1; answer it here
    with the contract's one line and exit 2."""
    for arg in argv:
        key, sep, _ = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in (*GROUPS, LAUNCHER):
            continue
        allowed = sorted(p.stem for p in Path(CONFIG_DIR, key).glob("*.yaml"))
        if key == "detectors":
            allowed = list(detectors.available())
        if key == LAUNCHER:  # Hydra's own and its plug-ins' (submitit's), beside ours
            with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
                allowed = GlobalHydra.instance().config_loader().get_group_options(LAUNCHER)
        for choice in _options(arg):
            if choice not in allowed:
                fail(f"{key}: '{choice}' is not allowed; allowed: {', '.join(allowed)}")
        if key == "detectors":
            for listed in _lists(arg):
                twice = next((c for i, c in enumerate(listed) if c in listed[:i]), None)
                if twice is not None:
                    # Composed, a check is one key: the second entry ran nothing of its own.
                    fail(f"detectors: '{twice}' is listed twice in [{','.join(listed)}]; "
                         "allowed: each check once")  # fmt: skip


def _values(arg: str) -> list:
    """What `arg` gives its key, as Hydra's grammar reads it: one value, or each of a sweep's
    (`detectors=[a,b],[c]`, `choice(...)`). Where Hydra cannot expand it here (glob needs the
    config), none: Hydra's own error or the composed config's check answers it."""
    try:
        override = OverridesParser.create().parse_overrides([arg])[0]
        if override.is_sweep_override():
            return list(override.sweep_iterator())
        return [override.value()]
    except HydraException:
        return []


def _lists(arg: str) -> list[list[str]]:
    """Each list `arg` gives a group (a sweep over lists gives several)."""
    return [[str(v) for v in value] for value in _values(arg) if isinstance(value, list)]


def _options(arg: str) -> list[str]:
    """Every option `arg` names: a list's, a sweep's over options or over lists."""
    flat = [v for value in _values(arg) for v in (value if isinstance(value, list) else [value])]
    return ["null" if v is None else str(v) for v in flat]


def preflight(argv: list[str]) -> None:
    """Compose and validate the config before Hydra creates or writes anything in `out`.

    A sweep validates every job it will launch, as Hydra's basic sweeper splits them, before
    the first starts (where its values need the config to expand, such as glob, or are
    shuffled, each job as it starts); and refuses one `out` for all of its jobs (each would
    write into it, the second refused as another campaign's).
    """
    if "-m" in argv or "--multirun" in argv:
        task = [a for a in argv if "=" in a and not a.startswith(("-", "hydra"))]
        try:
            parsed = OverridesParser.create().parse_overrides(task)
        except HydraException as exc:
            fail(str(exc).strip().splitlines()[0])
        outs = [o for o in parsed if o.key_or_group == "out"]
        several = any(o.is_sweep_override() for o in parsed if o.key_or_group != "out")
        if several and any(not _per_job(o) for o in outs):
            fail(
                "out: a sweep's jobs each write into their own folder under hydra.sweep.dir; "
                "leave out unset (or name one per job: out=DIR/${hydra:job.num})"
            )
        from harness.analysis.sweep import planned_jobs  # here: a rank needs no pandas

        jobs = planned_jobs(task) or []
        shared = set.intersection(*map(set, jobs)) if jobs else set()
        folder = _sweep_folder(argv)
        if folder is not None and jobs:
            _no_other_jobs(folder, len(jobs))
        # An out made from the job's own Hydra settings resolves only in the job.
        in_job = any("${hydra:" in o.input_line for o in outs)
        # Each job's campaign, and the job that first ran it: where the jobs write into the
        # sweep's folder, its merged report reads them together (a swept `out` is read by none:
        # its jobs' folders are each its own run's).
        # Jobs that run the same trials (one campaign, or seeds in common where only the seeds
        # or a setting that changes no row vary) are refused here, before any job runs.
        seen: list[tuple[dict, str]] = []
        writers: dict[Path, int] = {}  # each job's folder, and the first job writing into it
        for number, job in enumerate(jobs):
            where = f" (sweep job {number}: {_own(job, shared)})"
            cfg = _composed([o for o in job if not (in_job and o.startswith("out="))])
            run = validated(cfg, where)
            record = dataclasses.asdict(run)
            rows = rows_identity(record)
            for first, (earlier, its_rows) in enumerate(seen):
                if outs or its_rows != rows:
                    continue
                if campaign_identity(earlier) == campaign_identity(record):
                    fail(
                        f"sweep: jobs {first} ({' '.join(jobs[first])}) and {number} "
                        f"({' '.join(job)}) run the same campaign: the merged report would "
                        "count its rows twice; allowed: values that change the campaign"
                    )
                both = shared_seeds(earlier, record)
                if both:
                    fail(
                        f"sweep: jobs {first} ({' '.join(jobs[first])}) and {number} "
                        f"({' '.join(job)}) both run the trials of {seeds_text(both)} (the "
                        "same campaign but for its seeds or settings that change no row): the "
                        "merged report would count their rows twice; allowed: jobs that share "
                        "no seed (run the most seeds once), or values that change the campaign"
                    )
            seen.append((record, rows))
            if outs:
                out = None if in_job else Path(cfg.out)
            else:
                out = None if folder is None else folder / str(number)
            if out is not None:
                other = writers.setdefault(out.resolve(), number)
                if other != number:
                    # Swept beside another key, `out` repeats: the later job was refused as
                    # another campaign only once the first had run.
                    fail(
                        f"out: sweep jobs {other} ({_own(jobs[other], shared)}) and {number} "
                        f"({_own(job, shared)}) both write into {out}; allowed: one out per job"
                    )
                try:
                    check_out(out, run)
                except ConfigError as exc:
                    fail(f"{exc}{where}")
        return
    overrides = [a for a in argv if not a.startswith("-") and not a.startswith("hydra")]
    cfg = _composed(overrides)
    run = validated(cfg)
    try:
        check_out(Path(cfg.out), run)
    except ConfigError as exc:
        fail(str(exc))


def _own(job: list[str], shared: set[str]) -> str:
    """A sweep job's overrides that not every job shares."""
    return " ".join(o for o in job if o not in shared)


def _no_other_jobs(folder: Path, launched: int) -> None:
    """Refuse a sweep folder holding a job folder this sweep does not launch (an earlier sweep's
    of more jobs): the merged report, sweep.md and sdc-report count every job folder there."""
    from harness.analysis.sweep import job_dirs, saved_overrides

    ours = {folder / str(number) for number in range(launched)}
    other = next((job for job in job_dirs(folder) if job not in ours), None)
    if other is not None:
        jobs = f"{launched} job{'s' if launched > 1 else ''}"
        fail(
            f"hydra.sweep.dir: {folder} holds job {other.relative_to(folder)} "
            f"({' '.join(saved_overrides(other)) or 'no overrides'}), which this sweep of {jobs} "
            "does not launch: its reports would count that job's trials; choose a new "
            "hydra.sweep.dir"
        )


def _sweep_folder(argv: list[str]) -> Path | None:
    """The sweep's folder where the command line names it and its jobs' folders are their
    numbers (experiments/config.yaml); None where Hydra makes a new one (its default, dated)."""
    given = dict(a.split("=", 1) for a in argv if a.startswith("hydra.sweep."))
    if "hydra.sweep.dir" not in given or "hydra.sweep.subdir" in given:
        return None
    return Path(given["hydra.sweep.dir"])


def _composed(overrides: list[str]) -> DictConfig:
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except HydraException as exc:
        fail(_composition_error(str(exc), overrides))
        raise  # fail exits


def _per_job(out: Override) -> bool:
    """Whether an `out` override names a folder per job: swept, or through the job's number."""
    return out.is_sweep_override() or "hydra:job.num" in out.input_line


def _composition_error(message: str, overrides: list[str]) -> str:
    """Hydra's message for an unknown key, rewritten to name the keys that do exist."""
    first = message.strip().splitlines()[0]
    for override in overrides:  # Hydra's grammar error names neither the override nor its key
        try:
            OverridesParser.create().parse_overrides([override])
        except HydraException:
            key = override.split("=", 1)[0].lstrip("+~")
            return (
                f"{key}: cannot parse '{override}' ({first}); allowed: KEY=VALUE in Hydra's "
                "override grammar (a list: [a,b], a mapping: {k:v}, quoted where it holds = or ,)"
            )
    if not first.startswith("Could not override '"):
        return first
    key = first.split("'")[1]
    parent, _, _ = key.rpartition(".")
    groups = [o for o in overrides if o.split("=", 1)[0] in GROUPS]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        base = compose(config_name="config", overrides=groups)
    node = OmegaConf.select(base, parent) if parent else base
    if not isinstance(node, DictConfig):
        return _under_no_mapping(key, base)
    message = f"{key}: unknown key; allowed: {', '.join(str(k) for k in node)}"
    if parent == "fault":  # and the keys the fault models declare of their own
        own = [f"{m}: {', '.join(keys)}" for m, keys in model_keys().items() if keys]
        message += f"; a model's own ({'; '.join(own)})" if own else ""
    return message


def _under_no_mapping(key: str, base: DictConfig) -> str:
    """An unknown key whose parent holds no keys in this run: a check's key where the run does
    not choose that check (or no check has that name), else the nearest node above it that is a
    value (null: set it whole) or a mapping (its keys)."""
    parts = key.split(".")
    chosen = OmegaConf.select(base, "detectors", default=None) or {}
    if parts[0] == "detectors" and len(parts) > 2 and parts[1] not in chosen:
        name, run = parts[1], ", ".join(chosen) or "none"
        if name in detectors.available():
            return (
                f"{key}: unknown key; {name} is not among this run's detectors ({run}); "
                f"allowed: add {name} to detectors=[...]"
            )
        return (
            f"{key}: unknown key; {name} is no check; allowed: {', '.join(detectors.available())}"
        )
    for n in range(len(parts) - 1, 0, -1):
        above, child = ".".join(parts[:n]), parts[n]
        node = OmegaConf.select(base, above, default=_ABSENT)
        if node is None:
            return f"{key}: unknown key; {above} is null in this run; allowed: set {above} whole"
        if node is not _ABSENT and not isinstance(node, DictConfig):
            return f"{key}: unknown key; {above} is a value, not a group; allowed: {above}=VALUE"
        if isinstance(node, DictConfig):
            keys = ", ".join(str(k) for k in node)
            return f"{key}: unknown key; {above} has no {child}; allowed: {keys}"
    return f"{key}: unknown key"


# What OmegaConf.select returns for a key the config lacks (None is a null value's).
_ABSENT = object()


def resolve_out(cfg: DictConfig) -> Path:
    """A sweep job writes into its own job folder unless `out` was given explicitly."""
    hydra_cfg = HydraConfig.get()
    given = any(o.split("=", 1)[0] == "out" for o in hydra_cfg.overrides.task)
    if hydra_cfg.mode == RunMode.MULTIRUN and not given:
        return Path(hydra_cfg.runtime.output_dir)
    return Path(cfg.out)


class _Validated:
    """The command's validations: preflight's, which the run Hydra starts then reuses when it
    composes the same config (`out` aside: its timestamp may have moved on); a sweep's, one
    per job, each reused as its job starts in this process."""

    runs: list[tuple[dict, RunConfig]] = []


def validated(cfg: DictConfig, where: str = "") -> RunConfig:
    """The run `cfg` describes; a config error exits 2 with its line (and `where`)."""
    if cfg.get("out") == "":  # `out=$OUT`, OUT unset
        fail(
            "out: empty, which would write the campaign's files into the working folder; "
            f"allowed: a folder's path (out=. for the working folder){where}"
        )
    config = {k: v for k, v in plain(cfg).items() if k != "out"}
    for seen, run in _Validated.runs:
        if seen == config:
            return run
    try:
        run = run_config(plain(cfg))
    except ConfigError as exc:
        fail(f"{exc}{where}")
    _Validated.runs.append((config, run))
    return run


def plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def app(cfg: DictConfig) -> None:
    # Imported here: every rank of a spawned world re-imports this module (spawn reruns the
    # main module's imports), and a rank needs neither pandas nor matplotlib.
    from harness import torchrun_worker
    from harness.analysis import report, tables

    run = validated(cfg)
    out = resolve_out(cfg)
    if run.launcher == "torchrun":
        print(f"plan: {torchrun_worker.write_plan(plain(cfg), out)}")
        print(f"run it on every node with:\n  {torchrun_worker.command(run, out)}")
        return
    try:
        trials = run_campaign(run, out)
        df = tables.load_trials([trials.parent])
        path = report.write_report(df, out)
    except ConfigError as exc:
        fail(str(exc))
    except CampaignError as exc:
        print(f"sdc-bench: campaign failed: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as exc:
        # A sweep's job resumes with its sweep: rerun alone, its folder is no sweep's job.
        again = "the sweep's command" if HydraConfig.get().mode == RunMode.MULTIRUN else None
        interrupted(exc, f"rerun {again or f'with out={out}'} to resume")
    print(report.summary(df))
    print(f"trials: {trials}\nreport: {path}")


class Terminated(KeyboardInterrupt):
    """SIGTERM, what a scheduler sends to stop a job: it ends a campaign as Ctrl-C does."""


def _terminate(_signum: int, _frame: object) -> None:
    raise Terminated


def interrupted(exc: KeyboardInterrupt, then: str) -> NoReturn:
    """One line, and the shell's code for the signal: 130 for Ctrl-C, 143 for SIGTERM."""
    print(f"sdc-bench: interrupted; {then}", file=sys.stderr)
    sys.exit(143 if isinstance(exc, Terminated) else 130)


def model_keys() -> dict[str, list[str]]:
    """Each fault model's own keys (its `Config`), by model."""
    return {m: injectors.model_class(m).Config.names() for m in injectors.available_models()}


def model_keys_added(argv: list[str]) -> list[str]:
    """A fault model's own keys (its `Config`, injectors/model.py) are not in
    experiments/fault/none.yaml, which holds the keys every fault has: `fault.KEY=V` for one of
    them becomes Hydra's add-or-override `++fault.KEY=V`, and the model checks it."""
    own = {k for keys in model_keys().values() for k in keys}
    added = []
    for arg in argv:
        key, sep, _ = arg.partition("=")
        name = key.removeprefix("fault.")
        if sep and key.startswith("fault.") and name in own and name not in FAULT_KEYS:
            arg = f"++{arg}"
        added.append(arg)
    return added


def implied_campaign(argv: list[str]) -> list[str]:
    """Overriding the fault without naming a campaign means: run that fault (campaign=single)."""
    keys = [a.lstrip("+~").split("=", 1)[0] for a in argv if "=" in a]
    if any(k == "fault" or k.startswith("fault.") for k in keys) and "campaign" not in keys:
        return [*argv, "campaign=single"]
    return argv


def main() -> None:
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        logs.configure("sdc-bench")
        argv = model_keys_added(implied_campaign(sys.argv[1:]))
        sys.argv[1:] = argv
        store_installed_detectors()
        check_group_choices(argv)
        preflight(argv)
        app()
    except KeyboardInterrupt as exc:  # before a campaign began: nothing to resume yet
        interrupted(exc, "nothing was run")
    finally:  # in-process callers (tests, notebooks) keep their own
        signal.signal(signal.SIGTERM, previous)
