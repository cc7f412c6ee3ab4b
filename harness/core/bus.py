"""The plug-in bus: one object per rank that calls every plug-in's hook at each hook point of the
step (harness/core/plugins.py states the hooks), injectors before detectors, so a check sees
the corruption injected at its own site; it installs the forward hooks (the products' watch,
harness/core/matmuls.py, and each watched module's hooks), times each plug-in where a stopwatch
is kept, and reads the checks' verdicts in one read when the trainer asks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from harness.core.matmuls import MatmulCall, Watch
from harness.core.plugins import Bucket, Detector, Plugin
from harness.core.stopwatch import Stopwatch
from harness.core.verdicts import Verdicts


class PluginBus:
    """Calls every plug-in's hook at one point, injectors first; reads the checks' verdicts,
    which they keep on `device`, when the trainer asks (`stop_flags`, `resolve`)."""

    def __init__(
        self,
        plugins: list[Plugin],
        verdicts: Verdicts | None = None,
        device: str | torch.device = "cpu",
        stopwatch: Stopwatch | None = None,
    ):
        self.plugins = plugins
        self.checks = [p for p in plugins if isinstance(p, Detector)]
        self.verdicts = verdicts if verdicts is not None else Verdicts()
        self.device = torch.device(device)
        self.stopwatch = stopwatch
        # The buckets reduced in the step under way, and the first step that reduced one twice
        # (a loop that reduces every micro-batch of an accumulation: a step's gradient is then
        # no sum a check recomputing the step knows).
        self.reduced: tuple[int, set[int]] = (-1, set())
        self.reduced_twice: int | None = None
        # The matrix products' watch, where a plug-in watches them (install_forward_hooks).
        self.watch: Watch | None = None

    def charged(self, part: str) -> AbstractContextManager:
        """The harness's own work at a site, timed as `part` where the bus keeps a stopwatch."""
        return nullcontext() if self.stopwatch is None else self.stopwatch.charged(part)

    def _each(self, plugins: list[Plugin] | None = None) -> Iterable[Plugin]:
        """The plug-ins in order; with a stopwatch, the time each spends in its hook charged to
        it (an injector's to "injection"). Without one, the list itself: the campaigns' step
        pays for no generator."""
        plugins = self.plugins if plugins is None else plugins
        return plugins if self.stopwatch is None else self._timed(plugins)

    def _timed(self, plugins: list[Plugin]) -> Iterator[Plugin]:
        assert self.stopwatch is not None
        for plugin in plugins:
            part = plugin.name if isinstance(plugin, Detector) else "injection"
            with self.stopwatch.charged(part):
                yield plugin

    @property
    def host_reads(self) -> int:
        """Device-to-host reads of the checks' results so far."""
        return self.verdicts.reads

    def stop_flags(self) -> torch.Tensor:
        """[some check stops on evidence before the collective, every stopping check alarmed
        on the received sum alone], as floats on the device, unread: pending verdicts and the
        alerts already raised together."""
        stoppers = [p for p in self.checks if p.stop_requested]
        raised = torch.tensor(
            [any(not p.reduction_only for p in stoppers), any(p.reduction_only for p in stoppers)],
            device=self.device,
        )
        pre, post = raised[0], raised[1]
        pending = self.verdicts.stop_flags()
        if pending is not None:
            pre, post = pre | pending[0], post | pending[1]
        return torch.stack([pre, post & ~pre]).float()

    def resolve(self, extra: torch.Tensor | None = None) -> list[float]:
        """Read every pending verdict, with `extra`, in one read; raise their alerts."""
        return self.verdicts.resolve(extra)

    def install_forward_hooks(
        self, model: nn.Module, step_of: Callable[[], int]
    ) -> list[RemovableHandle]:
        """The plug-ins' forward hooks on `model` (the matrix products' watch, each watched
        module's hooks); their handles."""
        handles: list[RemovableHandle] = []
        multipliers = [p for p in self.plugins if p.watches_matmuls()]
        if multipliers:
            # Operands: checks wrap first, so that an injector's wrap is nearest the product and
            # a gradient it corrupts in backward reaches the check's wrap corrupted.
            first = [p for p in multipliers if isinstance(p, Detector)]
            operands = first + [p for p in multipliers if p not in first]

            def multiply(call: MatmulCall) -> torch.Tensor:
                step = step_of()
                for plugin in self._each(operands):
                    plugin.on_matmul_operands(step, call)
                output = call.compute()
                for plugin in self._each(multipliers):
                    replaced = plugin.on_matmul_output(step, call, output)
                    if replaced is not None:
                        output = replaced
                call.accumulator = None  # a float32 copy of the product: not kept to backward
                return output

            def expands(stack: tuple[str, ...]) -> bool:
                return any(p.expands_attention(step_of(), stack) for p in multipliers)

            self.watch = Watch(multiply, expands)
            handles += self.watch.install(model)
        for name, module in model.named_modules():
            watchers = [p for p in self.plugins if name and p.watches_module(name)]
            if not watchers:
                continue

            def hook(_mod, _inp, output, name=name, watchers=watchers):
                replaced = None
                for plugin in self._each(watchers):
                    result = plugin.on_forward(step_of(), name, output)
                    if result is not None:
                        output = replaced = result
                return replaced

            def pre_hook(_mod, _inp, name=name, watchers=watchers):
                for plugin in self._each(watchers):
                    plugin.on_forward_pre(step_of(), name)

            handles.append(module.register_forward_pre_hook(pre_hook))
            handles.append(module.register_forward_hook(hook))
        return handles

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        for plugin in self._each():
            replaced = plugin.on_loss(step, loss)
            if replaced is not None:
                loss = replaced
        return loss

    def local_grad(self, step: int, bucket: Bucket) -> None:
        at, seen = self.reduced
        if at != step:
            self.reduced = (step, {bucket.index})
        elif bucket.index in seen:
            self.reduced_twice = step if self.reduced_twice is None else self.reduced_twice
        else:
            seen.add(bucket.index)
        for plugin in self._each():
            plugin.on_local_grad(step, bucket)

    def contribution(self, step: int, index: int, parts: list[torch.Tensor]) -> None:
        for plugin in self._each():
            plugin.on_contribution(step, index, parts)

    def reduced_grad(self, step: int, bucket: Bucket) -> None:
        for plugin in self._each():
            plugin.on_reduced_grad(step, bucket)

    def gathered(self, step: int, bucket: Bucket) -> None:
        for plugin in self._each():
            plugin.on_gathered(step, bucket)

    def group_contribution(
        self, step: int, index: int, parts: list[torch.Tensor], members: tuple[int, ...]
    ) -> None:
        for plugin in self._each():
            plugin.on_group_contribution(step, index, parts, members)

    def group_reduced(self, step: int, bucket: Bucket, members: tuple[int, ...]) -> None:
        for plugin in self._each():
            plugin.on_group_reduced(step, bucket, members)

    def riders(self, step: int, bucket: Bucket) -> list[tuple[int, torch.Tensor]]:
        out = []
        for plugin in self._each():
            payload = plugin.rider(step, bucket)
            if payload is not None:
                out.append((id(plugin), payload))
        return out

    def audit(self, step: int) -> None:
        for plugin in self._each():
            plugin.on_audit(step)

    def optimizer_state(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        for plugin in self._each():
            plugin.on_optimizer_state(step, optimizer)

    def update(self, step: int, model: nn.Module) -> None:
        for plugin in self._each():
            plugin.on_update(step, model)

    def checkpoint_approved(self, step: int, model: nn.Module) -> torch.Tensor:
        """Whether every plug-in approves: a 0-d bool tensor on the device, unread (a check
        may answer with one, or with a bool)."""
        # Every plug-in is asked, so each check runs even after another has refused.
        verdicts = [plugin.approves_checkpoint(step, model) for plugin in self._each()]
        approved = torch.ones((), dtype=torch.bool, device=self.device)
        for verdict in verdicts:
            approved = approved & torch.as_tensor(verdict, device=self.device).reshape(())
        return approved

    def stopper(self) -> Detector | None:
        return next((p for p in self.checks if p.stop_requested), None)

    def clear_stops(self) -> None:
        for check in self.checks:
            check.stop_requested, check.reduction_only = False, True
