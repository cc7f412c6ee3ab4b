"""The rank server that spawned worlds fork their ranks from (harness/launch/rank_server.py): one
server serves every world whose environment is the one it started with, and a changed variable
starts a new one, whose ranks see it."""

from __future__ import annotations

import os
from pathlib import Path

from harness.launch import rank_server


def _write_variable(path: str) -> None:
    Path(path).write_text(os.environ.get("SDC_TEST_VARIABLE", "unset"))


def _rank_sees(ctx, tmp_path: Path) -> str:
    seen = tmp_path / "seen"
    proc = ctx.Process(target=_write_variable, args=(str(seen),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    return seen.read_text()


def test_a_changed_variable_starts_a_new_server_and_pytests_own_does_not(tmp_path, monkeypatch):
    monkeypatch.delenv("SDC_TEST_VARIABLE", raising=False)
    ctx = rank_server.context("avx2", tmp_path)
    first = rank_server.pid()
    assert _rank_sees(ctx, tmp_path) == "unset"
    # pytest rewrites this one at every phase of every test.
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
    rank_server.context("avx2", tmp_path)
    assert rank_server.pid() == first
    monkeypatch.setenv("SDC_TEST_VARIABLE", "set")
    ctx = rank_server.context("avx2", tmp_path)
    assert rank_server.pid() != first
    assert _rank_sees(ctx, tmp_path) == "set"
