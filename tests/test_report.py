"""The report built from result tables alone (no world is spawned): the escape impact and the
overhead sections, and a page whose every image is a PNG next to it."""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import warnings
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.container import BarContainer

from harness.analysis import figures, intervals, overheads, plan_report, regress, report, tables
from harness.campaign import overhead
from harness.results import schema
from tests.rows import frame

BASELINE = Path(__file__).resolve().parent.parent / "results" / "baseline"
# Two jobs of an audit_frequency sweep, one replay interval each; both timed nan_inf as well.
JOBS = {
    "0": [("replay", 1, 30.0, 25.0), ("nan_inf", "", 1.0, "")],
    "1": [("replay", 5, 7.0, 5.0), ("nan_inf", "", 3.0, "")],
}


def escaped_trials(folder: Path) -> Path:
    """Real nightly rows (every fifth), with three harmful faults made to escape every detector:
    two with a finite loss damage, one whose final loss is not a number (a blank loss_delta)."""
    with open(BASELINE / "trials.csv", newline="") as f:
        table = list(csv.DictReader(f))[::5]
    harmful = [r for r in table if r["effect"] == "harmful"]
    sized = [r for r in harmful if r["loss_delta"]][:2]
    escaped = [*sized, next(r for r in harmful if not r["loss_delta"])]
    assert len(escaped) == 3
    for row in escaped:
        row.update(detected="False", detected_by="", first_detector="", alert_detectors="")
    folder.mkdir(parents=True)
    with open(folder / "trials.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    return folder


def sweep(root: Path) -> Path:
    escaped_trials(root / "0")
    (root / "1").mkdir()
    for job, measured in JOBS.items():
        rows = [dict(zip(schema.OVERHEAD_REQUIRED, values, strict=True)) for values in measured]
        overhead.write(root / job / schema.OVERHEAD_FILE, rows)
    return root


def images_render_from_disk(out: Path) -> list[str]:
    page = (out / "report.html").read_text()
    images = re.findall(r'<img src="([^"]+)"', page)
    for src in images:
        assert not src.startswith(("/", "file:")), src  # relative: the folder opens anywhere
        assert (out / src).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", src
    return images


def kept_open(monkeypatch) -> list:
    """The figures the report's figure functions draw, kept open instead of written."""
    drawn = []
    monkeypatch.setattr(figures, "_save", lambda fig, path: drawn.append(fig) or path)
    return drawn


def test_catch_rate_figure_counts_each_detector_over_the_trials_it_ran_in(monkeypatch, tmp_path):
    """A merged sweep: replay ran in half the trials and caught each, as the table says (4/4);
    it ran in no harmful trial, so it has no harmful bar rather than a 0% one."""
    missed = {"fired": True, "effect": "harmful", "detectors": "nan_inf"}
    caught = {"fired": True, "effect": "benign", "detectors": "nan_inf;replay", "detected": True,
              "detected_by": "replay", "first_detector": "replay"}  # fmt: skip
    df = frame(*[missed] * 4, *[caught] * 4)
    assert tables.catch_counts(df)["all fired"]["replay"] == (4, 4)
    drawn = kept_open(monkeypatch)
    detectors = tables.detector_names(df)
    figures.catch_rate_by_detector(df, detectors, tables.wilson, tmp_path / "rates.png")
    ax = drawn[0].axes[0]
    heights = {
        bars.get_label(): {detectors[round(b.get_x() + b.get_width() / 2)]: b.get_height()
                           for b in bars}
        for bars in ax.containers if isinstance(bars, BarContainer)
    }  # fmt: skip
    assert heights == {
        "among all fired": {"nan_inf": 0.0, "replay": 1.0},
        "among harmful": {"nan_inf": 0.0},
    }
    assert [t.get_text() for t in ax.texts] == ["n=0"]


def test_catch_rate_figure_of_clean_trials_keeps_every_detectors_place(monkeypatch, tmp_path):
    """No fired trial: no bar at all, each detector's place still on the axis (an empty axis
    made matplotlib's layout give up with a warning)."""
    df = frame(*[{"site": "none", "detectors": "nan_inf;replay"}] * 3)
    drawn = kept_open(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figures.catch_rate_by_detector(df, ["nan_inf", "replay"], tables.wilson, tmp_path / "r.png")
    ax = drawn[0].axes[0]
    assert ax.get_xlim() == (-0.6, 1.6) and [t.get_text() for t in ax.texts] == ["n=0"] * 4


def test_bit_heatmaps_place_each_bit_in_the_dtype_it_indexes(monkeypatch, tmp_path):
    """bf16-mixed: bit 14 of a Linear's bfloat16 output (the exponent's top bit, caught) and bit
    14 of a LayerNorm's float32 output (a mantissa bit, missed) are two maps, not one cell."""
    flip = {"fired": True, "site": "activation", "model": "bitflip", "bit": 14}
    caught = {"detected": True, "detectors": "nan_inf", "detected_by": "nan_inf",
              "first_detector": "nan_inf", "ttd_steps": 0}  # fmt: skip
    df = frame(dict(flip, bit_dtype="bfloat16", **caught), dict(flip, detectors="nan_inf"))
    drawn = kept_open(monkeypatch)
    report_maps = report._figures(df, tmp_path)
    maps = {ax.get_xlabel(): ax.images[0].get_array().tolist() for f in drawn for ax in f.axes
            if ax.images}  # fmt: skip
    assert maps == {"bit (bfloat16, LSB = 0)": [[1.0]], "bit (float32, LSB = 0)": [[0.0]]}
    assert "heatmap_bfloat16.png" in report_maps and "heatmap_float32.png" in report_maps


def test_the_effects_figure_draws_each_scenario_cell(monkeypatch, tmp_path):
    """x10 and x1e6 are two rows, named as sdc-regress names their cells."""
    scale = {"fired": True, "site": "grad", "model": "scale", "effect": "benign"}
    df = frame(dict(scale, factor=10.0), dict(scale, factor=1e6, effect="harmful"))
    drawn = kept_open(monkeypatch)
    figures.effects_by_scenario(df, tmp_path / "effects.png")
    labels = [t.get_text() for t in drawn[0].axes[0].get_yticklabels()]
    assert labels == ["grad / scale / x10", "grad / scale / x1e+06"]


def test_the_effects_figure_leaves_out_faults_that_never_struck(monkeypatch, tmp_path):
    """A planned fault that never struck (effect none) is counted apart: its share was left
    undrawn, and the cell's bar ended short of 1."""
    scale = {"site": "grad", "model": "scale", "factor": 10.0}
    df = frame(dict(scale, fired=True, effect="benign"), dict(scale, fired=False, effect="none"),
               dict(scale, fired=True, effect="harmful"))  # fmt: skip
    drawn = kept_open(monkeypatch)
    figures.effects_by_scenario(df, tmp_path / "effects.png")
    ends = [bar.get_x() + bar.get_width() for bar in drawn[0].axes[0].patches]
    assert max(ends) == pytest.approx(1.0)


def test_time_to_detection_histogram_draws_every_caught_trial(monkeypatch, tmp_path):
    caught = {"fired": True, "detected": True, "detectors": "replay", "detected_by": "replay",
              "first_detector": "replay"}  # fmt: skip
    df = frame(*(dict(caught, ttd_steps=t) for t in (0, 5, 30, 45, 49)))
    drawn = kept_open(monkeypatch)
    figures.detection_delay(df, tmp_path / "ttd.png")
    assert sum(bar.get_height() for bar in drawn[0].axes[0].patches) == 5


def test_escape_impact_counts_the_damage_of_harmful_faults_no_detector_caught(tmp_path):
    df = tables.load_trials([escaped_trials(tmp_path / "run")])
    rows = tables.escapes(df)
    assert sum(int(r["escaped / harmful"].split("/")[0]) for r in rows) == 3
    assert sum(r["final loss NaN/Inf"] for r in rows) == 1
    for row in rows:
        assert row["persistence"] != ""
        escaped, harmful = map(int, row["escaped / harmful"].split("/"))
        assert 0 < escaped <= harmful
        if row["final loss NaN/Inf"] < escaped:
            assert float(row["largest abs loss_delta"]) > 0


def test_report_without_overhead_has_escapes_and_no_overhead_section(tmp_path):
    out = escaped_trials(tmp_path / "run")
    report.write_report(tables.load_trials([out]), out)
    text = (out / "report.md").read_text()
    assert "## Escape impact" in text and "(figures/escapes.png)" in text
    assert "Overhead" not in text
    assert "; dtypes: float32; precisions: 32-true; effects: " in text
    # Rows copied without their golden.jsonl (as results/baseline holds them): not "0 golden runs".
    assert "Golden runs: not recorded (no golden.jsonl beside trials.csv)" in text
    assert "figures/escapes.png" in images_render_from_disk(out)


def test_a_report_of_trials_no_check_ran_in_claims_nothing_of_checks(tmp_path):
    """A campaign of `detectors=[]` (the faults' effects alone): its report said "All
    detectors: 0 alerts", that clean trials ended bit-identical "with checks observing", and
    drew a catch-rate figure of no bars."""
    out = escaped_trials(tmp_path / "run")
    with open(out / "trials.csv", newline="") as f:
        table = list(csv.DictReader(f))
    for row in table:
        row.update(detectors="", detected="False", detected_by="", first_detector="",
                   alert_detectors="", alerts="0", detect_step="", ttd_steps="",
                   ttd_seconds="", loss_delta="" if row["effect"] == "harmful" else
                   row["loss_delta"])  # fmt: skip
    with open(out / "trials.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    text = report.write_report(tables.load_trials([out]), out).read_text()
    assert "No check ran in these trials." in text and "All detectors" not in text
    assert "## Detectors observe only" not in text and "catch_rate.png" not in text
    assert "figures/escapes.png" in images_render_from_disk(out)


def test_sweep_report_merges_every_jobs_overhead_next_to_its_floor(tmp_path):
    root = sweep(tmp_path / "sweep")
    merged = overheads.load_overhead([root])
    assert list(merged["detector"]) == ["nan_inf", "replay", "replay"]
    assert list(merged["interval"]) == ["", "1", "5"]
    nan_inf = merged.iloc[0]
    assert nan_inf["overhead_pct"] == 2.0 and nan_inf["runs"] == 2  # the median of two jobs
    assert math.isnan(nan_inf["floor_pct"])

    report.write_report(tables.load_trials([root]), root, [root])
    text = (root / "report.md").read_text()
    section = text.split("## Overhead against audit interval")[1].split("\n## ")[0]
    # Tables measured before plain DDP was a reference, and before the rounds' spread was
    # recorded, show a dash in those columns.
    assert "| nan_inf | - | 2.00% | - | - | - | - | 2 |" in section
    assert "| replay | 1 | 30.00% | - | - | 25.00% | 1.20x | 1 |" in section
    assert "| replay | 5 | 7.00% | - | - | 5.00% | 1.40x | 1 |" in section
    assert "(figures/overhead.png)" in section
    assert "figures/overhead.png" in images_render_from_disk(root)


def test_blind_spot_and_counts_are_numbers(tmp_path):
    df = tables.load_trials([escaped_trials(tmp_path / "run")])
    cells = {c.key: c for c in tables.cell_stats(df)}
    assert all(isinstance(c.blind, bool) for c in cells.values())
    assert tables.blind_spot((0, 4)) and not tables.blind_spot((4, 4))
    assert not tables.blind_spot((0, 0))  # no harmful trials: nothing to be blind to
    counts = tables.catch_counts(df)
    assert set(counts) == set(tables.TRIAL_SETS)
    k, n = counts["harmful"][tables.ANY]
    assert n - k == 3  # exactly the three escapes
    assert tables.false_positive_counts(df)["nan_inf"][1] == (df["site"] == "none").sum()


def test_catch_rate_against_audit_interval_counts_each_checks_own_alerts(tmp_path):
    """The notebook fixture: a replay sweep at intervals 1, 5 and 20 over the same faults at step
    10; replay catches the audited step's faults at intervals 1 and 5 (10 is a multiple of
    both) and none at 20."""
    df = tables.load_trials([Path(__file__).resolve().parent / "fixtures" / "sweep"])
    outcomes = intervals.interval_outcomes(df)
    per_interval = outcomes.groupby("interval")["caught"].agg(["sum", "size"])
    fired = int(df["fired"].sum())
    assert per_interval["size"].sum() == fired
    assert per_interval.loc[20, "sum"] == 0 < per_interval.loc[5, "sum"]
    assert set(outcomes.loc[outcomes["caught"], "ttd_steps"]) == {0}
    rows = intervals.audit_intervals(df)
    assert {(r["check"], r["interval"]) for r in rows} == {("replay", k) for k in (1, 5, 20)}
    assert "## Catch rate against audit interval" in report.write_report(df, tmp_path).read_text()


def test_faults_that_never_struck_are_counted_apart_from_every_effect():
    with open(BASELINE / "trials.csv", newline="") as f:
        table = pd.DataFrame(list(csv.DictReader(f))[::20])
    table["fired"] = table["fired"] == "True"
    assert (table["site"] == "none").any() and table["fired"].any()
    assert report.never_struck(table) == 0
    faulty = table.index[table["site"] != "none"][:3]
    table.loc[faulty, ["fired", "effect"]] = [False, "none"]
    line = report.effects_line(table)
    assert line.endswith("; 3 planned faults never struck (effect none)"), line
    assert "masked" not in report.effects_line(table.loc[faulty])


def test_a_crashed_trial_is_a_crash_not_a_fault_that_never_struck():
    """A crashed trial's ranks sent no events, so its row says fired False: its effect, crash,
    is what the line reports, not a planned fault that never struck."""
    with open(BASELINE / "trials.csv", newline="") as f:
        table = pd.DataFrame(list(csv.DictReader(f))[::20])
    table["fired"] = table["fired"] == "True"
    faulty = table.index[table["site"] != "none"][:2]
    table.loc[faulty, ["fired", "effect"]] = [False, "crash"]
    assert report.never_struck(table) == 0
    line = report.effects_line(table)
    assert "crash 2" in line and "never struck" not in line, line


def test_product_coverage_is_said_of_runs_with_compute_faults_alone(tmp_path):
    """The share of a step's products matmul_checksum checks speaks of faults at site matmul:
    a run without any said 'checks 0.0%' of a product count no fault of it struck."""
    folder = escaped_trials(tmp_path / "run")
    (folder / "campaign.json").write_text('{"product_coverage": {"checked": 0.0, "flops": 1e7}}')
    df = pd.read_csv(folder / "trials.csv", keep_default_na=False).assign(run=str(folder))
    assert report.coverage_line(df[df["site"] != "matmul"]) == ""
    computing = df.assign(site="matmul")
    assert report.coverage_line(computing).startswith(
        "Product coverage: matmul_checksum checks 0.0% of 0.01 GFLOP"
    )


@pytest.mark.parametrize(
    "tool, argv, says",
    [
        ("sdc-report", ["--bogus", "x"], "unrecognized arguments: --bogus"),
        ("sdc-report", [], "the following arguments are required: dirs"),
        ("sdc-regress", ["a"], "the following arguments are required: current"),
    ],
)
def test_a_bad_command_line_exits_2_in_one_line(tool, argv, says, capsys):
    """argparse's own refusal printed its usage block above the error: two lines."""
    main = {"sdc-report": report.main, "sdc-regress": regress.main}[tool]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err == f"{tool}: {says}\n"


def test_a_table_of_no_trials_is_refused_in_one_line(tmp_path, capsys):
    """A campaign stopped before its first row: sdc-report wrote a report with an empty "Runs:"
    line and exited 0; sdc-plan said "no fault struck in : ..."."""
    shutil.copy(BASELINE / "trials.csv", tmp_path / "trials.csv")
    header = (tmp_path / "trials.csv").read_text().splitlines()[0]
    (tmp_path / "trials.csv").write_text(header + "\n")
    for tool, main in (("sdc-report", report.main), ("sdc-plan", plan_report.main)):
        with pytest.raises(SystemExit) as exited:
            main([str(tmp_path)])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1, (tool, err)
        assert "trials.csv holds no trials yet" in err, (tool, err)
    assert not (tmp_path / "report.md").exists()


def test_a_run_named_twice_or_beside_its_sweep_and_another_runs_out_are_refused(tmp_path, capsys):
    """`sdc-report R R` reported each trial twice (and so did a sweep beside one of its jobs, a
    second run of the same campaign, and sdc-plan, whose n doubled); `--out` another run's
    folder replaced its report.md with one of these trials; `--out` a file ended in a
    traceback."""
    sweep = tmp_path / "sweep"
    shutil.copytree(BASELINE, sweep / "0", ignore=shutil.ignore_patterns("README.md"))
    other = tmp_path / "other"
    shutil.copytree(BASELINE, other, ignore=shutil.ignore_patterns("README.md"))
    (other / "report.md").write_text("the other run's own report\n")
    (tmp_path / "a-file").write_text("the user's data\n")
    cases = [
        ([str(BASELINE), str(BASELINE)], "named with"),
        ([str(sweep), str(sweep / "0")], "named with"),
        # Two runs of one campaign (a copy, or the same command run again) repeat its rows.
        ([str(other), str(sweep / "0")], "the same campaign as"),
        ([str(sweep), "--out", str(other)], "another run's folder"),
        ([str(sweep), "--out", str(tmp_path / "a-file")], "not a folder"),
    ]
    for argv, message in cases:
        for tool, main in (("sdc-report", report.main), ("sdc-plan", plan_report.main)):
            with pytest.raises(SystemExit) as exited:
                main(argv)
            err = capsys.readouterr().err
            assert exited.value.code == 2 and message in err and err.count("\n") == 1, (tool, err)
    assert (other / "report.md").read_text() == "the other run's own report\n"
    assert not (sweep / "report.md").exists()


def seeds_of(baseline_run: Path, folder: Path, seeds: range, **settings: object) -> Path:
    """The baseline run as if run with only `seeds` (from workload.seed, as `campaign.seeds`
    counts them) and the campaign settings given: its campaign.json and its rows of them."""
    record = json.loads((baseline_run / "campaign.json").read_text())
    record["seeds"] = len(seeds)
    record["workload"]["seed"] = seeds.start
    record["trials"] = [t for t in record["trials"] if t["seed"] in seeds]
    record.update(settings)
    folder.mkdir(parents=True)
    (folder / "campaign.json").write_text(json.dumps(record))
    with open(baseline_run / "trials.csv", newline="") as f:
        table = list(csv.DictReader(f))
    with open(folder / "trials.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(r for r in table if int(r["seed"]) in seeds)
    return folder


def test_runs_that_share_seeds_of_one_campaign_are_refused_naming_the_seeds(tmp_path, capsys):
    """`sdc-report A S` with S the same campaign run for 2 seeds of A's 5 (or with
    campaign.fast_forward=false, golden_cache or checkpoint.keep otherwise, which change no
    row) counted S's trials twice, as new evidence: only identical seed lists were refused."""
    a = seeds_of(BASELINE, tmp_path / "A", range(0, 4))
    fewer = seeds_of(BASELINE, tmp_path / "S", range(0, 2))
    slow = seeds_of(
        BASELINE,
        tmp_path / "F",
        range(1, 3),
        fast_forward=False,
        golden_cache=False,
        checkpoint={"interval": 10, "keep": True},
    )
    for other, shared in ((fewer, "seeds 0-1"), (slow, "seeds 1-2")):
        with pytest.raises(SystemExit) as exited:
            report.main([str(a), str(other)])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"sdc-report: {other}: the same campaign as {a} for {shared} ")
        assert not (a / "report.md").exists()
    # Seeds apart, or a setting that decides a row apart: other trials, read together.
    later = seeds_of(BASELINE, tmp_path / "L", range(4, 6))
    noisier = seeds_of(BASELINE, tmp_path / "N", range(0, 2), noise_seeds=3)
    assert len(tables.load_trials([a, later])) == 33 * 6
    assert len(tables.load_trials([a, noisier])) == 33 * 6


def test_a_merge_goes_to_a_folder_of_its_own_and_keeps_each_runs_report(
    tmp_path, capsys, monkeypatch
):
    """`sdc-report A B` wrote the merged report over A's own report.md, report.html and
    figures: "the first folder" was the default, which only --help said."""
    kept_open(monkeypatch)  # no figure drawn to disk: the reports' own files are the point
    a = seeds_of(BASELINE, tmp_path / "A", range(0, 1))
    b = seeds_of(BASELINE, tmp_path / "B", range(1, 2))
    c = seeds_of(BASELINE, tmp_path / "C", range(2, 3))
    (a / "report.md").write_text("A's own report\n")
    (a / "figures").mkdir()
    (a / "figures" / "catch_rate.png").write_bytes(b"A's own figure")
    for others, folder in (([b], "merged"), ([c], "merged-2"), ([b], "merged")):
        report.main([str(a), *map(str, others)])
        assert capsys.readouterr().out.endswith(f"report: {a / folder / 'report.md'}\n")
        runs = (a / folder / "report.md").read_text().splitlines()[2]
        assert runs == f"Runs: {', '.join(sorted(map(str, [a, *others])))}  "
    assert (a / "report.md").read_text() == "A's own report\n"
    assert (a / "figures" / "catch_rate.png").read_bytes() == b"A's own figure"
    assert not (a / "report.html").exists()
    assert {p.name for p in a.iterdir() if p.is_dir()} == {"figures", "merged", "merged-2"}


@pytest.mark.parametrize("cut", [40, 1], ids=["mid-row", "its newline alone"])
def test_a_torn_last_row_says_a_rerun_drops_it_and_resumes(cut, tmp_path, capsys):
    """A campaign stopped mid-write: its last line torn. sdc-report said only "its cells do not
    match the header's columns", not what to do; a row cut where its cells still read (its
    newline alone) was counted as whole."""
    run = seeds_of(BASELINE, tmp_path / "run", range(0, 1))
    data = (run / "trials.csv").read_bytes()
    (run / "trials.csv").write_bytes(data[:-cut])
    with pytest.raises(SystemExit) as exited:
        report.main([str(run)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err == (
        f"sdc-report: {run / 'trials.csv'}, line 34: cut short, without its newline (a campaign "
        "stopped while writing it); rerun the same sdc-bench command (the same out), which "
        "drops the torn line and resumes\n"
    )
    assert not (run / "report.md").exists()
