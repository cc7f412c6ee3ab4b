"""Messages for the person at the terminal (a retry, a job without results): each module logs
to `logging.getLogger(__name__)`, and the command that runs (`sdc-bench`, the torchrun worker)
configures the `harness` logger once, to write each message as one stderr line prefixed with
the command's name, through tqdm so that a progress bar is not torn. What a command produces
(the summary, the paths of its files) stays on stdout."""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm


class _AboveProgressBars(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


def configure(command: str) -> None:
    logger = logging.getLogger("harness")
    if any(isinstance(h, _AboveProgressBars) for h in logger.handlers):
        return
    handler = _AboveProgressBars()
    handler.setFormatter(logging.Formatter(f"{command}: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
