"""The detectors in your own DDP training loop, in a few lines.

    from harness.guard import Guard, SDCAlarm

    guard = Guard(ddp_model, detectors=["nan_inf", "weight_consensus"], mode="act")
    for step, (x, y) in enumerate(loader):
        loss = guard.loss(loss_fn(ddp_model(x), y))   # optional: lets checks see the loss
        loss.backward()                               # the comm hook checks around the allreduce
        guard.before_step()                           # act mode raises SDCAlarm here
        optimizer.step()
        guard.after_step(optimizer)                   # checks on the updated weights
        if step % 100 == 0:
            guard.before_checkpoint()                 # consensus; raises rather than save bad state
            torch.save(...)

The guard reduces gradients exactly as DDP's default allreduce does, so a clean loop with the
guard attached trains bit-identically to the same loop without it (checks that ride on the
allreduce then pay for a small collective of their own). A comm hook you already have is
wrapped, not replaced: `Guard(ddp, comm_hook=(state, hook))`. `inject={...}` (the keys of
`fault.*`) rehearses a fault in your loop: which check fires, when, naming which rank.

Node identity: ranks_per_node from torchrun's LOCAL_WORLD_SIZE, and a machine name from
SDC_NODE_NAME (else the host name), so an alarm names machines, not only rank numbers.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import detectors as registry
from harness import comm
from harness.config import FaultConfig, TopologyConfig, fault_config
from harness.plugins import DetectorContext, EventLog, PluginBus, RankInfo
from harness.workloads import WorkloadConfig
from injectors import injector

# Checks that need to regenerate another rank's data cannot run in an arbitrary loop.
NEEDS_WORKLOAD = {"replay"}


class SDCAlarm(RuntimeError):
    """A check in act mode found silent data corruption; every rank raises it together."""

    def __init__(self, alert: dict[str, Any], machines: list[str]):
        self.detector = alert["detector"]
        self.step = alert["step"]
        self.suspect_ranks = list(alert["suspect_ranks"])
        self.suspect_nodes = list(alert["suspect_nodes"])
        self.suspect_machines = sorted({machines[r] for r in self.suspect_ranks})
        self.evidence = alert["evidence"]
        super().__init__(
            f"{self.detector} at step {self.step}: suspect ranks {self.suspect_ranks} "
            f"(nodes {self.suspect_nodes}, machines {self.suspect_machines})"
        )


class Guard:
    def __init__(
        self,
        ddp: DDP,
        detectors: Iterable[str] | dict[str, dict[str, Any]] = ("nan_inf",),
        mode: str = "observe",
        inject: dict[str, Any] | None = None,
        comm_hook: tuple[Any, Callable] | None = None,
        seed: int = 0,
    ):
        rank, world = dist.get_rank(), dist.get_world_size()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.info = RankInfo(rank, world, per_node)
        self.model = ddp.module
        self.log = EventLog(rank, self.info.node)
        self.machines: list[str] = [""] * world
        dist.all_gather_object(self.machines, os.environ.get("SDC_NODE_NAME", socket.gethostname()))
        self.mode = mode
        topology = _topology(world, per_node)
        checks = _checks(detectors, mode, topology)
        ctx = DetectorContext(self.info, self.model, None, 0, tuple((r,) for r in range(world)))
        plugins = []
        if inject is not None:
            fault = _fault(inject, self.model, topology)
            plugins += injector.build(fault, seed, self.info, self.log, self.model, None, None)
        plugins += registry.build(checks, ctx, self.log)
        self.bus = PluginBus(plugins)
        self.state = comm.HookState(self.bus, self.model, world, transparent=True, inner=comm_hook)
        ddp.register_comm_hook(self.state, comm.comm_hook)
        self.bus.install_forward_hooks(self.model, lambda: self.state.step)

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def alerts(self) -> list[dict[str, Any]]:
        """Every alert this rank raised, observe or act."""
        return [e for e in self.log.events if e["kind"] == "alert"]

    @property
    def injections(self) -> list[dict[str, Any]]:
        return [e for e in self.log.events if e["kind"] == "inject"]

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Pass the loss through the checks (and a rehearsed loss fault); use what it returns."""
        return self.bus.loss(self.state.step, loss)

    def before_step(self) -> None:
        """After backward, before optimizer.step(): raises SDCAlarm in act mode."""
        self.bus.audit(self.state.step)
        self._raise_if_alarmed()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After optimizer.step(): checks on the updated weights; then the next step begins."""
        self.bus.optimizer_state(self.state.step, optimizer)
        self.bus.update(self.state.step, self.model)
        self._raise_if_alarmed()
        self.state.step += 1

    def before_checkpoint(self) -> None:
        """Run the checks that gate a checkpoint (weight consensus); raises SDCAlarm in act mode
        when one fails, observe mode records it."""
        self.bus.checkpoint_approved(self.state.step - 1, self.model)
        self._raise_if_alarmed()

    def _raise_if_alarmed(self) -> None:
        """Every rank learns whether any rank alarmed (one small collective, act mode only)."""
        if self.mode != "act":
            return
        mine = self.alerts[-1:] if self.bus.stopper() else []
        flag = torch.tensor([1.0 if mine else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        gathered: list[list[dict[str, Any]]] = [[] for _ in range(self.info.world_size)]
        dist.all_gather_object(gathered, mine)
        first = min((a for found in gathered for a in found), key=lambda a: (a["step"], a["time"]))
        raise SDCAlarm(first, self.machines)


def _topology(world: int, per_node: int) -> TopologyConfig:
    return TopologyConfig(
        nodes=max(1, world // per_node),
        ranks_per_node=per_node,
        spares=0,
        backend=dist.get_backend(),
        threads_per_rank=torch.get_num_threads(),
        collective_timeout_s=1800.0,
        trial_timeout_s=1800.0,
    )


def _checks(
    chosen: Iterable[str] | dict[str, dict[str, Any]], mode: str, topology: TopologyConfig
) -> dict[str, dict[str, Any]]:
    params = dict(chosen) if isinstance(chosen, dict) else {name: {} for name in chosen}
    for name in params:
        if name in NEEDS_WORKLOAD:
            raise ValueError(f"detectors: '{name}' needs the harness's workloads; not in a guard")
        if name not in registry.available():
            raise ValueError(f"detectors: '{name}' is unknown; allowed: {registry.available()}")
    return {
        name: registry.detector_class(name).validate(
            f"detectors.{name}", {**p, "mode": mode}, topology
        )
        for name, p in params.items()
    }


def _fault(inject: dict[str, Any], model: torch.nn.Module, topology: TopologyConfig) -> FaultConfig:
    """Validate a rehearsal fault like a campaign's (steps are not bounded: a loop has no end)."""
    unbounded = WorkloadConfig(
        name="custom", steps=2**31, dtype=_dtype_name(model), seed=0, micro_batches=1,
        micro_batch_size=1, lr=1.0,
    )  # fmt: skip
    return fault_config("inject", dict(inject), unbounded, topology)


def _dtype_name(model: torch.nn.Module) -> str:
    dtype = next(model.parameters()).dtype
    return {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype, "float32")
