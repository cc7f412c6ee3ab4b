"""One rank's plug-ins, assembled: the injector for its fault, its checks, the bus that calls
them in the step's order, the comm hook's state that feeds the bus each bucket, and the forward
hooks on the model. A campaign's trainer and the guard in a user's loop both assemble a rank
here, so a check sees the same hooks, in the same order, wherever it runs.

The caller owns DDP: the trainer wraps the model with the harness's fixed reduction layout
(harness/runtime/comm.py, `harness_ddp`), the guard registers `comm.slotted_hook` on the user's
own DDP with a slot that holds this state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

import detectors
from harness.config.schema import FaultConfig
from harness.core.bus import PluginBus
from harness.core.checks import CheckConfig
from harness.core.matmuls import ForwardModules
from harness.core.plugins import Detector, DetectorContext, EventLog
from harness.runtime.comm import HookState
from injectors import injector


@dataclass
class RankPlugins:
    checks: list[Detector]
    bus: PluginBus
    state: HookState
    hooks: list[RemovableHandle]  # the forward hooks on the model


def assemble(
    model: nn.Module,
    ctx: DetectorContext,
    log: EventLog,
    checks: dict[str, CheckConfig],
    fault: FaultConfig | None = None,
    seed: int = 0,
    hardware: tuple[int, ...] | None = None,
    transparent: bool = False,
    inner: tuple[Any, Callable] | None = None,
    forward: ForwardModules | None = None,
    keep: Callable[[], None] | None = None,
) -> RankPlugins:
    """`fault` (None: none) strikes as planned for `seed` on the world ranks `hardware` (None:
    a user's loop, where no fault may name a spare); `transparent` and `inner` go to the comm
    hook (the guard: the user's reduction stays the user's); `forward`, what the workload's
    forward runs, narrows the modules a fault draws its target from (injectors/sites.py); `keep`
    makes the rank's strikes durable before a fault takes it down
    (harness/runtime/last_words.py)."""
    info = ctx.info
    plugins = [] if fault is None else injector.build(
        fault, seed, info, log, model, hardware, ctx.data, forward, keep
    )  # fmt: skip
    built = detectors.build(checks, ctx, log)
    bus = PluginBus(plugins + built, log.verdicts, info.device, log.stopwatch)
    state = HookState(bus, model, info.world_size, transparent=transparent, inner=inner)
    ctx.forward_hooks = lambda module: bus.install_forward_hooks(module, lambda: state.step)
    return RankPlugins(built, bus, state, ctx.forward_hooks(model))
