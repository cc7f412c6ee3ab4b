"""One row of trials.csv, typed: `TrialRow`'s fields are the table's columns, in the table's order
(docs/design.md, section 4). The CSV header, the cell format, the reader analysis uses and the
column table of docs/outputs.md all derive from this class, so a column is named once.

Cells: None is a blank; a bool is `True`/`False`; a list is `;`-joined in the order held; a
mapping (a check's interval or first alert) is `name=value` entries, `;`-joined; an enum is its
value. Reading a cell inverts writing it exactly, so a table read and written back is the same
bytes. A table written by an older harness lacks some of the extra columns: they read as their
defaults, and written back, the table keeps its own columns.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from harness.core.vocabulary import Effect, EffectSource, Parallel, Persistence, Scope, Site

# Columns beyond the contract: what the report and audits of the table need. Tables written
# before a column existed lack it, so each has a default.
_EXTRA = {"contract": False}


def _extra(default: Any = None, *, factory: Callable[[], Any] | None = None) -> Any:
    if factory is not None:
        return field(default_factory=factory, metadata=_EXTRA)
    return field(default=default, metadata=_EXTRA)


@dataclass(frozen=True, kw_only=True)
class TrialRow:
    """One trial as judged (harness/results/judgement.py); None where the column is blank."""

    # The contract's columns (docs/design.md, section 4).
    trial_id: str
    seed: int
    workload: str
    dtype: str
    nodes: int
    ranks_per_node: int
    site: Site
    model: str
    bit: int | str | None = None  # the bit flipped (one, of one dtype), else the configured one
    factor: float | None = None
    value: str | None = None
    scope: Scope | None = None
    persistence: Persistence | None = None
    fired: bool
    inject_step: int | None = None
    injected_ranks: tuple[int, ...] = ()
    effect: Effect
    detected: bool
    first_detector: str | None = None
    detect_step: int | None = None
    ttd_steps: int | None = None
    ttd_seconds: float | None = None
    contained: bool | None = None
    alerts: int
    suspect_ranks: tuple[int, ...] = ()
    suspect_nodes: tuple[int, ...] = ()
    attribution_correct: bool | None = None
    recovered: bool | None = None
    final_loss: float | None = None  # None: not a number, or the trial crashed
    golden_final_loss: float
    loss_delta: float | None = None
    step_time_s: float | None = None  # None: no step completed
    # Beyond the contract.
    campaign: str | None = _extra()
    detectors: tuple[str, ...] = _extra(())
    detected_by: tuple[str, ...] = _extra(())
    alert_detectors: tuple[str, ...] = _extra(())
    fault_ranks: tuple[int, ...] = _extra(())
    fault_steps: tuple[int, ...] = _extra(())
    golden_match: bool | None = _extra()
    replicas_agree: bool | None = _extra()
    divergent_ranks: tuple[int, ...] = _extra(())
    noise_band: float | None = _extra()
    stopped_step: int | None = _extra()
    recoveries: int | None = _extra()
    restore_step: tuple[int, ...] = _extra(())
    steps_lost: int | None = _extra()
    recovery_s: float | None = _extra()
    quarantined_nodes: tuple[int, ...] = _extra(())
    final_nodes: int | None = _extra()
    recovery_verdict: str | None = _extra()
    crash_cause: str | None = _extra()
    start_step: int = _extra(0)
    check_intervals: dict[str, int] = _extra(factory=dict)
    detect_steps: dict[str, int] = _extra(factory=dict)
    # Whether each check's own first alert at or after the injection named the culprits and
    # nothing else (`attribution_correct` is the first alert's): a check that names healthy
    # ranks shows here even where another check alerted first.
    attributions: dict[str, bool] = _extra(factory=dict)
    damage: tuple[str, ...] = _extra(())
    effect_from: EffectSource = _extra(EffectSource.RUN)
    warnings: tuple[str, ...] = _extra(())
    # A table written before sharding existed was replicated.
    parallel: Parallel = _extra(Parallel.DDP)
    shard_size: int | None = _extra()
    # A weighed campaign's fault class of the trial and the class's weight (blank: unweighed).
    fault_class: str | None = _extra()
    weight: float | None = _extra()
    # The dtype `bit` indexes where it is not the workload's: under autocast a forward value
    # struck is bfloat16 (blank: the workload's, or flips in several dtypes).
    bit_dtype: str | None = _extra()
    # The trial's bit class as its scenario names it: the configured class (a drawn bit may also
    # be in a narrower one), else the class of its bit in that bit's dtype.
    bit_class: str | None = _extra()
    # The recipe's precision, Lightning's name: `dtype` is the weights', float32 under bf16-mixed,
    # whose forward computes in bfloat16 (blank: a table written before the column).
    precision: str | None = _extra()
    # A matmul fault's product: forward, or the gradients' products in backward.
    fault_phase: str | None = _extra()
    # The fault's other settings away from their defaults, that no column of their own holds
    # ("rate=0.1", "tensor=riders"; FaultConfig.settings_text; blank: none, or a table written
    # before the column).
    fault_settings: str | None = _extra()
    # Each check's alerts, merged per step and phase as `alerts` counts them: the false positive
    # rate is alerts in clean trials / clean trials, per detector (docs/design.md, section 5),
    # which `alert_detectors` cannot give once a check alerts twice. Blank in a table written
    # before the column, where `alerts` may say some were raised.
    alert_counts: dict[str, int] = _extra(factory=dict)

    def cells(self) -> dict[str, str]:
        """The row as trials.csv's cells, by column."""
        return {name: cell_text(getattr(self, name)) for name in COLUMNS}

    @classmethod
    def from_cells(cls, cells: dict[str, str]) -> TrialRow:
        """The row whose cells these are; a column the dict lacks takes its blank or default.
        Raises TrialRowError naming a column whose cell does not read as its type, or the
        columns without a default that the dict lacks."""
        values = {}
        for name, text in cells.items():
            decode = _DECODERS.get(name)
            if decode is None:
                continue  # a column this harness does not know: not part of the row
            try:
                values[name] = decode(text)
            except ValueError:
                wanted = _cells_of(_HINTS[name])
                raise TrialRowError(f"column {name}: {text!r} is not {wanted}") from None
        missing = [f.name for f in _REQUIRED if f.name not in values]
        if missing:
            raise TrialRowError(f"missing columns: {', '.join(missing)}")
        return cls(**values)


class TrialRowError(ValueError):
    pass


def cell_text(value: object) -> str:
    """A field's value as its cell in trials.csv."""
    if value is None:
        return ""
    if isinstance(value, tuple):
        return ";".join(cell_text(v) for v in value)
    if isinstance(value, dict):
        return ";".join(f"{k}={v}" for k, v in value.items())
    return str(value)  # a StrEnum's value, True/False, a float's shortest repr


def _boolean(text: str) -> bool:
    if text not in ("True", "False"):
        raise ValueError(text)
    return text == "True"


def _decoder(hint: Any) -> Callable[[str], Any]:
    """The inverse of `cell_text` for a field of type `hint`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        item = _decoder(args[0])
        return lambda text: tuple(item(x) for x in text.split(";")) if text else ()
    if origin is dict:
        value = _decoder(args[1])
        return lambda text: (
            {k: value(v) for k, v in (x.split("=", 1) for x in text.split(";"))} if text else {}
        )
    if origin in (typing.Union, types.UnionType):
        options = [_decoder(a) for a in args if a is not type(None)]

        def first_that_reads(text: str) -> Any:
            if text == "":
                return None
            for option in options:
                try:
                    return option(text)
                except ValueError:
                    pass
            raise ValueError(text)

        return first_that_reads
    if hint is bool:
        return _boolean
    return hint  # int, float, str, or an enum: each raises ValueError on a cell it cannot read


_HINTS = typing.get_type_hints(TrialRow)
_DECODERS = {name: _decoder(hint) for name, hint in _HINTS.items()}
COLUMNS = tuple(f.name for f in dataclasses.fields(TrialRow))
_REQUIRED = [f for f in dataclasses.fields(TrialRow) if f.default is f.default_factory is MISSING]
CONTRACT_COLUMNS = tuple(
    f.name for f in dataclasses.fields(TrialRow) if f.metadata.get("contract", True)
)
# Column names as attributes (`Column.effect`), for the analysis's frames: a misspelt name is
# an AttributeError where a string would be an empty selection.
Column = StrEnum("Column", [(c, c) for c in COLUMNS])


def _line(values: Iterable[str]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(values)
    return buffer.getvalue()


def header_line(columns: Iterable[str] = COLUMNS) -> str:
    return _line(columns)


def row_line(row: TrialRow, columns: Iterable[str] = COLUMNS) -> str:
    """The row as one line of trials.csv (with its newline)."""
    cells = row.cells()
    return _line(cells[c] for c in columns)


def read_trials(path: Path) -> tuple[tuple[str, ...], list[TrialRow]]:
    """A trials.csv's header and rows. Raises TrialRowError naming the file and line of a cell
    that does not read, or the contract columns the header lacks, or a last row cut short (no
    newline: a campaign stopped mid-write), whose cells, though they may read, are not whole."""
    data = path.read_bytes()
    whole = data.count(b"\n")
    if whole and not data.endswith(b"\n"):  # a header, then a torn row
        raise TrialRowError(
            f"{path}, line {whole + 1}: cut short, without its newline (a campaign "
            "stopped while writing it); rerun the same sdc-bench command (the same out), which "
            "drops the torn line and resumes"
        )
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = tuple(reader.fieldnames or ())
        missing = [c for c in CONTRACT_COLUMNS if c not in header]
        if missing:
            raise TrialRowError(f"{path}: missing columns: {', '.join(missing)}")
        rows = []
        for row in reader:
            if None in row or None in row.values():  # DictReader's mark of a cell too many or few
                raise TrialRowError(
                    f"{path}, line {reader.line_num}: its cells do not match the header's "
                    f"{len(header)} columns"
                )
            try:
                rows.append(TrialRow.from_cells(row))
            except TrialRowError as exc:
                raise TrialRowError(f"{path}, line {reader.line_num}: {exc}") from None
    return header, rows


def write_trials(path: Path, rows: Iterable[TrialRow], columns: Iterable[str] = COLUMNS) -> None:
    """A whole trials.csv with the given columns (a table read from an older file keeps its
    own); a campaign appends row by row instead (harness/results/records.py)."""
    columns = tuple(columns)
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:  # read_trials kept no value of them
        raise TrialRowError(f"{path}: no such columns: {', '.join(unknown)}")
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write(header_line(columns))
        f.writelines(row_line(row, columns) for row in rows)


def _cells_of(hint: Any) -> str:
    """What a column's cells hold, in words, from its type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_cells_of(a) for a in args if a is not type(None))
    if origin is tuple:
        return f"`;`-joined {_cells_of(args[0])}s"
    if origin is dict:
        if args[1] is bool:  # no `|`: it would end a markdown table's cell
            return "`name=True` / `name=False`, `;`-joined"
        return "`name=integer`, `;`-joined"
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return " / ".join(f"`{m.value}`" for m in hint)
    words = {bool: "`True` / `False`", int: "integer", float: "number", str: "text"}
    return words[hint]


def columns_markdown() -> str:
    """trials.csv's columns as docs/outputs.md tabulates them."""
    lines = ["| column | contract | cells | blank |", "|---|---|---|---|"]
    for f in dataclasses.fields(TrialRow):
        hint = _HINTS[f.name]
        optional = type(None) in typing.get_args(hint)
        listed = typing.get_origin(hint) in (tuple, dict)
        blank = "when unknown" if optional else "when empty" if listed else "never"
        contract = "yes" if f.name in CONTRACT_COLUMNS else ""
        lines.append(f"| `{f.name}` | {contract} | {_cells_of(hint)} | {blank} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(columns_markdown(), end="")
