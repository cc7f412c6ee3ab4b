"""The detectors in your own DDP training loop, in a few lines.

    from harness.guard import Guard, SDCAlarm

    guard = Guard(ddp_model, detectors=["nan_inf", "replay", "weight_consensus"], mode="act",
                  replay_fn=loss_of, checkpoints="ckpt/")
    for step, batch in enumerate(loader):
        guard.audit_batch(batch)                      # before the forward: what replay ships
        loss = guard.loss(loss_of(ddp_model, batch))  # checks see the loss; use what it returns
        loss.backward()                               # the comm hook checks around the allreduce
        guard.before_step()                           # act mode raises SDCAlarm here
        optimizer.step()
        guard.after_step(optimizer)                   # checks on the updated weights
        if step % 100 == 99:
            guard.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()})

The guard reduces gradients exactly as DDP's default allreduce does, so a clean loop with the
guard attached trains bit-identically to the same loop without it (checks that ride on the
allreduce then pay for a small collective of their own). A comm hook you already have is
wrapped, not replaced: `Guard(ddp, comm_hook=(state, hook))`; the sketch verifies torch's own
linear hooks (harness/runtime/comm.py, `LINEAR_HOOKS`) and refuses any other. `inject={...}` (the
keys of `fault.*`) rehearses a fault in your loop: which check fires, when, naming which rank.

Replay ships the batch each rank trained on, with torch's random state before its forward, to the
rank one node back, which recomputes it with `replay_fn(model, batch) -> loss` on its own replica
under that state (so dropout draws the same masks; harness/runtime/batch_exchange.py). Under
gradient accumulation call `audit_batch` and `loss` for every micro-batch (the ones in
`ddp.no_sync()` too) and backpropagate `loss / K`; replay recomputes all K. A forward that does
not reproduce even so (a non-deterministic op) is reported as a warning, "not deterministic"
(`guard.warnings`), not as an alarm against a rank.

Recovery (act mode, `checkpoints=FOLDER`): an alarm writes FOLDER/quarantine.json (suspect
machines, ranks, step, first suspect step, detector, evidence, exit code), sets aside the
checkpoints of the suspect interval (renamed `*.pt.suspect`), and `save` refuses from then on.
The loop ends with `sys.exit(alarm.exit_code)`: EXIT_SUSPECT_HARDWARE (86) when the alarm names
machines (restart without them), EXIT_UNATTRIBUTED (87) when it names none or all of them. On
restart, `Guard.restore_point(FOLDER)` gives the newest checkpoint the checks approved before
the suspect interval (harness/campaign/recovery.py), and `Guard(..., start_step=step + 1)` resumes
the count.

Node identity: ranks_per_node from the argument, else SDC_RANKS_PER_NODE, else torchrun's
LOCAL_WORLD_SIZE; a machine name from SDC_NODE_NAME (else the host name; `{node}` in it is
replaced by the node index, which simulates nodes on one host for a rehearsal), so an alarm
names machines, not only rank numbers.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import detectors as registry
from harness.campaign import recovery
from harness.config.faults import fault_config
from harness.config.load import detector_configs
from harness.config.schema import FaultConfig, TopologyConfig
from harness.core.checks import CheckConfig
from harness.core.events import Alert, CheckWarning, Inject, of
from harness.core.phases import PHASE_ORDER
from harness.core.plugins import DetectorContext, EventLog, RankInfo
from harness.core.values import choice
from harness.runtime import checkpoint, comm
from harness.runtime.assembly import assemble
from harness.runtime.batch_exchange import ShippedBatches
from harness.runtime.workloads import WorkloadConfig

EXIT_SUSPECT_HARDWARE = 86
EXIT_UNATTRIBUTED = 87
MEANING = {
    EXIT_SUSPECT_HARDWARE: "suspect hardware: restart without the suspect machines",
    EXIT_UNATTRIBUTED: "could not attribute: restart from the restore point, on any machines",
}
QUARANTINE = "quarantine.json"


class SDCAlarm(RuntimeError):
    """A check in act mode found silent data corruption; every rank raises it together."""

    def __init__(self, alerts: list[Alert], machines: list[str], first_suspect: int):
        first = alerts[0]
        self.detector = first.detector
        self.step = first.step
        self.phase = first.phase
        # One check's alerts at one step, from every rank: a wrong reduction alarms everyone.
        self.suspect_ranks = sorted({r for a in alerts for r in a.suspect_ranks})
        self.suspect_nodes = sorted({n for a in alerts for n in a.suspect_nodes})
        self.suspect_machines = sorted({machines[r] for r in self.suspect_ranks})
        self.first_suspect_step = first_suspect
        self.evidence = first.evidence
        attributed = 0 < len(self.suspect_machines) < len(set(machines))
        self.exit_code = EXIT_SUSPECT_HARDWARE if attributed else EXIT_UNATTRIBUTED
        super().__init__(
            f"{self.detector} at step {self.step}: suspect ranks {self.suspect_ranks} "
            f"(nodes {self.suspect_nodes}, machines {self.suspect_machines}); "
            f"{MEANING[self.exit_code]}"
        )

    def record(self) -> dict[str, Any]:
        """What quarantine.json holds."""
        return {
            "detector": self.detector, "step": self.step, "phase": self.phase,
            "first_suspect_step": self.first_suspect_step, "suspect_ranks": self.suspect_ranks,
            "suspect_nodes": self.suspect_nodes, "suspect_machines": self.suspect_machines,
            "evidence": self.evidence, "exit_code": self.exit_code,
            "meaning": MEANING[self.exit_code],
        }  # fmt: skip


class Guard:
    def __init__(
        self,
        ddp: DDP,
        detectors: Iterable[str] | dict[str, dict[str, Any]] = ("nan_inf",),
        mode: str = "observe",
        inject: dict[str, Any] | None = None,
        comm_hook: tuple[Any, Callable] | None = None,
        seed: int = 0,
        replay_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        ranks_per_node: int | None = None,
        checkpoints: str | Path | None = None,
        start_step: int = 0,
    ):
        rank, world = dist.get_rank(), dist.get_world_size()
        per_node = ranks_per_node or int(
            os.environ.get("SDC_RANKS_PER_NODE") or os.environ.get("LOCAL_WORLD_SIZE", world)
        )
        self.info = RankInfo(rank, world, per_node, str(next(ddp.module.parameters()).device))
        self.model = ddp.module
        self.log = EventLog(rank, self.info.node)
        self.machines: list[str] = [""] * world
        name = os.environ.get("SDC_NODE_NAME", socket.gethostname())
        dist.all_gather_object(self.machines, name.replace("{node}", str(self.info.node)))
        self.mode = mode
        self.folder = Path(checkpoints) if checkpoints is not None else None
        self.alarm: SDCAlarm | None = None
        self.checkpointed: set[int] = set()
        topology = _topology(world, per_node)
        self.checks = _checks(detectors, mode, topology, replay_fn, comm_hook)
        recomputing = any(registry.detector_class(n).recomputes_batches for n in self.checks)
        device = torch.device(self.info.device)
        self.shipped = ShippedBatches(replay_fn, rank, device) if recomputing else None
        ctx = DetectorContext(self.info, self.model, None, 0, tuple((r,) for r in range(world)),
                              replay_data=self.shipped)  # fmt: skip
        fault = None if inject is None else _fault(inject, self.model, topology)
        rank = assemble(self.model, ctx, self.log, self.checks, fault, seed,
                        transparent=True, inner=comm_hook)  # fmt: skip
        self.bus, self.state = rank.bus, rank.state
        self.state.step = start_step
        self._loss_step = -1
        self._seen = 0  # events already considered for an alarm
        ddp.register_comm_hook(self.state, comm.comm_hook)

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def alerts(self) -> list[Alert]:
        """Every alert this rank raised, observe or act (harness.core.events.Alert)."""
        self.bus.resolve()
        return of(Alert, self.log.events)

    @property
    def warnings(self) -> list[CheckWarning]:
        """What a check could not judge on this rank (replay: "not deterministic")."""
        self.bus.resolve()
        return of(CheckWarning, self.log.events)

    @property
    def injections(self) -> list[Inject]:
        return of(Inject, self.log.events)

    def audit_batch(self, batch: Any) -> None:
        """The micro-batch this rank is about to train on (tensors in plain containers), for
        replay to ship on audit steps; call it for every micro-batch, just before its forward
        (the random state it keeps is the forward's)."""
        if self.shipped is not None:
            self.shipped.keep(self.state.step, batch)

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Pass the loss through the checks (and a rehearsed loss fault); use what it returns."""
        self._loss_step = self.state.step
        return self.bus.loss(self.state.step, loss)

    def before_step(self) -> None:
        """After backward, before optimizer.step(): raises SDCAlarm in act mode."""
        if self.shipped is not None and self._loss_step != self.state.step:
            raise RuntimeError("replay: pass every step's loss through guard.loss(loss)")
        self.bus.audit(self.state.step)
        self._raise_if_alarmed()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After optimizer.step(): checks on the updated weights; then the next step begins."""
        self.bus.optimizer_state(self.state.step, optimizer)
        self.bus.update(self.state.step, self.model)
        self._raise_if_alarmed()
        self.state.step += 1

    def before_checkpoint(self) -> bool:
        """Run the checks that gate a checkpoint of the step just finished (weight consensus):
        whether they approve; act mode raises SDCAlarm instead of disapproving."""
        step = self.state.step - 1
        self.checkpointed.add(step)
        approved = bool(self.bus.verdicts.read(self.bus.checkpoint_approved(step, self.model)))
        self._raise_if_alarmed()
        return approved

    def save(self, state: dict[str, Any]) -> Path | None:
        """Checkpoint the step just finished into `checkpoints` (rank 0 writes, atomically with
        its checksum, harness/runtime/checkpoint.py) once the checks approve; the path, or None
        where nothing was written. Refuses after an alarm."""
        if self.folder is None:
            raise ValueError("Guard.save needs Guard(..., checkpoints=FOLDER)")
        if self.alarm is not None:
            raise RuntimeError(f"refusing to save state after an alarm: {self.alarm}")
        if not self.before_checkpoint() or self.info.rank != 0:
            return None
        step = self.state.step - 1
        path = checkpoint.step_path(self.folder, step)
        checkpoint.save(path, {"step": step, **state})
        return path

    @staticmethod
    def restore_point(folder: str | Path) -> tuple[int, str]:
        """The newest checkpoint in `folder` that the checks approved and whose checksum
        verifies, before any suspect interval (an alarm set those aside): (step, path), or
        (-1, "") to start from the initial weights. Load it with harness.runtime.checkpoint.load."""
        return recovery.restore_point(Path(folder), 2**62, [])

    def _raise_if_alarmed(self) -> None:
        """Every rank learns whether any rank alarmed (one small collective, act mode only).
        The checks' verdicts are read here in either mode: a DDP bucket they point into is
        reused by the next step."""
        self.bus.resolve()
        if self.mode != "act":
            return
        fresh, self._seen = self.log.events[self._seen :], len(self.log.events)
        mine = of(Alert, fresh) if self.bus.stopper() else []
        flag = torch.tensor([1.0 if mine else 0.0], device=self.info.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not self.bus.verdicts.read(flag)[0]:
            return
        gathered: list[list[Alert]] = [[] for _ in range(self.info.world_size)]
        dist.all_gather_object(gathered, mine)
        found = sorted(
            (a for alerts in gathered for a in alerts),
            key=lambda a: (a.step, PHASE_ORDER[a.phase], a.time),
        )
        first = found[0]
        key = (first.step, first.detector)
        same = [a for a in found if (a.step, a.detector) == key]
        since = registry.detector_class(first.detector).first_suspect_step(
            self.checks[first.detector], first.step, self.checkpointed.__contains__
        )
        self.alarm = SDCAlarm(same, self.machines, since)
        if self.folder is not None and self.info.rank == 0:
            _quarantine(self.folder, self.alarm)
        raise self.alarm


def _quarantine(folder: Path, alarm: SDCAlarm) -> None:
    """quarantine.json for the scheduler, and the suspect interval's checkpoints set aside."""
    folder.mkdir(parents=True, exist_ok=True)
    set_aside = []
    for step, path in checkpoint.saved(folder):
        if step >= alarm.first_suspect_step:
            path.rename(path.with_name(path.name + ".suspect"))
            set_aside.append(path.name)
    record = dict(alarm.record(), set_aside=set_aside)
    tmp = folder / f".{QUARANTINE}.tmp"
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, folder / QUARANTINE)


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
    chosen: Iterable[str] | dict[str, dict[str, Any]],
    mode: str,
    topology: TopologyConfig,
    replay_fn: Callable | None,
    comm_hook: tuple[Any, Callable] | None,
) -> dict[str, CheckConfig]:
    params = dict(chosen) if isinstance(chosen, dict) else {name: {} for name in chosen}
    for name in params:
        choice("detectors", name, registry.available())
    recomputing = [n for n in params if registry.detector_class(n).recomputes_batches]
    if recomputing and replay_fn is None:
        raise ValueError(
            f"detectors: '{recomputing[0]}' needs Guard(..., replay_fn=fn), fn(model, batch) -> "
            "loss, and guard.audit_batch(batch) every step"
        )
    replicated = [n for n in registry.available() if "ddp" in registry.detector_class(n).parallel]
    sharded = [n for n in params if n not in replicated]
    if sharded:
        raise ValueError(
            f"detectors: '{sharded[0]}' checks sharded training's collectives, which a DDP loop "
            f"does not run; allowed: {', '.join(replicated)}"
        )
    verifying = [n for n in params if registry.detector_class(n).verifies_reduction]
    if verifying and comm_hook is not None and not _linear(comm_hook):
        others = [n for n in replicated if not registry.detector_class(n).verifies_reduction]
        raise ValueError(
            f"detectors: '{verifying[0]}' cannot verify the comm hook "
            f"{getattr(comm_hook[1], '__name__', comm_hook[1])}: it checks a reduction that sums "
            f"every rank's bucket over the whole world (torch's "
            f"{', '.join(h.__name__ for h in comm.LINEAR_HOOKS)}); with this hook use "
            f"{', '.join(others)}"
        )
    # A campaign's validation, so that a setting fails the same way here (ConfigError, a
    # ValueError) as under sdc-bench.
    return detector_configs({n: {**p, "mode": mode} for n, p in params.items()}, topology)


def _linear(comm_hook: tuple[Any, Callable]) -> bool:
    """A hook the sketch can verify: one of torch's linear hooks, reducing over the world."""
    group, hook = comm_hook
    if hook not in comm.LINEAR_HOOKS:
        return False
    return group is None or dist.get_world_size(group) == dist.get_world_size()


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
