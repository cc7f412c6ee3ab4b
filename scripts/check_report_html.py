"""Open a report.html in headless Chromium, as a person sees it, and check it against the
report.md beside it: every figure loaded (decoded, naturalWidth > 0), every table shows the rows
report.md gives it, no raw markdown in the visible text, no link to a file or anchor that does
not exist. A full-page screenshot goes beside the report (report.png, or --screenshot PATH).

    apt-get install -y chromium      # Debian's; or pass --chromium PATH
    .venv/bin/python scripts/check_report_html.py results/runs/RUN/report.html

Exit 0 when every check passes, 1 with one line per failure, 2 on bad input (no such file, no
report.md beside it, no Chromium). `.ci/run` runs it on the default campaign's report.

Playwright (the `dev` extra) drives the browser, launched on the system's Chromium through
`executable_path`: nothing is downloaded, and the page is the one Debian's browser renders.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import sync_playwright

# What the page shows, read in the page once it has loaded (the load event waits for every
# image, so each one has loaded or failed by then).
PAGE = """() => ({
    images: [...document.images].map(i => ({
        src: i.getAttribute("src"), complete: i.complete, width: i.naturalWidth})),
    tables: [...document.querySelectorAll("table")].map(t => t.querySelectorAll("tbody tr").length),
    links: [...document.querySelectorAll("a[href]")].map(a => ({
        href: a.getAttribute("href"), url: a.href,
        target: a.hash ? document.getElementById(decodeURIComponent(a.hash.slice(1))) !== null
                       : null})),
    text: document.body.innerText,
})"""
# Markdown that did not render: a pipe-table line, a heading's hashes, emphasis or a link's
# brackets, a code fence, left as text.
RAW_MARKDOWN = {
    "a table line": re.compile(r"^\s*\|.*\|\s*$", re.M),
    "a heading": re.compile(r"^#{1,6} ", re.M),
    "bold text": re.compile(r"\*\*\S[^*]*\*\*"),
    "a link": re.compile(r"!?\[[^\]]+\]\([^)\s]+\)"),
    "a code fence": re.compile(r"^```", re.M),
}
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Checked:
    """What the check saw: its failures (one line each), and the counts it checked."""

    failures: list[str]
    images: int
    tables: int
    links: int
    seconds: float


def expected(markdown: str) -> tuple[list[str], list[int]]:
    """The images report.md shows, and each table's body rows (lines after its header and
    separator), in page order."""
    images = IMAGE.findall(markdown)
    tables, run = [], 0
    for line in [*markdown.splitlines(), ""]:
        if line.lstrip().startswith("|"):
            run += 1
        elif run:
            tables.append(run - 2)
            run = 0
    return images, tables


def check(page: Path, chromium: str, screenshot: Path, timeout_s: float) -> Checked:
    """Load `page` in headless Chromium and check it against the report.md beside it."""
    started = time.monotonic()
    want_images, want_rows = expected(page.with_name("report.md").read_text())
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True)
        try:
            tab = browser.new_page()
            tab.goto(page.resolve().as_uri(), wait_until="load", timeout=timeout_s * 1000)
            seen = tab.evaluate(PAGE)
            tab.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    failures = []
    shown = [i["src"] for i in seen["images"]]
    if shown != want_images:
        failures.append(f"images: report.md shows {want_images}, the page {shown}")
    failures += [
        f"figure not rendered: {i['src']}"
        for i in seen["images"]
        if not (i["complete"] and i["width"] > 0)
    ]
    if seen["tables"] != want_rows:
        failures.append(f"table rows: report.md has {want_rows}, the page shows {seen['tables']}")
    failures += [
        f"raw markdown ({what}): {match.group(0).strip()[:80]!r}"
        for what, pattern in RAW_MARKDOWN.items()
        if (match := pattern.search(seen["text"]))
    ]
    failures += [f"broken link: {link['href']}" for link in seen["links"] if broken(link)]
    elapsed = time.monotonic() - started
    return Checked(failures, len(shown), len(want_rows), len(seen["links"]), elapsed)


def broken(link: dict) -> bool:
    """An anchor with no element of its id, or a local file that does not exist; a link off
    the machine is not followed (CI has no network, and the report writes none)."""
    if link["target"] is False:
        return True
    url = urlparse(link["url"])
    return url.scheme == "file" and not Path(unquote(url.path)).exists()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path, help="a report.html")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--screenshot", type=Path, help="where the PNG goes (report.png)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the page to load")
    args = parser.parse_args(argv)
    bad = (
        f"{args.page}: no such file" if not args.page.is_file()
        else f"{args.page.with_name('report.md')}: no such file"
        if not args.page.with_name("report.md").is_file()
        else f"no Chromium at {args.chromium} (apt-get install chromium)"
        if not Path(args.chromium).is_file() else None
    )  # fmt: skip
    if bad:
        print(f"check_report_html: {bad}", file=sys.stderr)
        return 2
    screenshot = args.screenshot or args.page.with_name("report.png")
    try:
        checked = check(args.page, args.chromium, screenshot, args.timeout)
    except PlaywrightError as exc:
        print(f"check_report_html: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    for failure in checked.failures:
        print(f"check_report_html: {failure}", file=sys.stderr)
    verdict = "failed" if checked.failures else "ok"
    print(
        f"{args.page}: {verdict}; {checked.images} figures, {checked.tables} tables, "
        f"{checked.links} links checked in {checked.seconds:.1f} s; screenshot {screenshot}"
    )
    return 1 if checked.failures else 0


if __name__ == "__main__":
    sys.exit(main())
