#!/usr/bin/env bash
# Set up, then lint and run the test suite; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode cached in __pycache__ (ignored by git), pytest's rewritten test modules with it: where
# the environment turns caching off, each of pytest's three processes rewrote the asserts of 267
# modules at every collection, 3 s of CPU each on 2 cores.
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
# Debian's Chromium: the report's browser check (tests/test_report_html.py, and .ci/run) drives
# it through Playwright, which downloads no browser of its own.
if ! command -v chromium >/dev/null; then
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends chromium
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# The dependency rules between harness's layers (pyproject.toml, [tool.importlinter]).
.venv/bin/lint-imports --no-cache --no-logo
# Two workers, a test file each: most of a test's time is spent waiting on rank processes (world
# start, collective timeouts, hang detection), which the other worker fills with work. Files go
# out in tests/conftest.py's order, longest first, not xdist's (most tests first).
exec .venv/bin/pytest --numprocesses="${SDC_TEST_WORKERS:-2}" --dist=loadfile \
  --no-loadscope-reorder "$@"
