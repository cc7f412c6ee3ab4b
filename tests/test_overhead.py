"""`campaign.overhead`: timed clean runs in the campaign's own world write overhead.csv
(docs/design.md, section 4). Timings on this loaded machine are noise around small numbers, so
the tests hold the table's structure and the signs that cannot flip, not its digits."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from harness.analysis import overheads, plan_report, report
from harness.analysis.plan import Job, PlanError, plan
from harness.analysis.regress import load, regressions, uncompared_overheads
from harness.analysis.tables import load_trials
from harness.campaign import overhead
from harness.campaign.run import SpawnExecutor
from harness.errors import ConfigError
from harness.results import schema
from tests import rows
from tests.conftest import compose_run, sdc_bench

BASELINE = Path(__file__).resolve().parent.parent / "results" / "baseline"
# The smallest world replay accepts (3 nodes); each check at an interval of its own.
TINY = [
    "campaign=single",
    "fault=none",
    "topology.nodes=3",
    "detectors=[nan_inf,replay,weight_consensus]",
    "detectors.replay.interval=2",
    "detectors.weight_consensus.interval=3",
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("overhead")
    run = compose_run(*TINY, "++campaign.overhead={steps:4,rounds:2}")
    executor = SpawnExecutor(run.topology, out / "world", out / "store", out / "crashes.log")
    try:
        assert overhead.measure(run, out, executor.run) == out / schema.OVERHEAD_FILE
    finally:
        executor.close()
    return out


def test_one_row_per_detector_with_its_interval_and_replays_floor(measured):
    with open(measured / schema.OVERHEAD_FILE, newline="") as f:
        reader = csv.DictReader(f)
        table = list(reader)
    assert reader.fieldnames == schema.OVERHEAD_COLUMNS
    assert [(r["detector"], r["interval"]) for r in table] == [
        ("hook", ""),
        ("nan_inf", ""),
        ("replay", "2"),
        ("weight_consensus", "3"),
    ]
    hook, *checks = table
    # The hook is the reference of overhead_pct; its own cost is against plain DDP only.
    assert hook["overhead_pct"] == hook["floor_pct"] == ""
    # Its rounds are against plain DDP, as its cost is.
    low, high = float(hook["overhead_low_pct"]), float(hook["overhead_high_pct"])
    assert low <= float(hook["overhead_vs_ddp_pct"]) <= high
    for row in checks:
        assert math.isfinite(float(row["overhead_pct"]))
        # The median of two rounds lies halfway between the lowest and the highest.
        low, high = float(row["overhead_low_pct"]), float(row["overhead_high_pct"])
        assert low <= float(row["overhead_pct"]) <= high
        assert float(row["overhead_pct"]) == pytest.approx((low + high) / 2, abs=0.002)
        # Against plain DDP a check pays for the hook too: (1 + check) (1 + hook) - 1.
        both = (1 + float(row["overhead_pct"]) / 100) * (
            1 + float(hook["overhead_vs_ddp_pct"]) / 100
        )
        assert float(row["overhead_vs_ddp_pct"]) == pytest.approx(100 * (both - 1), abs=0.01)
    replay = checks[1]
    # Five times the micro-batches per step cost more than once, whatever the load.
    assert float(replay["floor_pct"]) > 0
    assert checks[0]["floor_pct"] == checks[2]["floor_pct"] == ""


def test_the_report_shows_each_check_against_the_hook_and_plain_ddp(measured, tmp_path):
    section = report.overhead_section(overheads.load_overhead([measured]), tmp_path)
    header, _, *lines = [line for line in section.splitlines() if line.startswith("|")]
    names = [cell.strip() for cell in header.split("|")]
    by_name = {
        line.split("|")[1].strip(): dict(
            zip(names, (c.strip() for c in line.split("|")), strict=True)
        )
        for line in lines
    }
    assert set(by_name) == {"hook", "nan_inf", "replay", "weight_consensus"}
    hook = by_name.pop("hook")
    assert hook["overhead (vs hook)"] == "-"
    assert hook["overhead (vs plain DDP)"].endswith("%") and " to " in hook["rounds"]
    with open(measured / schema.OVERHEAD_FILE, newline="") as f:
        table = list(csv.DictReader(f))
    for row in table[1:]:
        cells = by_name[row["detector"]]
        assert cells["overhead (vs plain DDP)"].endswith("%")
        low, high = float(row["overhead_low_pct"]), float(row["overhead_high_pct"])
        assert cells["rounds"] == f"{low:.2f}% to {high:.2f}%"


def test_a_resumed_campaign_keeps_its_table_and_one_without_overhead_times_nothing(
    measured, tmp_path
):
    def never(run, spec):
        raise AssertionError(f"timed {spec.trial_id} again")

    run = compose_run(*TINY, "++campaign.overhead={steps:4,rounds:2}")
    assert overhead.measure(run, measured, never) == measured / schema.OVERHEAD_FILE
    # A campaign that does not ask for overhead times nothing.
    assert overhead.measure(compose_run(*TINY), tmp_path, never) is None
    assert not (tmp_path / schema.OVERHEAD_FILE).exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{steps:0}", "campaign.overhead.steps: 0 is out of range; allowed: 1..inf"),
        ("{steps:5,rounds:x}", "campaign.overhead.rounds: 'x' is not an integer"),
        ("{step:5}", "campaign.overhead.step: unknown key; allowed: steps, rounds"),
        ("yes", "campaign.overhead: 'yes' must be null or {steps: N, rounds: R}"),
    ],
)
def test_a_bad_overhead_setting_is_one_config_error_naming_the_key(value, message):
    with pytest.raises(ConfigError) as error:
        compose_run(*TINY, f"++campaign.overhead={value}")
    assert str(error.value) == message


def test_the_command_refuses_it_with_one_line_and_exit_2(tmp_path):
    proc = sdc_bench(*TINY, "++campaign.overhead={steps:0}", f"out={tmp_path / 'o'}", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "sdc-bench: error: campaign.overhead.steps: 0 is out of range; allowed: 1..inf"
    ]
    assert not (tmp_path / "o").exists()


def test_regress_reads_the_table_a_campaign_writes(measured, tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        for source in (BASELINE / "trials.csv", measured / schema.OVERHEAD_FILE):
            (tmp_path / name / source.name).write_bytes(source.read_bytes())
    assert load(tmp_path / "a").overhead is not None
    assert regressions(load(tmp_path / "a"), load(tmp_path / "b")) == []


def _sweep_over_workloads(root: Path, replay: dict[str, float]) -> Path:
    """A sweep with one job per workload, each with its trials and its replay@5 overhead."""
    for job, (workload, pct) in enumerate(replay.items()):
        folder = root / str(job)
        folder.mkdir(parents=True)
        rows.write(folder / "trials.csv", [{"workload": workload, "precision": "32-true"}])
        measured = {"detector": "replay", "interval": 5, "overhead_pct": pct, "floor_pct": 1.0}
        overhead.write(folder / schema.OVERHEAD_FILE, [measured])
    return root


def test_overheads_of_several_workloads_are_kept_apart_and_not_planned_together(tmp_path):
    """A median over an mlp's 4% and a gpt's 40% is neither workload's overhead."""
    root = _sweep_over_workloads(tmp_path / "a", {"mlp": 4.0, "gpt": 40.0})
    table = overheads.load_overhead([root])
    assert [(r.workload, r.dtype, r.overhead_pct, r.runs) for r in table.itertuples()] == [
        ("gpt", "float32", 40.0, 1),
        ("mlp", "float32", 4.0, 1),
    ]
    with pytest.raises(PlanError, match=r"several workloads \(gpt in float32, mlp in float32\)"):
        plan(load_trials([root]), table, Job())
    section = plan_report.report_section(load_trials([root]), table, tmp_path)
    assert "several workloads (gpt in float32, mlp in float32)" in section
    measured = report.overhead_section(table, tmp_path)
    assert "| workload | detector |" in measured and "| mlp | replay | 5 | 4.00% |" in measured
    # Each workload's overhead compares with its own: the gpt's grew, the mlp's did not.
    grown = _sweep_over_workloads(tmp_path / "b", {"mlp": 4.0, "gpt": 55.0})
    found = regressions(load(root), load(grown))
    assert [(f["where"], f["baseline"], f["current"]) for f in found] == [
        ("replay, interval 5, gpt in float32", "40.00%", "55.00%")
    ]


def _sweep_over_precisions(root: Path, checksum: dict[str, float]) -> Path:
    for job, (precision, pct) in enumerate(checksum.items()):
        folder = root / str(job)
        folder.mkdir(parents=True)
        caught = {"fired": True, "site": "matmul", "model": "scale", "detected": True,
                  "detectors": "matmul_checksum", "detected_by": "matmul_checksum"}  # fmt: skip
        rows.write(folder / "trials.csv", [{"workload": "gpt", "precision": precision, **caught}])
        measured = {"detector": "matmul_checksum", "interval": "", "overhead_pct": pct}
        overhead.write(folder / schema.OVERHEAD_FILE, [measured])
    return root


def test_overheads_of_a_precision_sweep_are_kept_apart(tmp_path):
    """bf16-mixed keeps float32 weights, so its runs share the dtype of 32-true ones, and its
    checks cost another share of another step (matmul_checksum +16.6% and +22.7% of gpt's)."""
    root = _sweep_over_precisions(tmp_path / "a", {"32-true": 16.6, "bf16-mixed": 22.7})
    table = overheads.load_overhead([root])
    assert [(r.precision, r.overhead_pct) for r in table.itertuples()] == [
        ("32-true", 16.6),
        ("bf16-mixed", 22.7),
    ]
    assert overheads.ran_on(table) == ["gpt in float32", "gpt in float32 (bf16-mixed)"]
    assert "| precision | detector |" in report.overhead_section(table, tmp_path)
    # Each compares with its own, and a finding names the mixed one.
    grown = _sweep_over_precisions(tmp_path / "b", {"32-true": 16.6, "bf16-mixed": 40.0})
    found = regressions(load(root), load(grown))
    assert [f["where"] for f in found] == [
        "matmul_checksum, interval -, gpt in float32 (bf16-mixed)"
    ]
    assert uncompared_overheads(load(root).overhead, load(grown).overhead) == []
    # A baseline timed on a workload the current run did not time is named, not passed over.
    plain = _sweep_over_precisions(tmp_path / "c", {"32-true": 16.6})
    assert uncompared_overheads(load(root).overhead, load(plain).overhead) == [
        "matmul_checksum, interval -, gpt in float32 (bf16-mixed)"
    ]
    # A current run that timed nothing compares none of them either.
    assert len(uncompared_overheads(load(root).overhead, None)) == 2
    assert overheads.ran_label("gpt", "float32", "") == "gpt in float32 (precision not recorded)"
    # The plan pools them, as it pools dtypes, and its source names both.
    costs = plan(load_trials([root]), table, Job()).overheads
    assert costs.source.startswith("gpt in float32, gpt in float32 (bf16-mixed)")


def test_one_runs_rounds_are_kept_and_a_sweeps_are_not(tmp_path):
    """The lowest and highest round spread over one run's noise, what sdc-regress judges
    growth by. A sweep's jobs may differ in more than workload, dtype and precision (a
    topology, a check's settings): rounds pooled over them would spread over the jobs'
    differences too, and hide one job's growth as noise."""
    jobs = {
        "0": {"nan_inf": (4.0, 1.0, 9.0), "grad_stats": (4.0, 1.0, 9.0)},
        "1": {"nan_inf": (6.0, 3.0, 12.0)},
    }
    for job, checks in jobs.items():
        folder = tmp_path / job
        folder.mkdir()
        rows.write(folder / "trials.csv", [{"workload": "gpt", "precision": "32-true"}])
        measured = [
            {"detector": name, "interval": "", "overhead_pct": pct, "overhead_low_pct": low,
             "overhead_high_pct": high}
            for name, (pct, low, high) in checks.items()
        ]  # fmt: skip
        overhead.write(folder / schema.OVERHEAD_FILE, measured)
    table = overheads.load_overhead([tmp_path]).set_index("detector")
    grad_stats, nan_inf = table.loc["grad_stats"], table.loc["nan_inf"]
    assert (grad_stats.overhead_low_pct, grad_stats.overhead_high_pct) == (1.0, 9.0)
    assert (nan_inf.overhead_pct, nan_inf.runs) == (5.0, 2)
    assert math.isnan(nan_inf.overhead_low_pct) and math.isnan(nan_inf.overhead_high_pct)
    # A table written before the rounds were recorded has none either.
    overhead.write(tmp_path / "0" / schema.OVERHEAD_FILE, [{"detector": "grad_stats",
                   "interval": "", "overhead_pct": 4.0}])  # fmt: skip
    old = overheads.load_overhead([tmp_path / "0"]).set_index("detector").loc["grad_stats"]
    assert math.isnan(old.overhead_low_pct) and math.isnan(old.overhead_high_pct)
