"""Turn the composed Hydra config into plain, validated dataclasses.

Everything a user can get wrong is checked here, in the Hydra process, before any rank is
spawned. A problem raises `ConfigError`, which the command prints as one line and exits 2.
Ranks only ever receive the dataclasses below, never an OmegaConf object.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

import torch

import detectors
from harness.config.faults import check_target, expand_scenarios, fault_config, unused_fault
from harness.config.schema import (
    BACKENDS,
    CUSTOM_TARGETS,
    LAUNCHERS,
    LR_SCHEDULES,
    PRECISIONS,
    WORKLOADS,
    CheckpointConfig,
    OverheadConfig,
    RecoveryConfig,
    RunConfig,
    TopologyConfig,
    TrialSpec,
    WorkloadConfig,
)
from harness.core.checks import CheckConfig
from harness.core.values import choice, integer, known_keys, positive
from harness.errors import ConfigError
from harness.runtime import determinism, devices, numerics
from harness.runtime.environment import check_cpu_kernels
from harness.runtime.workloads import DTYPES, Workload

TOP_KEYS = [
    "workload", "topology", "fault", "detectors", "campaign", "out", "launcher", "recovery",
    "checkpoint",
]  # fmt: skip


def workload_config(raw: dict[str, Any]) -> WorkloadConfig:
    known_keys("workload.", raw, [f.name for f in fields(WorkloadConfig)])
    choice("workload.name", raw.get("name"), WORKLOADS)
    choice("workload.dtype", raw.get("dtype"), tuple(DTYPES))
    integer("workload.steps", raw.get("steps"), 1)
    integer("workload.seed", raw.get("seed"), 0)
    integer("workload.micro_batches", raw.get("micro_batches"), 1)
    integer("workload.micro_batch_size", raw.get("micro_batch_size"), 1)
    positive("workload.lr", raw.get("lr"))
    if raw["name"] == "custom":
        _custom_targets(raw)
    if raw["name"] == "llama" and importlib.util.find_spec("transformers") is None:
        raise ConfigError(
            "workload", "'llama' is built by transformers, which is not installed: "
            "pip install -e '.[hf]' (scripts/setup.sh does)"
        )  # fmt: skip
    raw = _recipe(raw)
    cfg = WorkloadConfig(**raw)
    if cfg.name == "custom":
        _deterministic_data(cfg)
        _dry_step(cfg)
    if cfg.name in ("gpt", "llama") and cfg.d_model % cfg.heads:
        raise ConfigError("workload.heads", f"{cfg.heads} must divide d_model={cfg.d_model}")
    if cfg.name == "llama" and cfg.heads % (cfg.kv_heads or cfg.heads):
        raise ConfigError("workload.kv_heads", f"{cfg.kv_heads} must divide heads={cfg.heads}")
    return cfg


def _recipe(raw: dict[str, Any]) -> dict[str, Any]:
    """The training recipe's keys checked, and `precision` and `dtype` made one: a precision
    sets the weights' dtype (a mixed one keeps float32 weights); `dtype` alone is the precision's
    old name (float32 is 32-true)."""
    raw = dict(raw)
    precision = raw.get("precision")
    by_dtype = {dtype: name for name, (dtype, cast) in PRECISIONS.items() if cast is None}
    if precision is None:
        raw["precision"] = by_dtype[raw["dtype"]]
    elif precision == "16-mixed":
        raise ConfigError(
            "workload.precision", "'16-mixed' needs dynamic loss scaling (a GradScaler, whose "
            "scaled gradients and skipped steps the checks do not model yet); allowed: "
            f"{', '.join(PRECISIONS)}"
        )  # fmt: skip
    else:
        choice("workload.precision", precision, tuple(PRECISIONS))
        weights = PRECISIONS[precision][0]
        if raw["dtype"] not in ("float32", weights):
            raise ConfigError(
                "workload.dtype", f"'{raw['dtype']}' contradicts workload.precision={precision} "
                f"(weights in {weights}); set one of the two"
            )  # fmt: skip
        raw["dtype"] = weights
    clip = raw.get("clip_grad_norm")
    if clip is not None:
        positive("workload.clip_grad_norm", clip)
    choice("workload.lr_schedule", raw.get("lr_schedule", "constant"), LR_SCHEDULES)
    warmup = integer("workload.warmup_steps", raw.get("warmup_steps", 0), 0)
    if raw.get("lr_schedule") != "warmup_cosine" and warmup:
        raise ConfigError("workload.warmup_steps", "needs workload.lr_schedule=warmup_cosine")
    ratio = raw.get("min_lr_ratio", 0.1)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
        raise ConfigError("workload.min_lr_ratio", f"'{ratio}' must be a number in [0, 1]")
    for key in ("betas", "weight_decay"):
        if raw.get(key) is not None and raw["name"] == "custom":
            raise ConfigError(
                f"workload.{key}", "a custom workload builds its own optimizer: set it on "
                "workload.optimizer"
            )  # fmt: skip
    betas = raw.get("betas")
    if betas is not None:
        if (
            not isinstance(betas, list | tuple)
            or len(betas) != 2
            or not all(
                isinstance(b, int | float) and not isinstance(b, bool) and 0 <= b < 1 for b in betas
            )
        ):
            raise ConfigError("workload.betas", f"'{betas}' must be two numbers in [0, 1)")
        raw["betas"] = tuple(float(b) for b in betas)
    decay = raw.get("weight_decay")
    if decay is not None and (
        isinstance(decay, bool) or not isinstance(decay, int | float) or decay < 0
    ):
        raise ConfigError("workload.weight_decay", f"'{decay}' must be a number >= 0")
    for key in ("kv_heads", "intermediate"):
        if raw.get(key) is not None:
            integer(f"workload.{key}", raw[key], 1)
    return raw


def _custom_targets(raw: dict[str, Any]) -> None:
    """Every target must name something importable; nothing is instantiated here but what the
    user wrote in their config."""
    for part in CUSTOM_TARGETS:
        spec = raw.get(part)
        if not isinstance(spec, dict) or "_target_" not in spec:
            raise ConfigError(f"workload.{part}", "needs a Hydra target: {_target_: module.name}")
        reason = _import_problem(str(spec["_target_"]))
        if reason:
            raise ConfigError(
                f"workload.{part}._target_", f"'{spec['_target_']}' does not import ({reason})"
            )


def _import_problem(path: str) -> str:
    """Why `module.attribute` cannot be found, or "" when it can (imports the module only)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError as exc:
            problem = str(exc)
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return f"no {name} in {obj.__name__}"
            obj = getattr(obj, name)
        return ""
    return problem if len(parts) > 1 else "not a dotted path"


def _deterministic_data(cfg: WorkloadConfig) -> None:
    """Replay and golden runs need data that is a pure function of its arguments."""
    workload = Workload(cfg)
    first, second = workload.batch(1, 1, 0), workload.batch(1, 1, 0)
    if not all(torch.equal(a, b) for a, b in zip(first, second, strict=True)):
        raise ConfigError(
            "workload.data", "is not deterministic: two calls with the same (seed, step, rank, "
            "micro-batch) returned different batches"
        )  # fmt: skip


def _dry_step(cfg: WorkloadConfig) -> None:
    """One micro-batch through the user's targets, on the CPU, in this process: build the model,
    draw a batch, forward, loss, backward, one optimizer step. A target that raises is bad input,
    refused here in one line naming it, before any rank starts; every rank would raise the same
    error at the same place. The CPU (not the meta device): errors that depend on values (an
    index out of range, a dtype mismatch, a loss that is not a scalar) show only on real data."""
    workload = Workload(cfg)
    key = "workload.model"
    try:
        model = workload.build_model()
        key = "workload.data"
        inputs, targets = workload.batch(0, 0, 0)
        key = "workload.model"
        with workload.forward_rng(0, 0, 0):
            output = model(inputs)
            key = "workload.loss"
            loss = workload.loss_of(output, targets)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"returned {type(loss).__name__}, not a scalar tensor")
            loss.backward()
        key = "workload.optimizer"
        workload.build_optimizer(model).step()
    except ConfigError:
        raise
    except Exception as exc:  # the user's code: any error it raises is the finding
        target = getattr(cfg, key.split(".")[1])["_target_"]
        first = (str(exc).splitlines() or [""])[0][:200]
        raise ConfigError(
            key,
            f"'{target}' failed in a dry step of one micro-batch: {type(exc).__name__}: {first}",
        ) from None


def topology_config(raw: dict[str, Any]) -> TopologyConfig:
    known_keys(
        "topology.", raw, [f.name for f in fields(TopologyConfig) if f.name != "deterministic"]
    )
    integer("topology.nodes", raw.get("nodes"), 1)
    integer("topology.ranks_per_node", raw.get("ranks_per_node"), 1)
    integer("topology.spares", raw.get("spares"), 0)
    choice("topology.backend", raw.get("backend"), BACKENDS)
    threads = raw.get("threads_per_rank")
    if isinstance(threads, list):
        world = raw["nodes"] * raw["ranks_per_node"]
        if len(threads) != world:
            raise ConfigError(
                "topology.threads_per_rank", f"a list needs {world} entries, one per rank"
            )
        raw = dict(
            raw,
            threads_per_rank=tuple(
                integer(f"topology.threads_per_rank[{i}]", t, 1) for i, t in enumerate(threads)
            ),
        )
    else:
        integer("topology.threads_per_rank", threads, 1)
    positive("topology.collective_timeout_s", raw.get("collective_timeout_s"))
    positive("topology.trial_timeout_s", raw.get("trial_timeout_s"))
    if "cpu_kernels" in raw:
        check_cpu_kernels("topology.cpu_kernels", raw["cpu_kernels"])
    if raw.get("cpu_numerics") is not None:
        choice(numerics.KEY, raw["cpu_numerics"], numerics.NUMERICS)
    positive(
        "topology.startup_timeout_s",
        raw.get("startup_timeout_s", TopologyConfig.startup_timeout_s),
    )
    return TopologyConfig(**raw)


def _placed(topology: TopologyConfig, launcher: str) -> TopologyConfig:
    """The topology with its device resolved for the spawned world (every rank on this
    machine). Under torchrun the ranks' machines resolve it (harness/torchrun_worker.py);
    here only what no machine could run is refused."""
    if launcher == "spawn":
        ranks, gpus = topology.world_size, devices.gpu_count()
    else:
        ranks = gpus = topology.ranks_per_node
    device = devices.resolve(topology.device, topology.backend, ranks, gpus)
    numerics.resolve(topology.cpu_numerics, device if launcher == "spawn" else topology.device)
    return replace(topology, device=device) if launcher == "spawn" else topology


def exact_replay(
    topology: TopologyConfig,
    checks: dict[str, CheckConfig],
    trials: list[TrialSpec],
    env: Mapping[str, str] = os.environ,
) -> TopologyConfig:
    """The topology, marked when a trial's check compares recomputations bit for bit: on cuda its
    ranks then fix what recomputation needs, and the environment `env` they inherit must allow
    it (a ConfigError if not)."""
    each = [checks] + [t.checks for t in trials if t.checks is not None]
    exact = any(
        detectors.detector_class(name).compares_bits(config)
        for c in each
        for name, config in c.items()
    )
    if exact and topology.device == "cuda":
        determinism.settings(env, topology.backend)
    return replace(topology, deterministic=exact)


def overhead_config(raw: Any) -> OverheadConfig | None:
    """Off (null) or {steps: N, rounds: R}."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError("campaign.overhead", f"'{raw}' must be null or {{steps: N, rounds: R}}")
    known_keys("campaign.overhead.", raw, ["steps", "rounds"])
    return OverheadConfig(
        steps=integer("campaign.overhead.steps", raw.get("steps"), 1),
        rounds=integer("campaign.overhead.rounds", raw.get("rounds", 1), 1),
    )


def recovery_config(raw: dict[str, Any]) -> RecoveryConfig:
    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError("recovery.enabled", f"'{enabled}' is not allowed; allowed: true, false")
    limit = integer("recovery.max_recoveries", raw.get("max_recoveries", 3), 1)
    return RecoveryConfig(enabled=enabled, max_recoveries=limit)


def detector_configs(
    raw: dict[str, Any] | None, topology: TopologyConfig
) -> dict[str, CheckConfig]:
    raw = raw or {}
    allowed = detectors.available()
    out = {}
    for name, params in raw.items():
        choice("detectors", name, allowed)
        check = detectors.detector_class(name)
        out[name] = check.configure(f"detectors.{name}", dict(params or {}), topology)
    return out


def scenario_checks(
    key: str, raw: Any, base: dict[str, CheckConfig], topology: TopologyConfig
) -> dict[str, CheckConfig] | None:
    """A scenario's `checks: {NAME: {param: value}}` sets parameters of the run's own checks for
    its trials (audit_frequency grids the audit interval this way, so one run compares them)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(key, f"'{raw}' must be a mapping {{detector: {{param: value}}}}")
    checks = dict(base)
    for name, params in raw.items():
        if name not in base:
            allowed = ", ".join(base) or "none (detectors=[])"
            raise ConfigError(
                f"{key}.{name}", f"not one of the run's detectors; allowed: {allowed}"
            )
        if not isinstance(params, dict):
            raise ConfigError(f"{key}.{name}", f"'{params}' must be a mapping {{param: value}}")
        merged = {**base[name].params(), **params}
        checks[name] = detectors.detector_class(name).configure(f"{key}.{name}", merged, topology)
    return checks


def run_config(raw: dict[str, Any]) -> RunConfig:
    """Validate a composed config (as a plain dict) and expand its campaign into trials."""
    known_keys("", raw, TOP_KEYS)
    known_keys(
        "campaign.",
        raw["campaign"],
        ["name", "seeds", "noise_seeds", "scenarios", "fast_forward", "overhead"],
    )
    known_keys("checkpoint.", raw["checkpoint"], ["interval", "keep"])
    known_keys("recovery.", raw.get("recovery") or {}, ["enabled", "max_recoveries"])
    workload = workload_config(dict(raw["workload"]))
    topology = topology_config(dict(raw["topology"]))
    campaign = dict(raw["campaign"])
    launcher = choice("launcher", raw.get("launcher", "spawn"), LAUNCHERS)
    topology = _placed(topology, launcher)
    recovery = recovery_config(dict(raw.get("recovery") or {}))
    checkpoint = dict(raw["checkpoint"])
    checkpoint_cfg = CheckpointConfig(
        interval=integer("checkpoint.interval", checkpoint.get("interval"), 1),
        keep=bool(checkpoint.get("keep", False)),
    )
    checks = detector_configs(raw.get("detectors"), topology)
    if recovery.enabled:
        if not checks:
            raise ConfigError("recovery.enabled", "recovery acts on alerts: choose detectors")
        # Recovery acts on alerts: every check stops the step that it alarms on.
        checks = {name: config.in_mode("act") for name, config in checks.items()}
    seeds = integer("campaign.seeds", campaign.get("seeds"), 1)
    noise_seeds = integer("campaign.noise_seeds", campaign.get("noise_seeds"), 2)
    fast_forward = campaign.get("fast_forward", True)
    if not isinstance(fast_forward, bool):
        raise ConfigError(
            "campaign.fast_forward", f"'{fast_forward}' is not allowed; allowed: true, false"
        )
    # A check that carries state it cannot hand over makes every trial train from step 0.
    fast_forward = fast_forward and all(
        detectors.detector_class(name).fast_forward for name in checks
    )
    if campaign.get("name") == "single":
        scenario_raw = [(0, dict(raw["fault"]))]
    else:
        unused_fault(str(campaign.get("name")), dict(raw.get("fault") or {}), workload, topology)
        scenarios_raw = list(campaign.get("scenarios") or [])
        scenario_raw = expand_scenarios(scenarios_raw, DTYPES[workload.dtype])
        if not scenario_raw:
            raise ConfigError("campaign.scenarios", "a campaign needs at least one scenario")
    # Names and shapes are all the fault checks need: a model on `meta` allocates nothing.
    model = Workload(workload, device="meta").build_model()
    scenarios, trials = [], []
    for n, (i, scenario) in enumerate(scenario_raw):
        key = "fault" if campaign.get("name") == "single" else f"campaign.scenarios[{i}]"
        scenario = dict(scenario)
        trial_checks = scenario_checks(
            f"{key}.checks", scenario.pop("checks", None), checks, topology
        )
        fault = fault_config(key, scenario, workload, topology)
        check_target(key, fault, model)
        scenarios.append(fault)
        for s in range(seeds):
            seed = workload.seed + s
            trial_id = f"{n:03d}-{fault.label()}-s{seed}"
            trials.append(TrialSpec(trial_id, seed, fault, checks=trial_checks))
    topology = exact_replay(topology, checks, trials)
    return RunConfig(
        campaign=str(campaign.get("name")),
        workload=workload,
        topology=topology,
        detectors=checks,
        checkpoint=checkpoint_cfg,
        seeds=seeds,
        noise_seeds=noise_seeds,
        scenarios=tuple(scenarios),
        launcher=launcher,
        recovery=recovery,
        trials=tuple(trials),
        fast_forward=fast_forward,
        overhead=overhead_config(campaign.get("overhead")),
    )
