"""README.md's commands and column names are real: every `sdc-bench` line composes and validates as
the command would run it, every other command and script it names exists, and every column it
names in trials.csv's row is one the schema writes."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

from harness.cli import implied_campaign
from harness.results.trial_row import COLUMNS
from tests.conftest import compose_run

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def commands() -> list[list[str]]:
    """Each command line of the README's bash blocks, continuations joined, comments dropped."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                found.append(words)
    return found


SDC_BENCH = [words[1:] for words in commands() if words[0] == "sdc-bench"]


def test_the_readme_has_its_two_commands_first():
    assert commands()[:2] == [["bash", "scripts/campaign.sh"], ["bash", "scripts/test.sh"]]


@pytest.mark.parametrize("overrides", SDC_BENCH, ids=" ".join)
def test_every_sdc_bench_line_composes_and_validates(overrides):
    # As `sdc-bench` completes its command line; a bad key or value raises ConfigError here.
    run = compose_run(*implied_campaign(overrides))
    assert run.trials and run.detectors, "a campaign with trials and checks to run"


def test_every_other_command_is_installed_or_a_script_of_the_repository():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for words in commands():
        if words[0] == "bash":
            assert (ROOT / words[1]).is_file(), words
        else:
            assert words[0] in scripts, words


def test_every_column_the_readme_names_for_trials_csv_is_written():
    row = next(line for line in README.splitlines() if line.startswith("| `trials.csv` |"))
    named = {n.strip() for span in re.findall(r"`([^`]+)`", row)[1:] for n in span.split(",")}
    named -= {"...", ""}
    assert named and named <= set(COLUMNS), named - set(COLUMNS)
