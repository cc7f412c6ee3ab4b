"""`crash`: the rank itself fails at the site and step (`fault.value`): `raise` an exception,
`exit` with code 0 as if done early, `hang` forever (its peers block in the next collective),
or `kill` itself with SIGKILL. docs/design.md section 5's `crash` effect, on demand: it
measures what a campaign and its detectors do when hardware takes a process down instead of a
value. The strike is recorded, and kept for the trial's row, before the rank goes (`fatal`): the
row says the fault fired, at its step and rank, and its effect is `crash`."""

from __future__ import annotations

import os
import signal
import time

import torch

from harness.errors import ConfigError
from injectors.model import FaultModel

ACTIONS = ("raise", "exit", "hang", "kill")


class InjectedCrash(RuntimeError):
    pass


class Crash(FaultModel):
    name = "crash"
    fatal = True

    @classmethod
    def validate(cls, key: str, fault) -> None:
        if fault.value not in ACTIONS:
            raise ConfigError(
                f"{key}.value", f"'{fault.value}' is not allowed; allowed: {', '.join(ACTIONS)}"
            )
        for name, unset in (("elements", 1), ("select", "random"), ("index", None)):
            if getattr(fault, name) != unset:
                raise ConfigError(
                    f"{key}.{name}", "a crash takes its rank's process down at the first element "
                    f"it reaches; leave it {unset if unset is not None else 'unset'}"
                )  # fmt: skip
        # The trial ends at the first crash: a later step, or a broken unit's next strike,
        # could never come.
        if fault.persistence != "transient":
            raise ConfigError(
                f"{key}.persistence", f"{fault.persistence}: a crash ends the trial at its first "
                "strike, so it never strikes again; allowed: transient"
            )  # fmt: skip
        steps = sorted({e["step"] for e in fault.schedule} or set(fault.steps))
        if len(steps) > 1:
            name = "schedule" if fault.schedule else "steps"
            raise ConfigError(
                f"{key}.{name}", f"a crash ends the trial at its first step ({steps[0]}), so "
                f"step{'s' * (len(steps) > 2)} {', '.join(map(str, steps[1:]))} could never "
                f"strike; allowed: one step"
            )  # fmt: skip
        if fault.scope == "reduction":
            # A broken reduction strikes every receiver of the sum: every rank would go down.
            raise ConfigError(
                f"{key}.scope", "a crash takes down the process of each rank in fault.ranks, not "
                "the sum every rank receives; allowed: rank"
            )  # fmt: skip

    def corrupt(self, flat: torch.Tensor, index: int, bit: int | None = None) -> None:
        action = self.fault.value
        if action == "raise":
            raise InjectedCrash("injected crash")
        if action == "exit":
            os._exit(0)
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:
            time.sleep(3600)


MODEL = Crash
