"""Which checks a guard runs in a user's job: those named, each validated as a campaign validates
it, or `"all"`: every check that applies here. A check applies when it is derived for the
job's parallelism, verifies no reduction the job's comm hook makes unverifiable, gets the
`replay_fn` it recomputes with, and finds the world it needs (three nodes, three replica
groups). A named check that does not apply is refused in one line that says why and names the
ones allowed; `"all"` leaves it out and says why in `left_out`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import detectors as registry
from harness.config.fault_targets import check_target
from harness.config.faults import fault_config
from harness.config.schema import FaultConfig, TopologyConfig
from harness.core.checks import CheckConfig
from harness.core.values import choice, plain
from harness.errors import ConfigError
from harness.runtime import user_comm
from harness.runtime.workloads import WorkloadConfig
from injectors.sites import MODULE_SITES

ALL = "all"
Chosen = str | Iterable[str] | Mapping[str, Mapping[str, Any]]
# The dtypes a rehearsal strikes, as a campaign names them.
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Selection:
    checks: dict[str, CheckConfig]
    left_out: dict[str, str]  # under "all": each check that does not apply, and why


@dataclass(frozen=True)
class Job:
    """What decides whether a check applies."""

    topology: TopologyConfig
    mode: str
    replay_fn: Callable | None
    comm_hook: tuple[Any, Callable] | None
    start_step: int = 0  # a resumed loop's first step
    steps: int | None = None  # the loop's end (its last step + 1), where it is known


def select(chosen: Chosen, job: Job) -> Selection:
    """The checks `chosen` names for `job`: "all", a check's name, names, or a mapping from
    names to their settings."""
    names = named(chosen, job.mode)
    params = plain(chosen) if isinstance(chosen, Mapping) else {name: {} for name in names}
    checks, refused = {}, {}
    for name, p in params.items():
        try:
            checks[name] = _configured(name, dict(p or {}), job)
        except _DoesNotApply as why:
            refused[name] = str(why)
    if chosen != ALL and refused:
        why = next(iter(refused.values()))
        raise ValueError(f"detectors: {why}; allowed here: {', '.join(applicable(job))}")
    return Selection(checks, refused)


def named(chosen: Chosen, mode: str) -> list[str]:
    """The checks `chosen` names ("all": every registered one) and the mode, validated with no
    job at hand: all a callback can refuse where it is written, before any process group."""
    choice("mode", mode, ("observe", "act"))
    if isinstance(chosen, str) and chosen != ALL:
        chosen = [chosen]
    if not isinstance(chosen, Iterable):
        raise ConfigError(
            "detectors", f"{chosen!r:.40} names no check; allowed: 'all', a check's name, names, "
            "or a mapping of names to their settings"
        )  # fmt: skip
    names = registry.available() if chosen == ALL else list(chosen)
    for name in names:
        choice("detectors", name, registry.available())
    for name, p in plain(chosen).items() if isinstance(chosen, Mapping) else ():
        if p is not None and not isinstance(p, Mapping):
            raise ConfigError(
                f"detectors.{name}", f"{p!r:.40} is not a check's settings: a mapping of its "
                "keys to values ({} for its defaults)"
            )  # fmt: skip
        # Its own keys and values, which need no world (the world's are the job's).
        registry.detector_class(name).Config.parse(f"detectors.{name}", {**(p or {}), "mode": mode})
    return names


def applicable(job: Job) -> list[str]:
    """Every check that applies to `job` at its defaults."""
    found = []
    for name in registry.available():
        try:
            _configured(name, {}, job)
        except _DoesNotApply:
            continue
        found.append(name)
    return found


class _DoesNotApply(Exception):
    pass


def _configured(name: str, params: dict[str, Any], job: Job) -> CheckConfig:
    """`name`'s settings for `job` (a ConfigError for a bad setting); _DoesNotApply when the
    check cannot run in it."""
    check = registry.detector_class(name)
    parallel = job.topology.parallel
    if parallel not in check.parallel:
        raise _DoesNotApply(
            f"'{name}' is derived for {' and '.join(check.parallel)} training, not a {parallel} "
            "loop"
        )
    if check.verifies_reduction and job.comm_hook is not None and not _linear(job.comm_hook):
        hook = getattr(job.comm_hook[1], "__name__", job.comm_hook[1])
        linear = ", ".join(h.__name__ for h in user_comm.LINEAR_HOOKS)
        raise _DoesNotApply(
            f"'{name}' cannot verify the comm hook {hook}: it checks a reduction that sums every "
            f"rank's bucket over the whole world (torch's {linear})"
        )
    if check.recomputes_batches and job.replay_fn is None:
        raise _DoesNotApply(
            f"'{name}' needs Guard(..., replay_fn=fn), fn(model, batch) -> loss, and "
            "guard.audit_batch(batch) for every micro-batch"
        )
    if params.get("mode", job.mode) != job.mode:
        raise ConfigError(
            f"detectors.{name}.mode", f"the guard's own, Guard(mode={job.mode!r}); got "
            f"{params['mode']!r}"
        )  # fmt: skip
    try:
        # The campaign's own validation, so that a setting fails the same way here.
        config = check.configure(f"detectors.{name}", {**params, "mode": job.mode}, job.topology)
    except ConfigError as error:
        if error.key.startswith("detectors."):
            raise
        raise _DoesNotApply(f"'{name}' cannot run in this world: {error.message}") from None
    if not check.looks_from(config, job.start_step):
        raise _DoesNotApply(
            f"'{name}' never looks in a loop that starts at step {job.start_step} (resumed), "
            f"as set: {config.params()}"
        )
    if job.steps is not None:  # the campaign's own bound: a step it lists is in the loop
        check.check_steps(f"detectors.{name}", config, job.steps)
        # Whatever the loop's checkpoints (before which consensus also looks): never.
        if not check.looks_in(config, range(job.start_step, job.steps), lambda _: True):
            raise _DoesNotApply(
                f"'{name}' never looks in a loop of steps {job.start_step}..{job.steps - 1}, as "
                f"set: {config.params()}"
            )
    return config


def _linear(comm_hook: tuple[Any, Callable]) -> bool:
    """A hook the sketch can verify: one of torch's linear hooks, reducing over the world."""
    group, hook = comm_hook
    if hook not in user_comm.LINEAR_HOOKS:
        return False
    return group is None or dist.get_world_size(group) == dist.get_world_size()


def topology(world: int, per_node: int, parallel: str, shard_size: int | None) -> TopologyConfig:
    """The job's world as the checks' validation knows worlds."""
    return TopologyConfig(
        nodes=max(1, world // per_node),
        ranks_per_node=per_node,
        spares=0,
        backend=dist.get_backend(),
        threads_per_rank=torch.get_num_threads(),
        collective_timeout_s=1800.0,
        trial_timeout_s=1800.0,
        parallel=parallel,
        shard_size=shard_size if parallel == "hsdp" else None,
    )


def rehearsal(
    inject: dict[str, Any],
    model: nn.Module,
    topology: TopologyConfig,
    start_step: int,
    steps: int | None = None,
) -> FaultConfig:
    """A rehearsal fault, validated like a campaign's, its target among `model`'s (its steps
    bounded by the loop's end where `steps` gives it; a step before `start_step` is never
    reached). A fault at a module site names what only a forward shows (the products a module
    makes, their dtypes): the guard checks it on the loop's first forward, so it strikes from the
    second step on."""
    dtype = next(model.parameters()).dtype
    if dtype not in _DTYPE_NAMES:  # its bits, factors and values would be bounded as float32's
        raise ConfigError(
            "inject", f"a rehearsal strikes a model in {', '.join(_DTYPE_NAMES.values())}; this "
            f"one's parameters are {str(dtype).removeprefix('torch.')}"
        )  # fmt: skip
    loop = WorkloadConfig(
        name="custom", steps=steps or 2**31, dtype=_DTYPE_NAMES[dtype], seed=0, micro_batches=1,
        micro_batch_size=1, lr=1.0,
    )  # fmt: skip
    if not isinstance(inject, Mapping):
        raise ConfigError(
            "inject", f"{inject!r:.60} is not a fault: a mapping of fault keys to values, "
            "such as {'site': 'grad', 'model': 'scale', 'factor': 1000, 'steps': [5]}"
        )  # fmt: skip
    fault = fault_config("inject", plain(inject), loop, topology)
    if not fault.clean:
        _reached(fault, start_step)
        check_target("inject", fault, model, shard_group=topology.shard_group)
    return fault


def _reached(fault: FaultConfig, start_step: int) -> None:
    """Each step a transient or scheduled fault lists is one the loop reaches (from
    `start_step`), and at a module site one after the first, whose forward the guard traces
    with the fault unarmed to check what it names (a permanent or intermittent fault there
    strikes from the second step on)."""
    if fault.schedule:
        key, steps = "inject.schedule", sorted(e["step"] for e in fault.schedule)
    elif fault.persistence == "transient":
        key, steps = "inject.steps", sorted(fault.steps)
    else:
        return
    if steps[0] < start_step:
        raise ConfigError(
            key, f"{steps[0]} is before the guard's start_step {start_step}: never reached, "
            f"that strike could never happen; allowed: {start_step} or later"
        )  # fmt: skip
    if fault.site in MODULE_SITES and steps[0] == start_step:
        raise ConfigError(
            key, f"{steps[0]}: a fault at site {fault.site} strikes from the guard's second "
            "step on, since its first forward shows what the fault names (the products each "
            "module makes, their dtypes), as a campaign traces its model before it runs; "
            f"allowed: {start_step + 1} or later"
        )  # fmt: skip
