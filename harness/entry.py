"""The installed commands' entry points: each imports its command's module, then runs it, and
answers a Ctrl-C in either in one line with the shell's code for it (130).

A command's module imports torch and pandas, a second or two before any of its code runs; a
Ctrl-C then ended with Python's own traceback of the import, which sdc-bench's handling of
interrupts (harness/cli.py) could not reach, since it had not been imported yet. This module
imports nothing heavy, so it holds from the interpreter's first step.
"""

from __future__ import annotations

import importlib
import sys


def _run(command: str, module: str) -> None:
    try:
        main = importlib.import_module(module).main
    except KeyboardInterrupt:
        print(f"{command}: interrupted; nothing was run", file=sys.stderr)
        sys.exit(130)
    try:
        main()
    except KeyboardInterrupt:  # sdc-bench answers its own (and SIGTERM's 143) inside main
        print(f"{command}: interrupted", file=sys.stderr)
        sys.exit(130)


def sdc_bench() -> None:
    _run("sdc-bench", "harness.cli")


def sdc_report() -> None:
    _run("sdc-report", "harness.analysis.report")


def sdc_regress() -> None:
    _run("sdc-regress", "harness.analysis.regress")


def sdc_plan() -> None:
    _run("sdc-plan", "harness.analysis.plan_report")
