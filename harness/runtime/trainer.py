"""One rank's training run for one trial: the step in docs/design.md's fixed order, with every
site a hook point. It knows the plug-in hooks, never a concrete injector or detector.

    1. forward (activation)  -> loss (loss)
    2. backward -> local gradients, bucket by bucket (grad)         \
    3. checks on local gradients                                     | one DDP comm hook, or
    4. allreduce -> averaged gradients (allreduce)                   | FSDP2's reduce-scatter
    5. checks on averaged gradients                                 /  when sharded
    6. audit (replay)
    7. the recipe's clipping and learning rate, the optimizer step (optimizer state), then the
       update (weight)
    8-9. consensus, then a checkpoint only if every check approves
"""

import hashlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.hooks import RemovableHandle

from harness.config.schema import RunConfig, TrialSpec
from harness.core import inflight
from harness.core.bus import PluginBus
from harness.core.dtensors import local, whole
from harness.core.events import Checkpoint, HostReads, Inject, Retry, Stop
from harness.core.plugins import Detector, DetectorContext, EventLog, RankInfo
from harness.results.schema import RankResult
from harness.runtime import checkpoint, devices, last_words, numerics, snapshots
from harness.runtime.assembly import assemble
from harness.runtime.comm import HookState, harness_ddp, retry_reduction
from harness.runtime.locate import faulty_node_ranks
from harness.runtime.workloads import Workload

if TYPE_CHECKING:
    from harness.runtime.shard_sites import ShardedBuckets


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over every parameter's bytes: equal digests mean bit-identical weights. A
    sharded parameter is gathered whole first (every rank calls this together): under HSDP
    each rank digests its replica group's weights."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(whole(p.detach()).contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


class TrialStopped(Exception):
    """A check in act mode stopped training; every rank raises it at the same point."""


@dataclass
class StopPoint:
    """Where the ranks agree to stop a step, before its optimizer step and at a checkpoint.

    With a check in act mode (`acting`), one small collective: a rank-local verdict (say, a
    sketch mismatch on one receiver) must stop every rank. The decision, this rank's pending
    verdicts and `extra` come back in one read (`extra`'s values, summed over the world, are
    returned; without a check in act mode the verdicts and `extra` are read all the same, and
    `extra` summed in a collective of its own). Summed, since each rank's checks approve a
    checkpoint on their own (`Plugin.approves_checkpoint`): every rank must write it or none,
    or FSDP's ranks enter the sharded save apart.

    With recovery on, the hook `state` keeps the step's local contributions: when every rank
    alarmed on the received sum alone, the reduction itself was wrong and names no node; it is
    re-run once from the kept local gradients (no rollback, no quarantine). If the repeat alarms
    too, sub-group reductions locate the node that breaks it (harness/runtime/locate.py) before
    the step stops."""

    bus: PluginBus
    acting: bool
    result: RankResult
    state: HookState
    log: EventLog
    info: RankInfo

    def reached(
        self, step: int, extra: torch.Tensor | None = None, may_retry: bool = False
    ) -> list[float]:
        """Raise TrialStopped on every rank when a check stops the step; else `extra`'s values.
        `may_retry`: before the optimizer step, where the reduction can still be re-run."""
        if not self.acting:
            if extra is not None:
                extra = extra.reshape(-1).float()
                dist.all_reduce(extra)
                inflight.hold(extra)
            return self.bus.resolve(extra)
        stop, reduction, values = self._agreed(extra)
        if may_retry and self._reduction_alone(stop, reduction):
            self.bus.clear_stops()
            self.log.emit(Retry(step=step, reason="every rank alarmed on the received sum"))
            retry_reduction(self.state, step)
            stop, reduction, values = self._agreed(extra)
            if self._reduction_alone(stop, reduction):
                faulty_node_ranks(self.state, step, self.info, self.log)
        if stop + reduction:
            stopper = self.bus.stopper()
            self.result.stopped_step = step
            self.result.stopped_by = stopper.name if stopper else "peer"
            raise TrialStopped
        return values

    def _agreed(self, extra: torch.Tensor | None) -> tuple[float, float, list[float]]:
        """[ranks stopping on their own evidence, ranks alarmed on the received sum alone] over
        the world, and `extra`'s values summed over it, in one collective and one read."""
        flags = self.bus.stop_flags()
        both = flags if extra is None else torch.cat([flags, extra.reshape(-1).to(flags.dtype)])
        dist.all_reduce(both)
        inflight.hold(both)
        stop, reduction, *values = self.bus.resolve(both)
        return stop, reduction, values

    def _reduction_alone(self, stop: float, reduction: float) -> bool:
        """Every rank alarmed on the received sum alone, and the contributions were kept."""
        return bool(self.state.kept) and stop == 0 and reduction == dist.get_world_size()


def data_plan(spec: TrialSpec, info: RankInfo) -> tuple[tuple[int, ...], ...]:
    """Whose micro-batches each rank trains on: its own, unless a shrunk world took over the
    data of a quarantined node's ranks."""
    if spec.segment is not None:
        return spec.segment.data
    return tuple((r,) for r in range(info.world_size))


def run_trial(
    run: RunConfig,
    spec: TrialSpec,
    info: RankInfo,
    store: Path,
    beat: Callable[[], None] = lambda: None,
) -> RankResult:
    """Train one trial on this rank, from step 0 or from a recovery checkpoint; every rank of
    the world calls this together. `beat` tells the parent that the rank makes progress.
    Everything the model computes in it (forward, backward, replay's recomputation, the final
    evaluation) makes its 16-bit products as `topology.cpu_numerics` says."""
    with numerics.installed(run.topology.cpu_numerics, info.device):
        return _trained(run, spec, info, store, beat)


def _trained(
    run: RunConfig, spec: TrialSpec, info: RankInfo, store: Path, beat: Callable[[], None]
) -> RankResult:
    rank = _set_up(run, spec, info, store)
    losses: list[torch.Tensor] = []  # read once, when the trial ends
    try:
        for step in range(rank.first_step, rank.workload.cfg.steps):
            beat()
            losses.append(_step(rank, step, store))
    except TrialStopped:
        rank.log.emit(Stop(step=rank.result.stopped_step, detector=rank.result.stopped_by))
    return _finished(rank, losses)


@dataclass
class _Rank:
    """What one rank trains a trial with (`_set_up`)."""

    run: RunConfig
    spec: TrialSpec
    info: RankInfo
    workload: Workload
    model: nn.Module
    trained: nn.Module  # what the forward runs: DDP around `model`, or `model` sharded
    optimizer: torch.optim.Optimizer
    shards: "ShardedBuckets | None"
    log: EventLog
    ctx: DetectorContext
    bus: PluginBus
    built: list[Detector]
    state: HookState
    hooks: list[RemovableHandle]  # the plug-ins' forward hooks on the model
    acting: bool
    result: RankResult
    stop_point: StopPoint
    first_step: int


def _set_up(run: RunConfig, spec: TrialSpec, info: RankInfo, store: Path) -> _Rank:
    """The model (sharded, or in DDP with the harness's hook), its checks and fault assembled,
    the optimizer, and a recovery segment's checkpoint restored."""
    cfg = replace(run.workload, seed=spec.seed)
    workload = Workload(cfg, torch.device(info.device))
    model = workload.build_model()
    # Sharded before anything sees the parameters: the plug-ins and the optimizer hold shards.
    shards = _sharded(model, run, info, spec.hook) if run.topology.sharded else None
    log = EventLog(info.rank, info.node)
    hardware = spec.segment.hardware if spec.segment else tuple(range(info.world_size))
    # docs/design.md section 5: the golden run carries the same checks, observing only; its
    # snapshots hand their state to fast-forwarded trials.
    checks = run.checks(spec)
    if spec.golden:
        checks = {name: config.in_mode("observe") for name, config in checks.items()}
    ctx = DetectorContext(info, model, workload, cfg.steps, data_plan(spec, info))
    if shards is not None:
        from harness.runtime.replica import unsharded_copy  # sharded runs only: see `_sharded`

        ctx.unsharded_copy = partial(unsharded_copy, model)
    keep = partial(_keep_strikes, last_words.path(store, spec.trial_id, info.rank), log)
    fault = spec.segment.unmet(spec.fault) if spec.segment else spec.fault
    rank = assemble(
        model, ctx, log, checks, fault, spec.seed, hardware, forward=run.forward, keep=keep
    )
    if shards is not None:
        shards.bind(rank.bus)
    acting = any(config.acts for config in checks.values())
    optimizer = workload.build_optimizer(model)
    first_step = 0
    if spec.segment is not None:
        first_step = spec.segment.start_step
        if spec.segment.checkpoint:
            _restored(Path(spec.segment.checkpoint), model, optimizer, rank.checks, info)
    rank.state.keep_contributions = run.recovery.enabled and acting and spec.hook
    trained = _replicated(model, rank.state, spec.hook) if shards is None else model
    result = RankResult(spec.trial_id, info.rank, log.events)
    return _Rank(
        run=run, spec=spec, info=info, workload=workload, model=model, trained=trained,
        optimizer=optimizer, shards=shards, log=log, ctx=ctx, bus=rank.bus, built=rank.checks,
        state=rank.state, hooks=rank.hooks, acting=acting, result=result, first_step=first_step,
        stop_point=StopPoint(rank.bus, acting, result, rank.state, log, info),
    )  # fmt: skip


def _keep_strikes(to: Path, log: EventLog) -> None:
    """The rank's strikes so far, for the row of the trial it is about to crash."""
    last_words.keep(to, [e for e in log.events if isinstance(e, Inject)])


def _restored(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    built: list[Detector],
    info: RankInfo,
) -> None:
    """A recovery segment starts from its checkpoint: weights, optimizer and checks' state."""
    if path.suffix == ".dcp":
        snapshots.restore_shards(model, optimizer, path)
    else:
        snapshots.restore(model, optimizer, checkpoint.load(path, torch.device(info.device)))
    snapshots.load_checks(path, built, info)


def _step(rank: _Rank, step: int, store: Path) -> torch.Tensor:
    """One step in docs/design.md's order; its loss, the mean over its micro-batches, unread."""
    bus, workload, model, optimizer = rank.bus, rank.workload, rank.model, rank.optimizer
    device = torch.device(rank.info.device)
    rank.state.step = step
    if rank.shards is not None:
        rank.shards.step = step
    reads = bus.host_reads
    devices.synchronize(device)
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    step_loss = torch.zeros((), dtype=torch.float64, device=device)
    batches = rank.ctx.batches(rank.info.rank)
    for i, (source, micro) in enumerate(batches):
        last = i == len(batches) - 1
        # The micro-batch's own random state: a peer replaying it draws the same.
        with _synced(rank.trained, last), workload.forward_rng(step, source, micro):
            loss = workload.loss(rank.trained, workload.batch(step, source, micro))
            loss = bus.loss(step, loss)
            (loss / rank.ctx.divisor).backward()
        step_loss += loss.detach().double() / len(batches)
    bus.audit(step)
    if rank.acting:
        rank.stop_point.reached(step, may_retry=True)
    workload.prepare_update(model, optimizer, step)  # clipping, the step's learning rate
    optimizer.step()
    bus.optimizer_state(step, optimizer)
    bus.update(step, model)
    if rank.run.checkpoint.after(step):
        # Observe mode reads its verdicts here, with the checks' approval.
        approved = bus.checkpoint_approved(step, model)
        (approvals,) = rank.stop_point.reached(step, extra=approved)
        if approvals == rank.info.world_size:
            folder = store / rank.spec.trial_id
            sharded = rank.shards is not None
            _checkpoint(folder, step, model, optimizer, rank.info, rank.log, sharded)
    if step in rank.spec.snapshots:
        snapshot = snapshots.snapshot_path(store, rank.spec.seed, step)
        snapshots.save_snapshot(snapshot, model, optimizer, rank.built, rank.info)
    devices.synchronize(device)  # the clock times the step's work, not its queueing
    rank.result.step_times.append(time.perf_counter() - started)
    rank.result.host_reads.append(bus.host_reads - reads)
    return step_loss


def _finished(rank: _Rank, losses: list[torch.Tensor]) -> RankResult:
    """The trial's end on this rank: its losses read, the weights' digest and finiteness, the
    optimizer state's non-finite count, the final evaluation."""
    result, model, bus = rank.result, rank.model, rank.bus
    bus.resolve()
    result.losses = torch.stack(losses).tolist() if losses else []
    if result.host_reads:
        rank.log.emit(HostReads(most_in_a_step=max(result.host_reads), total=bus.host_reads))
    result.weights_digest = weights_digest(model)
    result.weights_finite = all(bool(torch.isfinite(local(p)).all()) for p in model.parameters())
    if rank.shards is not None:
        # A rank's own shards are all it holds; any rank's non-finite one makes the weights so.
        finite = torch.tensor([float(result.weights_finite)], device=rank.info.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        result.weights_finite = bool(finite.item())
    # This rank's optimizer state: under sharding, its own shard of it.
    result.optimizer_nonfinite = sum(
        int((~torch.isfinite(local(t))).sum())
        for state in rank.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.is_floating_point()
    )
    _detach(rank)
    result.final_loss = rank.workload.eval_loss(model)
    return result


def _detach(rank: _Rank) -> None:
    """The plug-ins off the model: the final evaluation measures the weights the trial left, so
    no fault strikes it (a broken unit is due at every forward from its step on) and no check
    reads it."""
    for handle in rank.hooks:
        handle.remove()
    if rank.shards is not None:
        rank.shards.bind(PluginBus([], device=rank.info.device))


def _sharded(model: nn.Module, run: RunConfig, info: RankInfo, sites: bool) -> "ShardedBuckets":
    """`model` sharded in place as `topology.parallel` says; with `sites` (every run but the
    plain-FSDP overhead baseline) the harness's sites on its collectives."""
    # Here, not at the top: FSDP2 and torch.distributed.checkpoint add 0.7 s to the import of
    # every command and rank process, and a replicated run needs neither.
    from harness.runtime import sharding
    from harness.runtime.shard_sites import ShardedBuckets

    topology = run.topology
    mesh = sharding.mesh(
        topology.parallel, info.world_size, topology.shard_size or 0, torch.device(info.device).type
    )
    shards = ShardedBuckets(topology.parallel == "hsdp", info.world_size)
    sharding.shard(model, mesh, shards.sites() if sites else sharding.ShardSites())
    shards.groups = len(sharding.groups(model))
    return shards


def _replicated(model: nn.Module, state: HookState, hook: bool) -> DDP:
    """DDP with the harness's comm hook, or plain (the overhead baseline)."""
    return harness_ddp(model, state) if hook else DDP(model)


def _synced(model: nn.Module, last: bool) -> AbstractContextManager:
    """Gradient accumulation: only the last micro-batch's backward reduces."""
    if isinstance(model, DDP):
        return nullcontext() if last else model.no_sync()
    model.set_requires_gradient_sync(last)
    return nullcontext()


def _checkpoint(
    folder: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    info: RankInfo,
    log: EventLog,
    sharded: bool,
) -> None:
    """Rank 0 writes a replica's state, as in DDP practice (the replicas are meant to be
    identical); sharded, every rank writes its own shards, as sharded jobs do
    (torch.distributed.checkpoint)."""
    path = checkpoint.step_path(folder, step)
    if sharded:
        from torch.distributed.checkpoint.state_dict import get_state_dict  # see `_sharded`

        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        path = checkpoint.save_shards(path, state, info.rank)
    elif info.rank == 0:
        state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        checkpoint.save(path, state)
    if info.rank == 0:
        log.emit(Checkpoint(step=step, path=str(path)))
