"""Open a report.html in headless Chromium and check that the page loads and that every <img>
on it rendered (decoded, naturalWidth > 0): the report's figures show when the folder is opened
from disk.

    apt-get install -y chromium      # Debian's; or pass --chromium PATH
    .venv/bin/python scripts/check_report_html.py results/runs/RUN/report.html

Exit 0 when the page loaded and every image rendered, 1 (with the images that did not) when not,
2 on bad input (no such file, no Chromium). Not part of the test run: CI has no Chromium.

Dependency-free: the browser is driven over the DevTools protocol on a pipe
(--remote-debugging-pipe: Chromium reads commands on fd 3 and writes replies on fd 4, each a
JSON message ended by a NUL byte), so neither a driver package nor a port is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--remote-debugging-pipe",
]
IMAGES = """[...document.images].map(i => ({
    src: i.getAttribute("src"), complete: i.complete, width: i.naturalWidth}))"""


class CheckError(RuntimeError):
    pass


class DevTools:
    """One Chromium, spoken to over its DevTools pipe; messages are answered by id."""

    def __init__(self, chromium: str, profile: Path):
        commands_r, self.commands = os.pipe()
        self.replies, replies_w = os.pipe()

        def child_fds() -> None:  # Chromium expects exactly fds 3 and 4
            os.dup2(commands_r, 3)
            os.dup2(replies_w, 4)

        self.proc = subprocess.Popen(
            [chromium, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(3, 4),
            preexec_fn=child_fds,
        )
        os.close(commands_r)
        os.close(replies_w)
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, session: str | None = None, timeout: float = 30, **params):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        reply = self._until(lambda m: m.get("id") == self.next_id, timeout, method)
        if "error" in reply:
            raise CheckError(f"{method}: {reply['error'].get('message')}")
        return reply["result"]

    def wait_event(self, method: str, timeout: float) -> dict:
        for i, event in enumerate(self.events):
            if event.get("method") == method:
                return self.events.pop(i)
        return self._until(lambda m: m.get("method") == method, timeout, method)

    def _until(self, wanted, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self.buffer:
                raw, self.buffer = self.buffer.split(b"\0", 1)
                message = json.loads(raw)
                if wanted(message):
                    return message
                if "method" in message:
                    self.events.append(message)
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckError(f"no answer to {what} within {timeout:g} s")
            ready, _, _ = select.select([self.replies], [], [], left)
            if ready:
                chunk = os.read(self.replies, 1 << 16)
                if not chunk:
                    raise CheckError(f"Chromium exited (code {self.proc.wait()}) during {what}")
                self.buffer += chunk

    def close(self) -> None:
        try:
            os.write(
                self.commands, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0"
            )
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        os.close(self.commands)
        os.close(self.replies)


def check(page: Path, chromium: str, timeout: float) -> list[dict]:
    """Load `page` and return its images as {src, complete, width}; raise CheckError when the
    page does not load."""
    with tempfile.TemporaryDirectory(prefix="check-report-") as profile:
        browser = DevTools(chromium, Path(profile))
        try:
            target = browser.send("Target.createTarget", url="about:blank")["targetId"]
            session = browser.send("Target.attachToTarget", targetId=target, flatten=True)[
                "sessionId"
            ]
            browser.send("Page.enable", session)
            navigated = browser.send("Page.navigate", session, url=page.resolve().as_uri())
            if navigated.get("errorText"):
                raise CheckError(f"{page}: {navigated['errorText']}")
            # The load event waits for every image, so each one has loaded or failed by then.
            browser.wait_event("Page.loadEventFired", timeout)
            result = browser.send(
                "Runtime.evaluate", session, expression=IMAGES, returnByValue=True
            )["result"]
            return result["value"]
        finally:
            browser.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path, help="a report.html")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds for the page to load")
    args = parser.parse_args(argv)
    if not args.page.is_file():
        print(f"check_report_html: {args.page}: no such file", file=sys.stderr)
        return 2
    if not Path(args.chromium).is_file():
        print(f"check_report_html: no Chromium at {args.chromium}", file=sys.stderr)
        return 2
    try:
        images = check(args.page, args.chromium, args.timeout)
    except CheckError as exc:
        print(f"check_report_html: {exc}", file=sys.stderr)
        return 1
    broken = [i for i in images if not (i["complete"] and i["width"] > 0)]
    for image in broken:
        print(f"not rendered: {image['src']}", file=sys.stderr)
    if not images:
        print(f"check_report_html: {args.page} loaded, but it has no images", file=sys.stderr)
        return 1
    print(f"{args.page}: loaded; {len(images) - len(broken)}/{len(images)} images rendered")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
