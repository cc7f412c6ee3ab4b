"""report.html as a person sees it: scripts/check_report_html.py renders it in headless Chromium
(Debian's, which .ci/run installs) and fails when a figure, a table row or a link is lost."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from harness.analysis import report
from tests.conftest import BIN

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "scripts" / "check_report_html.py"
# A small real run's rows (an audit_frequency job): figures, tables and the overhead section.
RUN = ROOT / "tests" / "fixtures" / "sweep" / "0"


def check(page: Path) -> subprocess.CompletedProcess:
    chromium = shutil.which("chromium")
    assert chromium, "the report's browser check needs Debian's chromium (apt-get install chromium)"
    return subprocess.run(
        [str(BIN / "python"), str(CHECK), str(page), "--chromium", chromium],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_browser_check_passes_a_rendered_report_and_fails_one_that_lost_a_figure(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    report.main([str(run)])
    intact = check(run / "report.html")
    assert intact.returncode == 0, intact.stderr
    assert "ok; 6 figures, 7 tables" in intact.stdout
    assert (run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    lost = sorted((run / "figures").glob("*.png"))[0]
    lost.unlink()
    broken = check(run / "report.html")
    assert broken.returncode == 1
    assert broken.stderr.splitlines() == [
        f"check_report_html: figure not rendered: figures/{lost.name}"
    ], broken.stderr
