"""The plan (harness/analysis/plan.py) as text and figure: `sdc-plan`'s output, plan.md, plan.png,
and the section that the report of a run with overhead.csv and several audit intervals includes.

Where the checks' costs come from, first choice first: `--costs FILE`, what the guard measured
in the job itself (`guard.write_costs`, harness/results/costs.py); `--gpu --params
--tokens-per-step`, estimated for that job from each check's docstring formula
(harness/analysis/estimates.py); else the run's overhead.csv, measured on the campaign's own
workload. The header says which. A run whose campaign weighs its faults is planned under its mix
(harness/analysis/mix.py) unless `--equal-weights`.

Bad input (a missing folder, no trials.csv, no overhead.csv without `--costs` or `--gpu`, a
costs file or formula table that lacks a check the run's trials ran, an estimate's flag without
the others, a negative rate) exits 2 with one line, before anything is written.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from harness.analysis.estimates import GPUS, MFU, REPLICAS, EstimateError, JobShape
from harness.analysis.mix import weighed

# harness.analysis.plan imports harness.analysis.report, whose figures module picks the Agg backend
# on its first import (a batch job has no display) and leaves a notebook's backend alone after that.
from harness.analysis.plan import (
    CONSENSUS,
    FIGURE_FILE,
    LLAMA3_SOURCE,
    NAMED_SETS,
    PLAN_FILE,
    Job,
    Loss,
    Option,
    Overheads,
    Plan,
    PlanError,
    estimated_overheads,
    job_overheads,
    load,
    plan,
)
from harness.analysis.tables import (
    MERGED,
    ReportError,
    check_out,
    default_out,
    markdown_table,
    rate_text,
    runs_line,
    unfinished,
)
from harness.results.costs import JobCosts
from harness.results.trial_row import Column

MODEL = (
    "Expected GPU-hours lost per day of the job, for each set of checks at each audit interval "
    "the run measured (harness/analysis/plan.py):\n\n"
    "    loss = overhead x 24 h x GPUs\n"
    "         + events/day x P(caught) x GPUs x (steps trained again x step time + restart)\n"
    "         + events/day x P(damaged, not caught) x GPUs x escape cost\n\n"
    "events/day = SDC rate x GPUs x 24 h; a fired trial of the run stands for one event (under "
    "a weighed fault mix, for its class's share of one); a `crash` fault (a process taken "
    "down, not a silent corruption) is no SDC event and is left out. "
    "P(caught) and P(damaged, not caught) are shares of the run's fired faults, each fault "
    "once per set and interval (damaged: harmful or latent, or replicas that no longer agree). "
    "Steps trained again: from the checkpoint recovery restores, the newest before both the "
    "fault and the first step the alarming checks put in doubt (harness/analysis/rollbacks.py: "
    "two steps before a check of each step's values, a periodic check's last look), to the "
    "alarm, averaged over where the alarm falls between checkpoints; a check that vouches for "
    "no earlier step (matmul_checksum on a share of the steps or products) rolls back to the "
    "start, half the job. The overhead "
    "of a set is the sum of its members' (each timed alone; checks that share a collective "
    "could cost less together); a check timed at several intervals k costs c/k, c fitted to "
    "all of its timings; never less than zero or the check's floor. Range: each share at its "
    "95% Wilson bounds, the steps trained again at the least and most of a caught fault, and "
    "each overhead "
    "(the hook's too) at its lowest and highest timed round where overhead.csv holds one run's "
    "rounds. False alarms are "
    "not in the model. The shares are those of the run's fault mix: a fault the run did not "
    "inject is not planned for."
)
FLAGS = {
    "gpus": ("--gpus", "GPUs in the job", "the Llama 3 405B run"),
    "step_seconds": ("--step-seconds", "seconds per training step", "about a Llama 3 405B step"),
    "checkpoint_every": ("--checkpoint-every", "steps between checkpoints", "assumed"),
    "restart_minutes": ("--restart-minutes", "minutes to restart after an alert", "assumed"),
    "sdc_rate": ("--sdc-rate", "SDC events per GPU-hour", LLAMA3_SOURCE),
    "job_days": (
        "--job-days",
        "days the job runs: a rollback to its start loses its age, half of this",
        "the Llama 3 405B snapshot's 54 days",
    ),
    "escape_hours": (
        "--escape-hours",
        "wall hours a damaging fault that no check caught costs the job",
        "assumed: a day, until a loss spike or a bad eval shows it",
    ),
}
TOP = 12  # rows in the printed table and the report's section; plan.md has them all


def header(job: Job, costs: Overheads, derived: tuple[str, ...] = ()) -> str:
    """The model and the job's figures, each with its source (`derived`: the fields of Job taken
    from the cost estimate); the hook's cost and the overhead fits."""
    default = Job()
    lines = ["Job figures (flag: value):", ""]
    for f in fields(Job):
        flag, what, source = FLAGS[f.name]
        value = getattr(job, f.name)
        note = f"default, {source}" if value == getattr(default, f.name) else "given"
        if f.name in derived and costs.job is not None:
            note = f"measured in the job ({costs.source})"
        elif f.name in derived:
            note = "estimated: 6 N T FLOPs at the estimate's efficiency on --gpus GPUs"
        lines.append(f"- `{flag} {value:g}`: {what} ({note})")
    lines.append(f"- so {job.events_per_day:.3g} SDC events a day")
    if costs.estimate is not None:
        shape = costs.estimate
        each = ", ".join(f"{name} {pct:.3g}%" for name, pct in sorted(costs.per_run.items()))
        lines.append(
            f"- overheads **estimated**, not measured: from each check's bytes and FLOPs "
            f"(its docstring; harness/analysis/estimates.py) on {shape.describe()}; at an "
            f"interval of 1: {each}; the harness's hook as nothing"
            + (
                "; titan_replay as if it checked every step (num_steps -1), an upper bound for "
                "its default of the first step only"
                if "titan_replay" in costs.per_run
                else ""
            )
        )
    elif costs.job is not None:
        measured = costs.job
        lines.append(
            f"- overheads measured in the job itself ({costs.source}, by the guard: "
            f"{measured.steps} steps of {measured.step_time_s:.4g} s on {measured.device}, "
            f"{measured.parallel}, {measured.world_size} ranks), in place of the run's "
            "overhead.csv: each check's figure at the interval it ran at there, c/k at interval "
            f"k; the guard's hook costs {costs.hook:.3g}% of the job's step, once for any set "
            "of checks"
        )
    elif costs.hook is None:
        lines.append(
            "- overheads against the harness's hook: this overhead.csv has no cost of the hook "
            "against plain DDP (measured before it was)"
        )
    else:
        lines.append(
            f"- overheads against plain DDP: the harness's hook costs {costs.hook:.3g}% of a "
            "step, once for any set of checks, plus each check's cost against the hook times "
            f"{1 + costs.hook / 100:.4g} (the hook's step against plain DDP's)"
        )
    if costs.job is None and costs.estimate is None:
        lines.append(
            f"- overheads as the campaign measured them on its own workload ({costs.source}): "
            "they hold for a job like it; for another, give `--gpu --params "
            "--tokens-per-step` (estimated) or `--costs FILE` (measured in the job)"
        )
    fits = [f"{name} {c:.3g}%/k" for name, c in sorted(costs.per_run.items())]
    if costs.job is not None or costs.estimate is not None:
        fits = []  # listed in the line above, one run's cost each
    if fits:
        lines.append(f"- overhead fits (k: the interval): {', '.join(fits)}")
    return MODEL + "\n\n" + "\n".join(lines)


def _gpu_hours(x: float) -> str:
    return f"{x:,.0f}"


def _overhead(option: Option) -> str:
    """The set's overhead, and its lowest and highest rounds' where they were timed."""
    low, high = option.overhead_range
    text = f"{option.overhead_pct:.2f}%"
    return text if low == high == option.overhead_pct else f"{text} [{low:.2f}%, {high:.2f}%]"


def _range(found: Loss) -> str:
    return f"[{_gpu_hours(found.low)}, {_gpu_hours(found.high)}]"


def rows(result: Plan, limit: int | None = None) -> list[dict[str, object]]:
    """The table, best first."""
    return [
        {
            "rank": i + 1,
            "checks": option.name,
            "interval": option.interval,
            "overhead": _overhead(option),
            "caught": rate_text(*option.caught),
            "damaged, not caught": rate_text(*option.escaped),
            "ttd steps": "-" if math.isnan(option.ttd[0]) else f"{option.ttd[0]:.3g}",
            "GPU-h/day": _gpu_hours(found.expected),
            "range": _range(found),
        }
        for i, (option, found) in enumerate(result.ranked[:limit])
    ]


def _find(result: Plan, checks: tuple[str, ...]) -> tuple[Option, Loss] | None:
    return next(((o, f) for o, f in result.ranked if o.checks == checks), None)


def recommendation(result: Plan) -> str:
    option, found = result.best
    every = "" if option.interval == "-" else f", interval {option.interval}"
    text = (
        f"Recommended: **{option.name}{every}**: {_gpu_hours(found.expected)} GPU-hours lost "
        f"per day, range {_range(found)}."
    )
    nothing = _find(result, ())
    if nothing is not None and nothing[0] is not option:
        text += f" No checks: {_gpu_hours(nothing[1].expected)} {_range(nothing[1])}."
    close = [o for o, f in result.ranked[1:] if f.expected <= found.high]
    if close:
        some = "1 other option expects" if len(close) == 1 else f"{len(close)} other options expect"
        text += (
            f" {some} a loss within the recommendation's range (the run cannot tell them "
            "apart; more seeds narrow it)."
        )
    if found.expected > 24 * result.job.gpus:
        text += (
            " At these figures every option loses more GPU-hours a day than the job has: the "
            "job would not progress (the model is linear in the rate, with no cap)."
        )
    noise = result.overheads.noise
    if noise:
        text += (
            f"\n\nTiming noise: {len(noise)} overhead measurements are below zero or below "
            f"their floor ({'; '.join(noise)}): the overheads are uncertain by about that much. "
            "Time the checks on a quiet machine (more `campaign.overhead` steps and rounds), or "
            "on your own workload."
        )
    # sdc-bench refuses a periodic check that would never look in its run.
    longest = _longest(option)
    run = f" (in sdc-bench, with workload.steps of at least {longest})" if longest else ""
    every = result.job.checkpoint_every
    if option.checkpoint_every(every) != every:  # consensus's interval does not divide it
        text += (
            f" Consensus looks before every checkpoint: it checkpoints every "
            f"{option.checkpoint_every(every)} steps, the least multiple of its interval at or "
            f"above --checkpoint-every {every}, and its rollbacks are priced so."
        )
    text += f"\n\nSet it with{run}:\n\n    {option.overrides(every)}"
    guarded = option.guard_detectors()
    if not guarded:
        return text + (
            "\n\nIn a job: attach no guard (attached with no check, its hook still costs part of "
            "every step, the hook's own figure above; this option prices none)."
        )
    checkpoints = (
        f", checkpointing every {option.checkpoint_every(every)} steps"
        if CONSENSUS in dict(option.intervals) else ""
    )  # fmt: skip
    return text + (
        f"\n\nIn a guarded job (Guard, SDCGuard, SDCGuardCallback: `detectors=`; the examples' "
        f"--detectors){checkpoints}:\n\n    {guarded}"
    )


def _drawn(result: Plan) -> list[tuple[str, ...]]:
    """The sets drawn: each check alone, the named sets, no checks, and the recommended."""
    sets = {
        o.checks
        for o, _ in result.ranked
        if len(o.checks) <= 1 or frozenset(o.checks) in NAMED_SETS
    }
    return sorted(sets | {result.best[0].checks}, key=lambda s: (len(s), s))


def _longest(option: Option) -> int | None:
    """Where an option sits on the figure's axis: its members' longest interval (None: every
    step)."""
    return max((k for _, k in option.intervals), default=None)


def draw(ax: plt.Axes, result: Plan) -> None:
    """Expected loss (and its range) against the audit interval, one line per set of checks
    through its best option at each interval (a set whose members run at several intervals is
    placed at the longest); a set without an interval (every step) is a flat dashed line."""
    ranked = result.ranked
    steps = sorted({k for o, _ in ranked for _, k in o.intervals}) or [1]
    for checks in _drawn(result):
        mine = [(o, f) for o, f in ranked if o.checks == checks]
        label = " + ".join(checks) or "no checks"
        if mine and _longest(mine[0][0]) is None:
            found = mine[0][1]
            (line,) = ax.plot(steps, [found.expected] * len(steps), "--", label=label)
            ax.fill_between(steps, found.low, found.high, color=line.get_color(), alpha=0.08)
            continue
        best: dict[int, Loss] = {}
        for o, f in mine:  # ranked: the first at an interval is its best
            best.setdefault(_longest(o), f)
        x = sorted(best)
        (line,) = ax.plot(x, [best[k].expected for k in x], "o-", label=label)
        lows, highs = [best[k].low for k in x], [best[k].high for k in x]
        ax.fill_between(x, lows, highs, color=line.get_color(), alpha=0.12)
    option, found = result.best
    at = _longest(option) or steps[0]
    ax.plot([at], [found.expected], "*", color="black", markersize=14, label="recommended")
    ax.set(xscale="log", yscale="log", xlabel="audit interval (steps; of several, the longest)")
    ax.set_ylabel("expected GPU-hours lost per day")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))


def figure(result: Plan, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(10, 4.5))
    draw(ax, result)
    job = result.job
    ax.set_title(f"{job.gpus:,} GPUs, {job.sdc_rate:.3g} SDC events per GPU-hour", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def untimed_line(result: Plan) -> str:
    """The checks the trials ran that no option holds, for want of a figure for their cost."""
    if not result.untimed:
        return ""
    return (
        f" Left out of every option, for want of a measured cost: {', '.join(result.untimed)} "
        "(ran in the trials; time it with campaign.overhead, or plan with --costs)."
    )


def mix_line(result: Plan) -> str:
    """How the run's faults count: each once, or by the campaign's fault mix."""
    if result.weighed:
        missing = (
            f" Classes with no fired trial, {result.uncovered:.1%} of the mix's weight, count "
            "for nothing."
            if result.uncovered
            else ""
        )
        return (
            "Faults weighed by the campaign's fault mix (harness/analysis/mix.py): each fired "
            "trial stands for its class's weight over the class's fired trials; shares at the "
            "Kish effective number of trials. `--equal-weights` counts each once." + missing
        )
    return "Each fired fault counts once."


def markdown(
    result: Plan, image: str, limit: int | None = None, derived: tuple[str, ...] = ()
) -> str:
    return "\n\n".join(
        [
            header(result.job, result.overheads, derived),
            mix_line(result) + untimed_line(result),
            recommendation(result),
            markdown_table(rows(result, limit)),
            f"![Expected loss against the audit interval]({image})",
        ]
    )


def report_section(trials: pd.DataFrame, table: pd.DataFrame, folder: Path) -> str:
    """The report's section, at the default job figures; what stops a plan, without one."""
    title = "## How often to audit\n\n"
    try:
        result = plan(trials, table, Job())
    except PlanError as exc:
        return title + f"Not planned: {exc}."
    path = figure(result, folder / FIGURE_FILE)
    text = markdown(result, f"figures/{path.name}", TOP)
    return (
        f"{title}At the default job figures (`sdc-plan RUN_DIR --gpus N ...` "
        f"plans for another job); the table holds the {TOP} best options.\n\n" + text
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage block
        raise PlanError(message)


@dataclass(frozen=True)
class Arguments:
    dirs: list[Path]
    out: Path | None
    costs: Path | None  # the job's measured costs, first choice
    shape: JobShape | None  # the job's shape to estimate costs for, second choice
    job: Job
    derived: tuple[str, ...]  # Job fields taken from the estimate or the job's costs
    equal_weights: bool  # the campaign's fault mix ignored
    step_given: float | None  # --step-seconds, where given


ESTIMATE_FLAGS = ("--gpu", "--params", "--tokens-per-step")


def _shape(args: argparse.Namespace) -> JobShape | None:
    """The job an estimate is for (--gpu, --params, --tokens-per-step together; --replicas and
    --mfu only with them), or None without an estimate."""
    estimate = [args.gpu, args.params, args.tokens_per_step]
    if all(v is None for v in estimate):
        for flag, value in (("--replicas", args.replicas), ("--mfu", args.mfu)):
            if value is not None:
                raise PlanError(f"{flag}: only an estimate reads it; give it with "
                                f"{', '.join(ESTIMATE_FLAGS)}")  # fmt: skip
        return None
    if any(v is None for v in estimate):
        missing = ESTIMATE_FLAGS[estimate.index(None)]
        raise PlanError(f"{missing}: an estimate needs {', '.join(ESTIMATE_FLAGS)} together")
    if args.costs is not None:
        raise PlanError("--gpu: the job's measured costs (--costs) take precedence over an "
                        "estimate; give one or the other")  # fmt: skip
    replicas = REPLICAS if args.replicas is None else args.replicas
    mfu = MFU if args.mfu is None else args.mfu
    try:
        return JobShape(args.gpu, args.params, args.tokens_per_step, replicas, mfu)
    except EstimateError as exc:
        raise PlanError(str(exc)) from None


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def parse(argv: list[str] | None) -> Arguments:
    default = Job()
    parser = _Parser(prog="sdc-plan", description=MODEL.split(":")[0] + ".")
    parser.add_argument("dirs", nargs="+", type=Path, help="run or sweep folders")
    where = (
        "where plan.md and plan.png go (default: the folder named, or for several folders "
        f"{MERGED}/ inside the first, beside a merged report of the same runs; a folder's own "
        "plan is never replaced by a merged one)"
    )
    parser.add_argument("--out", type=Path, help=where)
    parser.add_argument(
        "--costs",
        type=Path,
        help="the job's own costs (guard.write_costs) in place of the run's overhead.csv",
    )
    parser.add_argument("--gpu", help=f"estimate costs on this GPU: {', '.join(GPUS)}")
    parser.add_argument("--params", type=_number, help="the model's parameters (with --gpu)")
    parser.add_argument("--tokens-per-step", type=_number, help="tokens per step (with --gpu)")
    replicas = f"data-parallel replicas (default {REPLICAS}, with --gpu)"
    parser.add_argument("--replicas", type=_whole, help=replicas)
    mfu = f"the step's share of the GPU's peak (default {MFU:g}, with --gpu)"
    parser.add_argument("--mfu", type=_number, help=mfu)
    for f in fields(Job):
        flag, what, _ = FLAGS[f.name]
        kind = _whole if f.type in ("int", int) else _number
        value = getattr(default, f.name)
        parser.add_argument(flag, type=kind, help=f"{what} (default {value:g})")
    once = "count every fired fault once, whatever the campaign's fault mix"
    parser.add_argument("--equal-weights", action="store_true", help=once)
    args = parser.parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in fields(Job)}
    job = Job(**{k: getattr(default, k) if v is None else v for k, v in given.items()})
    shape = _shape(args)
    derived: tuple[str, ...] = ()
    if shape is not None:
        if job.gpus < shape.replicas:
            raise PlanError(f"--replicas: {shape.replicas} replicas need as many --gpus, "
                            f"got {job.gpus}")  # fmt: skip
        if given["step_seconds"] is None:
            step = shape.step_seconds / (job.gpus / shape.replicas)
            job, derived = replace(job, step_seconds=step), ("step_seconds",)
    return Arguments(
        args.dirs, args.out, args.costs, shape, job, derived, args.equal_weights,
        given["step_seconds"],
    )  # fmt: skip


def _read_costs(path: Path) -> JobCosts:
    try:
        return JobCosts.read(path)
    except ValueError as exc:
        raise PlanError(f"--costs {exc}") from None


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse(argv)
        trials, table = load(args.dirs, need_overhead=args.costs is None and args.shape is None)
        stopped = unfinished(trials)
        if stopped:  # its rates are a part of the campaign's, as sdc-regress refuses them
            raise PlanError(
                f"incomplete: {'; '.join(stopped)}; finish it (rerun its command with the same "
                "out) before planning"
            )
        out = args.out or default_out(args.dirs, trials)
        try:
            check_out("--out", out, args.dirs)
        except ReportError as exc:
            raise PlanError(str(exc)) from None
        if args.equal_weights:
            if not weighed(trials):
                raise PlanError(
                    "--equal-weights: the runs weigh no fault by a mix; every trial already "
                    "counts once (leave it out)"
                )
            trials = trials.assign(**{Column.weight: math.nan})
        costs = None
        if args.costs is not None:
            measured = _read_costs(args.costs)
            costs = job_overheads(measured, str(args.costs), trials)
            if args.step_given is None:  # the step the guard timed, not a default job's
                args = replace(
                    args, job=replace(args.job, step_seconds=measured.step_time_s),
                    derived=(*args.derived, "step_seconds"),
                )  # fmt: skip
        elif args.shape is not None:
            costs = estimated_overheads(args.shape, trials)
        result = plan(trials, table, args.job, costs)
    except PlanError as exc:
        print(f"sdc-plan: {exc}", file=sys.stderr)
        sys.exit(2)
    out.mkdir(parents=True, exist_ok=True)
    path = figure(result, out / FIGURE_FILE)
    written = out / PLAN_FILE
    text = markdown(result, path.name, derived=args.derived)
    written.write_text(f"# How often to audit\n\n{runs_line(trials)}\n\n{text}\n")
    print(header(args.job, result.overheads, args.derived) + "\n")
    print(mix_line(result) + untimed_line(result) + "\n")
    print(markdown_table(rows(result, TOP)))
    print(recommendation(result) + "\n")
    print(f"plan: {written}\nfigure: {path}")
