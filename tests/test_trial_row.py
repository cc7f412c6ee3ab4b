"""trials.csv's row, typed: a stored table reads into TrialRows and writes back as the same bytes,
a cell that does not read names its file, line and column, the docs' column table is the one
TrialRow generates, and no module that handles rows names a column in a string."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from harness.analysis.tables import ReportError, load_trials
from harness.core.vocabulary import Effect, EffectSource, Parallel, Persistence, Scope, Site
from harness.results.trial_row import (
    COLUMNS,
    CONTRACT_COLUMNS,
    TrialRow,
    TrialRowError,
    columns_markdown,
    read_trials,
    write_trials,
)

ROOT = Path(__file__).parents[1]
BASELINE = ROOT / "results" / "baseline" / "trials.csv"

# Every field away from its default, with the awkward values a campaign writes: a float's
# shortest repr, a negative restore step, an infinite loss, a bit class.
FULL = TrialRow(
    trial_id="007-grad-scale-s3", seed=3, workload="llama", dtype="bfloat16", nodes=4,
    ranks_per_node=2, site=Site.ALLREDUCE, model="bitflip", bit="exponent_msb", factor=1e-05,
    value="nan", scope=Scope.REDUCTION, persistence=Persistence.INTERMITTENT, fired=True,
    inject_step=10, injected_ranks=(1, 3), effect=Effect.HARMFUL, detected=True,
    first_detector="replay", detect_step=11, ttd_steps=1, ttd_seconds=0.1 + 0.2,
    contained=False, alerts=12, suspect_ranks=(3,), suspect_nodes=(1,),
    attribution_correct=False, recovered=True, final_loss=float("inf"),
    golden_final_loss=1.0283843278884888, loss_delta=float("inf"), step_time_s=0.027955,
    campaign="nightly", detectors=("nan_inf", "replay"), detected_by=("replay",),
    alert_detectors=("nan_inf", "replay"), fault_ranks=(1,), fault_steps=(10, 12),
    golden_match=False, replicas_agree=False, divergent_ranks=(1,), noise_band=0.10098,
    stopped_step=11, recoveries=2, restore_step=(-1, 10), steps_lost=7, recovery_s=1.234,
    quarantined_nodes=(1,), final_nodes=3, recovery_verdict="retry at step 11; rollback at 12",
    crash_cause="rank 2 killed by SIGKILL", start_step=10,
    check_intervals={"replay": 5, "weight_consensus": 10}, detect_steps={"replay": 11},
    damage=("replicas diverged",), effect_from=EffectSource.OBSERVE_TWIN,
    warnings=("replay: not deterministic",), parallel=Parallel.HSDP, shard_size=2,
    fault_class="defective_unit", weight=0.495, bit_dtype="bfloat16",
    bit_class="exponent", precision="bf16-mixed", fault_phase="backward",
    fault_settings="nbits=2 rate=0.1", alert_counts={"nan_inf": 9, "replay": 3},
)  # fmt: skip


# Columns added since the first tables were written.
LATER = ("parallel", "shard_size", "fault_class", "weight", "bit_dtype", "bit_class", "precision",
         "fault_phase", "fault_settings", "alert_counts")  # fmt: skip


def test_an_older_table_reads_and_writes_back_byte_identical(tmp_path):
    """The nightly baseline's rows as a harness before `parallel`, `bit_class` and the other
    later columns wrote them: they read with their defaults, the report classes each bit from
    its index, and written with its own header the table is the same bytes."""
    _, rows = read_trials(BASELINE)
    older = tmp_path / "older" / "trials.csv"
    older.parent.mkdir()
    write_trials(older, rows, [c for c in COLUMNS if c not in LATER])
    header, read = read_trials(older)
    assert not set(LATER) & set(header) and len(read) == 1980
    assert {r.parallel for r in read} == {Parallel.DDP} and {r.bit_class for r in read} == {None}
    assert {r.effect for r in read} == set(Effect) - {Effect.CRASH}
    again = tmp_path / "trials.csv"
    write_trials(again, read, header)
    assert again.read_bytes() == older.read_bytes()
    # Classed from the bit: an `exponent` trial that flipped bit 30 reads as `exponent_msb`.
    frame = load_trials([older.parent])
    flips = frame[frame["trial_id"].str.contains("grad-bitflip-exponent-s")]
    assert set(flips["bit_class"]) == {"exponent", "exponent_msb"}
    kept = load_trials([BASELINE.parent])
    assert set(kept[kept["trial_id"].isin(flips["trial_id"])]["bit_class"]) == {"exponent"}


def test_every_field_survives_a_round_trip(tmp_path):
    assert all(getattr(FULL, f.name) != f.default for f in dataclasses.fields(TrialRow))
    path = tmp_path / "trials.csv"
    write_trials(path, [FULL])
    header, rows = read_trials(path)
    assert header == COLUMNS and rows == [FULL]
    again = tmp_path / "again.csv"
    write_trials(again, rows)
    assert again.read_bytes() == path.read_bytes()


@pytest.mark.parametrize(
    ("column", "text"),
    [("fired", "true"), ("seed", "1.5"), ("effect", "ruined"), ("injected_ranks", "1;x")],
)
def test_a_cell_that_does_not_read_names_its_file_line_and_column(tmp_path, column, text):
    path = tmp_path / "trials.csv"
    write_trials(path, [FULL, FULL])
    lines = path.read_text().splitlines()
    cells = lines[2].split(",")
    cells[COLUMNS.index(column)] = text
    lines[2] = ",".join(cells)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        TrialRowError, match=rf"trials.csv, line 3: column {column}: '{text}' is not"
    ) as raised:
        read_trials(path)
    assert "<" not in str(raised.value)  # the cells' wording, not a Python type
    with pytest.raises(ReportError, match=f"column {column}"):
        load_trials([tmp_path])


def test_a_row_cut_short_or_too_long_names_its_line(tmp_path):
    path = tmp_path / "trials.csv"
    write_trials(path, [FULL, FULL])
    lines = path.read_text().splitlines()
    for changed in (lines[1].rsplit(",", 30)[0], lines[1] + ",extra"):
        path.write_text("\n".join([lines[0], changed, lines[2]]) + "\n")
        with pytest.raises(
            TrialRowError, match=f"line 2: its cells do not match the header's {len(COLUMNS)}"
        ):
            read_trials(path)


def test_a_table_without_a_contract_column_is_refused(tmp_path):
    path = tmp_path / "trials.csv"
    write_trials(path, [FULL], [c for c in COLUMNS if c != "effect"])
    with pytest.raises(TrialRowError, match="missing columns: effect"):
        read_trials(path)


def test_the_frame_holds_typed_values():
    """Booleans are bools (no "True" strings), numbers are numbers, blanks are missing."""
    frame = load_trials([BASELINE.parent])
    assert frame["fired"].dtype == bool and frame["detected"].dtype == bool
    assert set(frame["contained"].dropna()) == {True, False}
    assert frame["seed"].dtype.kind == "i" and frame["ttd_steps"].dtype.kind == "f"
    assert frame["inject_step"].isna().sum() == (frame["site"] == "none").sum()


def test_the_docs_column_table_is_the_generated_one():
    text = (ROOT / "docs" / "outputs.md").read_text()
    table = re.search(r"<!-- columns: generated -->\n(.*?)<!-- end columns -->", text, re.S)
    assert table and table.group(1) == columns_markdown()
    assert set(CONTRACT_COLUMNS) <= set(re.findall(r"`(\w+)`", table.group(1)))


def _handles_rows(tree: ast.Module) -> bool:
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return bool(imported & {"pandas", "harness.results.trial_row"})


def test_no_module_that_handles_rows_names_a_column_in_a_string():
    """Modules that read or write trials' rows (they import TrialRow or pandas) name columns
    through TrialRow (`Column.effect`). Config keys and event fields that share a column's name
    (`seed`, `site`, `trial_id`: the column was named after them) live in modules that never
    handle a row."""
    handling = []
    for path in sorted((ROOT / "harness").rglob("*.py")):
        if path.name == "trial_row.py":
            continue
        tree = ast.parse(path.read_text())
        if not _handles_rows(tree):
            continue
        handling.append(path.stem)
        named = {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in COLUMNS
        }
        assert not named, f"{path.relative_to(ROOT)} names columns in strings: {sorted(named)}"
    assert {"tables", "plan", "report", "records", "judgement", "run"} <= set(handling)
