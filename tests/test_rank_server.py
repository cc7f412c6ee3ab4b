"""The rank server that spawned worlds fork their ranks from (harness/launch/rank_server.py): one
server serves every world whose environment is the one it started with and whose packages it has
imported; a world that needs a package it lacks starts a new one that keeps what it had, and a
changed variable starts a new one, whose ranks see it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torch._inductor.runtime import cache_dir_utils

from harness.launch import rank_server


def _write_variable(path: str) -> None:
    Path(path).write_text(os.environ.get("SDC_TEST_VARIABLE", "unset"))


def _write_imported(path: str) -> None:
    Path(path).write_text(" ".join(m for m in ("xml.dom.minidom", "wave") if m in sys.modules))


def _rank_sees(ctx, tmp_path: Path, target=_write_variable) -> str:
    seen = tmp_path / "seen"
    proc = ctx.Process(target=target, args=(str(seen),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    return seen.read_text()


def test_a_changed_variable_or_a_missing_package_starts_a_new_server_and_less_does_not(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("SDC_TEST_VARIABLE", raising=False)
    ctx = rank_server.context("avx2", tmp_path, ("xml.dom.minidom",))
    first = rank_server.pid()
    assert _rank_sees(ctx, tmp_path) == "unset"
    assert _rank_sees(ctx, tmp_path, _write_imported) == "xml.dom.minidom"
    # pytest rewrites this one at every phase of every test; a world with no package of its own
    # is served by a server that imported one.
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
    rank_server.context("avx2", tmp_path)
    assert rank_server.pid() == first
    ctx = rank_server.context("avx2", tmp_path, ("wave",))
    second = rank_server.pid()
    assert second != first
    assert _rank_sees(ctx, tmp_path, _write_imported) == "xml.dom.minidom wave"
    monkeypatch.setenv("SDC_TEST_VARIABLE", "set")
    ctx = rank_server.context("avx2", tmp_path)
    assert rank_server.pid() not in (first, second)
    assert _rank_sees(ctx, tmp_path) == "set"
    assert _rank_sees(ctx, tmp_path, _write_imported) == ""


def test_the_variable_torch_writes_at_its_first_dynamo_import_starts_no_new_server(
    tmp_path, monkeypatch
):
    """torch._dynamo's import writes TORCHINDUCTOR_CACHE_DIR into its process's environment
    (its disk cache's folder, torch._inductor.runtime.cache_dir_utils.cache_dir): the server's
    preload imports it, and the parent does at its first optimizer, after the first world.
    Read as a changed environment, it started a second server in every process that ran two
    worlds: a campaign's second world after a crash, each test's second campaign."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    rank_server.context("avx2", tmp_path)
    first = rank_server.pid()
    cache_dir_utils.cache_dir()  # what importing torch._dynamo does, once per process
    assert "TORCHINDUCTOR_CACHE_DIR" in os.environ
    rank_server.context("avx2", tmp_path)
    assert rank_server.pid() == first
