"""`sdc-regress` on real runs: the same small campaign with its one
detector on (the baseline) and switched off (a planted regression)."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.analysis import plan_report, regress, report, tables
from harness.analysis.regress import load, regressions
from harness.campaign import overhead
from harness.results import machine, schema
from harness.results.trial_row import COLUMNS, read_trials, write_trials
from harness.runtime import environment
from tests.conftest import BIN, run_here
from tests.rows import frame

# Clean trials and a NaN in rank 3's local gradient, 4 seeds each: the fewest for which a catch
# rate of 4/4 and one of 0/4 have disjoint Wilson intervals (and 0/4 is a blind spot).
CAMPAIGN = [
    "campaign.scenarios=[{site:none},{site:grad,model:value,value:nan,ranks:[3],steps:[2]}]",
    "workload.steps=4",
    "campaign.seeds=4",
    "campaign.noise_seeds=2",
]
OVERHEAD = (
    "detector,interval,overhead_pct,floor_pct\nreplay,5,{replay},18.0\nnan_inf,,{nan_inf},0.0\n"
)


def installed_sdc_regress(*args: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "sdc-regress"), *map(str, args)], capture_output=True, text=True, timeout=60
    )


def sdc_regress(*args: Path) -> subprocess.CompletedProcess:
    """The command's entry point in-process, as the installed command would answer (no
    interpreter start per call); test_identical_runs_do_not_regress runs the installed one."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            regress.main([str(a) for a in args])
        except SystemExit as exc:
            code = exc.code
    return subprocess.CompletedProcess(["sdc-regress", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Both campaigns, in this process: sdc-regress, not the command that made its input, is
    under test."""
    root = tmp_path_factory.mktemp("regress")
    checks = {"baseline": "[nan_inf]", "switched_off": "[]"}
    for name, detectors in checks.items():
        run_here(*CAMPAIGN, f"detectors={detectors}", f"out={root / name}", cwd=root)
    return {name: root / name for name in checks}


def copy(run: Path, to: Path) -> Path:
    to.mkdir()
    shutil.copy(run / "trials.csv", to / "trials.csv")
    return to


def written_without(run: Path, to: Path, *columns: str) -> Path:
    """`run`'s trials as a harness before `columns` existed wrote them, into `to`."""
    to.mkdir(exist_ok=True)
    _, kept = read_trials(run / "trials.csv")
    write_trials(to / "trials.csv", kept, [c for c in COLUMNS if c not in columns])
    return to


def edit_rows(folder: Path, change) -> None:
    with open(folder / "trials.csv", newline="") as f:
        table = list(csv.DictReader(f))
    change(table)
    with open(folder / "trials.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)


def regression_rows(stdout: str) -> list[list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ")][1:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_identical_runs_do_not_regress(runs):
    proc = installed_sdc_regress(runs["baseline"], runs["baseline"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no regression (8 baseline trials, 8 current trials)" in proc.stdout
    assert (
        "sdc-regress: same environment (same commit): rows compare bit for bit; 8/8 shared "
        "trials kept their effect and golden loss"
    ) in proc.stdout


@pytest.mark.parametrize("recorded", ["code", "commit only"])
def test_runs_by_other_code_are_not_called_the_same_commit(runs, tmp_path, recorded):
    """A run from a tree with changes records its commit with `+dirty`, which the comparison
    cut off: two runs by different code read "same commit". Their sources' digests say whether
    the code differs; without them, a dirty commit says it may."""
    held = json.loads((runs["baseline"] / "campaign.json").read_text())
    if recorded != "code":
        held.pop("code")
    env = {**held["environment"], "commit": held["environment"]["commit"].split("+")[0] + "+dirty"}
    folders = []
    for name, code in (("a", "0" * 16), ("b", "1" * 16)):
        folder = copy(runs["baseline"], tmp_path / name)
        content = {**held, "environment": env}
        if recorded == "code":
            content["code"] = {**held["code"], "detectors": code}
        (folder / "campaign.json").write_text(json.dumps(content))
        folders.append(folder)
    line = next(x for x in sdc_regress(*folders).stdout.splitlines() if "same environment" in x)
    label = machine.commit_label(env)
    assert "same commit" not in line, line
    if recorded == "code":
        assert f"({label} -> {label}, other code: detectors changed)" in line, line
    else:
        assert f"(commit {label} in both, each with uncommitted changes)" in line, line


def test_runs_record_their_environment_and_the_report_shows_it_in_one_line(runs):
    env = json.loads((runs["baseline"] / "campaign.json").read_text())["environment"]
    assert (env["cpu_kernels"], env["torch"], env["device"]) == ("avx2", torch.__version__, "cpu")
    if environment.on_x86():
        assert env["cpu_capability"] == "AVX2"
        assert "ATEN_CPU_CAPABILITY=avx2" in env["math_settings"]
    report = (runs["baseline"] / "report.md").read_text().splitlines()
    lines = [line for line in report if line.startswith("Environment: ")]
    assert lines == [f"Environment: {machine.summary(env)}  "]


def test_another_environment_is_named_and_compared_statistically_only(runs, tmp_path):
    other = copy(runs["baseline"], tmp_path / "other")
    held = json.loads((runs["baseline"] / "campaign.json").read_text())
    machine, kernels = held["environment"]["machine"], held["environment"]["cpu_capability"]
    held["environment"].update(machine="riscv64", cpu_capability="RVV")
    (other / "campaign.json").write_text(json.dumps(held))
    proc = sdc_regress(runs["baseline"], other)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    changed = f"machine {machine} -> riscv64; cpu_capability {kernels} -> RVV"
    assert f"sdc-regress: environments differ: {changed}" in lines
    assert any(
        line.startswith("sdc-regress: statistical comparisons only: catch rates") for line in lines
    )
    unknown = sdc_regress(copy(runs["baseline"], tmp_path / "bare"), runs["baseline"])
    assert "sdc-regress: environment unknown for the baseline run" in unknown.stdout
    assert "no regression" in unknown.stdout


def test_committed_baseline_reads_and_does_not_regress_against_itself():
    baseline = load(Path(__file__).resolve().parent.parent / "results" / "baseline")
    assert regressions(baseline, baseline) == []


def test_a_detector_switched_off_is_a_regression_with_its_table(runs):
    proc = sdc_regress(runs["baseline"], runs["switched_off"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = regression_rows(proc.stdout)
    kinds = {(kind, where) for kind, where, _, _ in found}
    for trials in ("all fired", "non-masked", "harmful"):
        assert ("catch rate fell", f"nan_inf, {trials} trials") in kinds
        assert ("catch rate fell", f"any detector, {trials} trials") in kinds
    # The cell: site, model, workload, dtype, precision, persistence, value, step, bit class.
    cell = "grad / value / mlp / float32 / 32-true / transient / value nan / step 2"
    assert ("catch rate fell", f"{cell}, catch rate (harmful or latent)") in kinds
    assert ("new blind spot", f"{cell}, harmful or latent trials") in kinds
    switched_off = next(row for row in found if row[1] == "nan_inf, harmful trials")
    assert switched_off[2].startswith("4/4 = 100%")
    assert switched_off[3] == "0/4 = 0% [0%, 49%] (not run)"
    assert f"{len(found)} regressions" in proc.stderr
    # Switching the detector back on is not a regression.
    assert sdc_regress(runs["switched_off"], runs["baseline"]).returncode == 0


def test_a_new_false_positive_and_an_overhead_a_quarter_above_baseline_regress(runs, tmp_path):
    baseline = copy(runs["baseline"], tmp_path / "a")
    current = copy(runs["baseline"], tmp_path / "b")

    def alert_on_first_clean_trial(table):
        clean = next(r for r in table if r["site"] == "none")
        clean.update(alerts="1", alert_detectors="nan_inf")

    edit_rows(current, alert_on_first_clean_trial)
    (baseline / "overhead.csv").write_text(OVERHEAD.format(replay=24.0, nan_inf=24.0))
    # replay +26% (6.2 points), nan_inf +24%: only replay is past the limit.
    (current / "overhead.csv").write_text(OVERHEAD.format(replay=30.24, nan_inf=29.76))
    proc = sdc_regress(baseline, current)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert regression_rows(proc.stdout) == [
        ["new false positive", "nan_inf", "0/4 = 0% [0%, 49%]", "1/4 = 25% [5%, 70%]"],
        ["overhead grew", "replay, interval 5", "24.00%", "30.24%"],
    ]


def test_overhead_as_campaigns_write_it_30_percent_above_baseline_regresses(runs, tmp_path):
    """overhead.csv as harness/campaign/overhead.py writes it: a blank interval and a blank floor
    for a check without them, and one file per job of a sweep (the medians over jobs count)."""
    measured = [
        {"detector": "nan_inf", "interval": "", "overhead_pct": 20.0, "floor_pct": ""},
        {"detector": "replay", "interval": 5, "overhead_pct": 30.0, "floor_pct": 8.0},
    ]
    baseline = copy(runs["baseline"], tmp_path / "a")
    current = copy(runs["baseline"], tmp_path / "b")
    overhead.write(baseline / schema.OVERHEAD_FILE, measured)
    for job, scale in (("0", 1.3), ("1", 1.3)):
        (current / job).mkdir()
        grown = [dict(row, overhead_pct=scale * row["overhead_pct"]) for row in measured]
        overhead.write(current / job / schema.OVERHEAD_FILE, grown)
    proc = sdc_regress(baseline, current)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert regression_rows(proc.stdout) == [
        ["overhead grew", "nan_inf, interval -", "20.00%", "26.00%"],
        ["overhead grew", "replay, interval 5", "30.00%", "39.00%"],
    ]
    assert sdc_regress(current, baseline).returncode == 0  # an overhead that fell is no regression


def test_bad_input_exits_2_with_one_line_before_comparing(runs, tmp_path):
    no_trials = tmp_path / "empty"
    no_trials.mkdir()
    no_columns = copy(runs["baseline"], tmp_path / "cut")
    edit_rows(no_columns, lambda table: [row.pop("detected") for row in table])
    bad_overhead = copy(runs["baseline"], tmp_path / "overhead")
    (bad_overhead / "overhead.csv").write_text("detector,overhead_pct\nreplay,3.0\n")
    # Both folders are read before anything is compared: a bad one fails in either place.
    calls = [
        ((tmp_path / "missing", runs["baseline"]), "missing: not a folder"),
        ((runs["baseline"], no_trials), "no trials.csv"),
        ((runs["baseline"], no_columns), "missing columns: detected"),
        ((runs["baseline"], bad_overhead), "overhead.csv: missing columns: interval, floor_pct"),
    ]
    for args, message in calls:
        proc = sdc_regress(*args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert proc.stdout == ""
        assert len(proc.stderr.splitlines()) == 1 and message in proc.stderr


def test_an_overhead_growth_within_measurement_noise_is_no_regression(runs, tmp_path):
    """Twice a 4% overhead is 4 percentage points more: two timings differ by that much."""
    measured = [{"detector": "replay", "interval": 5, "overhead_pct": 4.0, "floor_pct": 0.5}]
    baseline = copy(runs["baseline"], tmp_path / "a")
    current = copy(runs["baseline"], tmp_path / "b")
    overhead.write(baseline / schema.OVERHEAD_FILE, measured)
    overhead.write(current / schema.OVERHEAD_FILE, [dict(measured[0], overhead_pct=8.0)])
    proc = sdc_regress(baseline, current)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# Two timings of the nightly's overheads at once, of the same code, on a 2-core machine: 5 rounds
# each, (median, lowest, highest round) in percent.
TIMED_TWICE = (
    {"grad_stats": (0.639, -7.555, 36.008), "matmul_checksum": (19.3, 13.744, 40.683)},
    {"grad_stats": (9.414, -6.711, 20.41), "matmul_checksum": (24.314, 19.149, 35.986)},
)


def _timed(spread: dict[str, tuple[float, float, float]]) -> list[dict[str, object]]:
    return [
        {"detector": name, "interval": "", "overhead_pct": pct, "floor_pct": "",
         "overhead_low_pct": low, "overhead_high_pct": high}
        for name, (pct, low, high) in spread.items()
    ]  # fmt: skip


def test_a_growth_within_the_rounds_spread_is_named_not_judged_a_regression(runs, tmp_path):
    """The same code timed twice: grad_stats' median rose 8.8 points and matmul_checksum's 5.0,
    each past 25% and 5 points, while their rounds overlap the other timing's. A growth with
    every round above every baseline round is one."""
    baseline = copy(runs["baseline"], tmp_path / "a")
    again = copy(runs["baseline"], tmp_path / "b")
    for folder, spread in zip((baseline, again), TIMED_TWICE, strict=True):
        overhead.write(folder / schema.OVERHEAD_FILE, _timed(spread))
    proc = sdc_regress(baseline, again)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "sdc-regress: 2 overheads grew past the thresholds within the noise of their rounds "
        "(some current round at or below some baseline round), not judged a regression: "
        "grad_stats, interval -: 0.64% -> 9.41% (rounds -6.71% to 20.41% against -7.55% to "
        "36.01%); matmul_checksum, interval -: 19.30% -> 24.31% (rounds 19.15% to 35.99% "
        "against 13.74% to 40.68%)"
    ) in proc.stdout.splitlines()
    grown = copy(runs["baseline"], tmp_path / "c")
    steady = TIMED_TWICE[0]["matmul_checksum"]
    overhead.write(
        grown / schema.OVERHEAD_FILE,
        _timed({"grad_stats": (45.0, 36.5, 60.0), "matmul_checksum": steady}),
    )
    proc = sdc_regress(baseline, grown)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert regression_rows(proc.stdout) == [
        ["overhead grew", "grad_stats, interval -", "0.64%", "45.00%"]
    ]
    assert "within the noise" not in proc.stdout


def test_the_hooks_own_cost_regresses_against_plain_ddp(runs, tmp_path):
    """The harness's hook is a cost every job pays: its row holds it against plain DDP (its
    overhead against itself is blank), and that grows like any check's."""
    tables = {}
    for name, (pct, low, high) in (("a", (1.0, 0.0, 2.0)), ("b", (30.0, 28.0, 33.0))):
        folder = copy(runs["baseline"], tmp_path / name)
        hook = {
            "detector": "hook",
            "interval": "",
            "overhead_pct": "",
            "floor_pct": "",
            "overhead_vs_ddp_pct": pct,
            "overhead_low_pct": low,
            "overhead_high_pct": high,
        }
        overhead.write(folder / schema.OVERHEAD_FILE, [hook])
        tables[name] = folder
    proc = sdc_regress(tables["a"], tables["b"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert regression_rows(proc.stdout) == [
        ["overhead grew", "hook, interval -", "1.00%", "30.00%"]
    ]


def test_a_sweeps_growth_in_one_job_is_judged_on_the_medians_not_hidden_by_another_job(
    runs, tmp_path
):
    """Rounds pooled over a sweep's jobs would spread from one job's 2% to another's 35% and
    call any growth noise: over several jobs the medians are judged on the sizes alone."""
    sweeps = {}
    for name, first in (("a", (2.0, 1.0, 3.0)), ("b", (22.0, 20.0, 25.0))):
        (tmp_path / name).mkdir()
        for job, spread in (("0", first), ("1", (35.0, 30.0, 40.0))):
            folder = copy(runs["baseline"], tmp_path / name / job)
            overhead.write(folder / schema.OVERHEAD_FILE, _timed({"grad_stats": spread}))
        sweeps[name] = tmp_path / name
    proc = sdc_regress(sweeps["a"], sweeps["b"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert regression_rows(proc.stdout) == [
        ["overhead grew", "grad_stats, interval -", "18.50%", "28.50%"]
    ]


def test_a_sweeps_jobs_compare_trial_by_trial_within_their_job(runs, tmp_path):
    """A sweep's jobs repeat the same trial ids: a trial compares with the one of its own job
    (a sweep over the checks: with nan_inf, and with none)."""
    sweeps = {}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for job, run in (("0", runs["baseline"]), ("1", runs["switched_off"])):
            copy(run, tmp_path / name / job)
            shutil.copy(run / "campaign.json", tmp_path / name / job)
        sweeps[name] = tmp_path / name

    def harm_first_trial(table):
        table[0]["effect"] = "benign" if table[0]["effect"] == "harmful" else "harmful"

    edit_rows(sweeps["b"] / "1", harm_first_trial)
    proc = sdc_regress(sweeps["a"], sweeps["b"])
    assert (
        "sdc-regress: same environment (same commit): rows compare bit for bit; 15/16 shared "
        "trials kept their effect and golden loss"
    ) in proc.stdout.splitlines()


def test_a_table_written_before_a_cells_column_compares_without_it_on_both_sides(runs, tmp_path):
    """A baseline written before `fault_settings` and `precision`: left in the keys, no cell
    would match, and a blind spot the baseline knew would read as a new one. Left out of both
    sides, the cells compare, and sdc-regress says why."""
    older = written_without(runs["baseline"], tmp_path / "older", "precision", "fault_settings")
    current = copy(runs["baseline"], tmp_path / "current")
    edit_rows(current, lambda table: [r.update(fault_settings="tensor=fc1.weight")
                                      for r in table if r["site"] != "none"])  # fmt: skip
    proc = sdc_regress(older, current)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "sdc-regress: a table was written before the columns fault_settings, precision: both "
        "runs' cells compare without them (the scenarios they tell apart merge, as that table "
        "merged them)"
    ) in proc.stdout.splitlines()
    assert "not compared" not in proc.stdout
    # Left in the keys, the baseline's one fault cell had no match and read as uncompared.
    assert regress.uncompared_cells(load(older).trials, load(current).trials)


def test_an_older_tables_overheads_compare_with_one_precision_and_not_with_a_sweep(runs, tmp_path):
    """Blank in both runs, one precision's overheads compare as the older table's did; a
    sweep's 32-true and bf16-mixed overheads pooled would compare a median of two steps'
    shares, which is neither's: they are listed as not compared, once each."""
    older = written_without(runs["baseline"], tmp_path / "older", "precision")
    overhead.write(older / schema.OVERHEAD_FILE, _timed({"matmul_checksum": (20.0, 18.0, 22.0)}))
    one = copy(runs["baseline"], tmp_path / "one")
    overhead.write(one / schema.OVERHEAD_FILE, _timed({"matmul_checksum": (60.0, 55.0, 70.0)}))
    proc = sdc_regress(older, one)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert regression_rows(proc.stdout) == [
        ["overhead grew", "matmul_checksum, interval -", "20.00%", "60.00%"]
    ]
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for job, precision, spread in (("0", "32-true", (20.0, 18.0, 22.0)),
                                   ("1", "bf16-mixed", (60.0, 55.0, 70.0))):  # fmt: skip
        folder = copy(runs["baseline"], sweep / job)
        edit_rows(folder, lambda table, p=precision: [r.update(precision=p) for r in table])
        overhead.write(folder / schema.OVERHEAD_FILE, _timed({"matmul_checksum": spread}))
    proc = sdc_regress(older, sweep)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "sdc-regress: 1 baseline overheads have none in the current run and were not compared: "
        "matmul_checksum, interval -, mlp in float32 (precision not recorded)"
    ) in proc.stdout.splitlines()
    # A job written without the column beside one with 32-true is one precision, not two:
    # pooled, their median (40%) compares, where kept apart the 60% went unmentioned.
    partly = tmp_path / "partly"
    shutil.copytree(sweep, partly)
    written_without(runs["baseline"], partly / "0", "precision")
    edit_rows(partly / "1", lambda table: [r.update(precision="32-true") for r in table])
    proc = sdc_regress(older, partly)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert regression_rows(proc.stdout) == [
        ["overhead grew", "matmul_checksum, interval -", "20.00%", "40.00%"]
    ]


def test_runs_that_share_no_scenario_cell_exit_2_with_one_line(runs, tmp_path, capsys):
    """Another campaign's faults: none of the baseline's cells has a match, so no catch rate
    could compare, and 'no regression' would say what was never checked."""
    other = copy(runs["baseline"], tmp_path / "other")
    edit_rows(other, lambda table: [r.update(site="loss") for r in table if r["site"] != "none"])
    with pytest.raises(SystemExit) as stop:
        regress.main([str(runs["baseline"]), str(other)])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "shares no scenario cell" in captured.err


def test_a_blind_spot_by_more_seeds_alone_is_no_new_one():
    """0/3 harmful trials caught is no blind spot (its upper bound 56%), 0/5 is (43%): more
    seeds of the same code, nothing fell. A cell whose catch rate fell into a blind spot is
    one; so is a blind cell new to the run, or one that did no damage in the baseline."""
    cell = dict(site="grad", model="scale", factor="1000", bit_class="-", fired="True",
                effect="harmful")  # fmt: skip

    def run(caught: int, n: int, **extra: object) -> pd.DataFrame:
        trials = [dict(cell, **extra, trial_id=f"t{i}", detected=str(i < caught)) for i in range(n)]
        return frame(*trials)

    assert regress.new_blind_spots(run(0, 3), run(0, 5)) == []
    (fell,) = regress.new_blind_spots(run(4, 4), run(0, 5))
    assert (fell["regression"], fell["baseline"][:3]) == ("new blind spot", "4/4")
    (new,) = regress.new_blind_spots(run(0, 3), run(0, 5, factor="10"))
    assert new["baseline"] == "not in baseline"
    # A cell whose trials did no damage in the baseline (no catch rate to fall) that now
    # lets 5 harmful trials through: "no regression" passed it.
    (damaging,) = regress.new_blind_spots(run(0, 5, effect="benign"), run(0, 5))
    assert (damaging["regression"], damaging["baseline"]) == ("new blind spot", "n=0")


def test_runs_of_other_workloads_do_not_compare_trial_by_trial(tmp_path):
    """Two campaigns whose trial ids coincide but whose workloads differ (nightly's 20 steps, the
    default's 30), in one environment: '0/25 shared trials kept their effect and golden loss'
    read as if the code had changed every row."""
    env = {"commit": "a" * 40}
    runs = []
    for name, steps in (("base", 20), ("cur", 30)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "campaign.json").write_text(json.dumps({"workload": {"steps": steps}}))
        trials = frame(dict(trial_id="t0")).assign(**{regress.JOB: "."})
        runs.append(regress.Run(trials, None, env, folder))
    assert regress.environment_lines(*runs) == [
        "same environment, other workloads (workload.steps 20 -> 30): a trial id of one run is "
        "not the other's trial, and their rows do not compare trial by trial"
    ]


def trials(cell: dict, n: int, caught: dict[str, int], **extra: object) -> list[dict]:
    """`n` fired, harmful trials of one cell, with nan_inf and replay on, the first
    `caught[d]` of them caught by detector d."""
    rows = []
    for i in range(n):
        by = [d for d, k in caught.items() if i < k]
        rows.append(dict(cell, trial_id=f"{cell['model']}{i}", seed=str(i), fired="True",
                         effect="harmful", detectors="nan_inf;replay", detected=str(bool(by)),
                         detected_by=";".join(by), **extra))  # fmt: skip
    return rows


STUCK = dict(site="grad", model="stuck", bit_class="-")
SCALE = dict(site="grad", model="scale", factor="1000", bit_class="-")
NAN = dict(site="grad", model="value", value="nan", bit_class="-")


def test_a_detector_that_loses_a_cell_another_still_catches_regresses():
    """replay goes from 10/10 to 0/10 on stuck gradients that nan_inf still catches: the cell's
    any-detector rate holds, and replay's own over all cells (35/60 before, 25/60 now) within
    its noise, so only the detector's rate in the cell shows it."""
    base = frame(*trials(STUCK, 10, {"replay": 10, "nan_inf": 10}),
                 *trials(SCALE, 50, {"replay": 25}))  # fmt: skip
    cur = frame(*trials(STUCK, 10, {"nan_inf": 10}), *trials(SCALE, 50, {"replay": 25}))
    assert regress.detector_drops(base, cur) == [] and regress.cell_drops(base, cur) == []
    cell = "grad / stuck / mlp / float32"
    assert regress.detector_cell_drops(base, cur) == [
        regress._finding("catch rate fell", f"replay, {cell}, {trials} trials",
                         "10/10 = 100% [72%, 100%]", "0/10 = 0% [0%, 28%]")
        for trials in ("all fired", "harmful or latent")
    ]  # fmt: skip
    # A detector the current run does not run at all falls in every table above, once.
    off = frame(*(dict(r, detectors="nan_inf", detected_by="nan_inf" * (r["detected"] == "True"))
                  for r in trials(STUCK, 10, {"nan_inf": 10})))  # fmt: skip
    assert regress.detector_cell_drops(frame(*trials(STUCK, 10, {"replay": 10})), off) == []


def test_dropping_a_scenario_is_no_fall_of_the_cells_both_runs_share():
    """nan_inf catches 10/10 NaN gradients and 0/10 scaled ones: the current run drops the NaN
    cell and keeps the other row for row. Pooled over each run's own cells, nan_inf's rate
    went from 10/20 to 0/10 and read as a fall; over the cells both share, it is 0/10 both."""
    base = frame(*trials(NAN, 10, {"nan_inf": 10}), *trials(SCALE, 10, {}))
    cur = frame(*trials(SCALE, 10, {}))
    assert regress.detector_drops(base, cur) == []
    assert regress.uncompared_cells(base, cur) == ["grad / value / mlp / float32 / value nan"]


def test_a_false_positive_rate_that_rose_regresses():
    """1 clean trial of 60 with an alert, then 30 of 60: only a detector with none before was
    judged."""

    def clean(alerting: int) -> pd.DataFrame:
        return frame(*(dict(trial_id=f"c{i}", site="none", detectors="replay",
                            alert_detectors="replay" if i < alerting else "",
                            alerts=str(int(i < alerting))) for i in range(60)))  # fmt: skip

    assert regress.false_positive_rises(clean(1), clean(30)) == [
        regress._finding("false positive rate rose", "replay", "1/60 = 2% [0.3%, 9%]",
                         "30/60 = 50% [38%, 62%]"),
    ]  # fmt: skip
    assert regress.false_positive_rises(clean(1), clean(3)) == []  # within the noise


def test_false_alerts_per_clean_trial_that_rose_regress_where_the_share_held():
    """3 clean trials of 60 alert in both runs, once each, then 20 times each: the share of
    clean trials with an alert held (3/60), and sdc-regress saw nothing, while docs/design.md
    section 5's rate (alerts in clean trials over clean trials) went from 0.05 to 1."""

    def clean(each: int, counted: bool = True) -> pd.DataFrame:
        return frame(*(dict(trial_id=f"c{i}", site="none", detectors="replay",
                            alert_detectors="replay" if i < 3 else "",
                            alerts=str(each if i < 3 else 0),
                            alert_counts=f"replay={each}" if i < 3 and counted else "")
                       for i in range(60)))  # fmt: skip

    assert regress.false_positive_rises(clean(1), clean(20)) == [
        regress._finding("false alerts per clean trial rose", "replay", "3/60 = 0.05 [0.017, 0.15]",
                         "60/60 = 1 [0.78, 1.3]"),
    ]  # fmt: skip
    assert regress.false_positive_rises(clean(1), clean(2)) == []  # within the noise
    # A table written before alert_counts cannot lay its clean trials' alerts on a check.
    assert regress.false_positive_rises(clean(1, counted=False), clean(20)) == []


def test_an_interrupted_run_is_refused_and_its_report_says_so(runs, tmp_path, capsys):
    """A nightly stopped after its first trials compared as 'no regression' (the cells it had
    not reached were listed as not compared), and its report read as a whole campaign's."""
    stopped = tmp_path / "stopped"
    shutil.copytree(runs["baseline"], stopped)
    lines = (stopped / "trials.csv").read_text().splitlines(keepends=True)
    (stopped / "trials.csv").write_text("".join(lines[:3]))
    proc = sdc_regress(runs["baseline"], stopped)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1
    assert f"the current run is incomplete ({stopped}: 2 of 8 planned trials)" in proc.stderr
    assert sdc_regress(stopped, runs["baseline"]).returncode == 2
    with pytest.raises(SystemExit) as refused:  # sdc-plan alike
        plan_report.main([str(stopped), "--gpu", "h100", "--params", "1e9",
                          "--tokens-per-step", "1e6"])  # fmt: skip
    assert refused.value.code == 2
    assert f"sdc-plan: incomplete: {stopped}: 2 of 8 planned trials" in capsys.readouterr().err
    report = regress_report(stopped, tmp_path / "report")
    assert f"**Incomplete**: {stopped}: 2 of 8 planned trials" in report
    assert "**Incomplete**" not in regress_report(runs["baseline"], tmp_path / "whole")


def regress_report(run: Path, out: Path) -> str:
    return report.write_report(tables.load_trials([run]), out).read_text()


def test_a_drop_the_cells_own_rate_shows_is_named_once_per_table():
    """replay alone caught the cell, 10/10, and now 0/10: the cell's rate and replay's pooled
    rate name it; the per-detector cell table named it a third time."""
    base = frame(*trials(STUCK, 10, {"replay": 10}))
    cur = frame(*trials(STUCK, 10, {}))
    assert regress.cell_drops(base, cur) and regress.detector_drops(base, cur)
    assert regress.detector_cell_drops(base, cur) == []
