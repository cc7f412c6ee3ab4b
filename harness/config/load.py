"""Turn the composed Hydra config into plain, validated dataclasses.

Everything a user can get wrong is checked here, in the Hydra process, before any rank is
spawned. A problem raises `ConfigError`, which the command prints as one line and exits 2.
Ranks only ever receive the dataclasses below, never an OmegaConf object.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

import torch

import detectors
import injectors
from harness.config.schema import (
    BACKENDS,
    BIT_WIDTH,
    CUSTOM_TARGETS,
    LAUNCHERS,
    MATMUL_PHASES,
    PERSISTENCE,
    SCOPES,
    SELECT,
    SITES_WITH_SCOPE,
    WORKLOADS,
    CheckpointConfig,
    FaultConfig,
    OverheadConfig,
    RecoveryConfig,
    RunConfig,
    TopologyConfig,
    TrialSpec,
    WorkloadConfig,
)
from harness.errors import ConfigError
from harness.runtime import determinism, devices
from harness.runtime.environment import check_cpu_kernels
from harness.runtime.workloads import DTYPES, Workload
from injectors import bits, injector


def _choice(key: str, value: Any, allowed: tuple[str, ...] | list[str]) -> str:
    if value not in allowed:
        raise ConfigError(key, f"'{value}' is not allowed; allowed: {', '.join(allowed)}")
    return value


def _int(key: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"'{value}' is not an integer")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"{low if low is not None else '-inf'}..{high if high is not None else 'inf'}"
        raise ConfigError(key, f"{value} is out of range; allowed: {bounds}")
    return value


def _positive(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(key, f"'{value}' must be a positive number")
    return float(value)


def _int_list(key: str, value: Any, low: int, high: int) -> tuple[int, ...]:
    """A list of integers; an item "A:B" or "A:B:S" stands for range(A, B, S)."""
    items = [value] if isinstance(value, int | str) else value
    if not isinstance(items, list | tuple) or not items:
        raise ConfigError(key, f"'{value}' must be a non-empty list of integers in {low}..{high}")
    expanded = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            try:
                expanded += list(range(*(int(part) for part in item.split(":"))))
            except (TypeError, ValueError):
                raise ConfigError(f"{key}[{i}]", f"'{item}' is not a range A:B or A:B:S") from None
        else:
            expanded.append(item)
    return tuple(sorted({_int(f"{key}[{i}]", v, low, high) for i, v in enumerate(expanded)}))


def _known_keys(prefix: str, raw: dict[str, Any], known: list[str]) -> None:
    for key in raw:
        if key not in known:
            raise ConfigError(f"{prefix}{key}", f"unknown key; allowed: {', '.join(known)}")


TOP_KEYS = [
    "workload", "topology", "fault", "detectors", "campaign", "out", "launcher", "recovery",
    "checkpoint",
]  # fmt: skip


def workload_config(raw: dict[str, Any]) -> WorkloadConfig:
    _known_keys("workload.", raw, [f.name for f in fields(WorkloadConfig)])
    _choice("workload.name", raw.get("name"), WORKLOADS)
    _choice("workload.dtype", raw.get("dtype"), tuple(DTYPES))
    _int("workload.steps", raw.get("steps"), 1)
    _int("workload.seed", raw.get("seed"), 0)
    _int("workload.micro_batches", raw.get("micro_batches"), 1)
    _int("workload.micro_batch_size", raw.get("micro_batch_size"), 1)
    _positive("workload.lr", raw.get("lr"))
    if raw["name"] == "custom":
        _custom_targets(raw)
    cfg = WorkloadConfig(**raw)
    if cfg.name == "custom":
        _deterministic_data(cfg)
    if cfg.name == "gpt" and cfg.d_model % cfg.heads:
        raise ConfigError("workload.heads", f"{cfg.heads} must divide d_model={cfg.d_model}")
    return cfg


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


def topology_config(raw: dict[str, Any]) -> TopologyConfig:
    _known_keys(
        "topology.", raw, [f.name for f in fields(TopologyConfig) if f.name != "deterministic"]
    )
    _int("topology.nodes", raw.get("nodes"), 1)
    _int("topology.ranks_per_node", raw.get("ranks_per_node"), 1)
    _int("topology.spares", raw.get("spares"), 0)
    _choice("topology.backend", raw.get("backend"), BACKENDS)
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
                _int(f"topology.threads_per_rank[{i}]", t, 1) for i, t in enumerate(threads)
            ),
        )
    else:
        _int("topology.threads_per_rank", threads, 1)
    _positive("topology.collective_timeout_s", raw.get("collective_timeout_s"))
    _positive("topology.trial_timeout_s", raw.get("trial_timeout_s"))
    if "cpu_kernels" in raw:
        check_cpu_kernels("topology.cpu_kernels", raw["cpu_kernels"])
    _positive(
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
    return replace(topology, device=device) if launcher == "spawn" else topology


def exact_replay(
    topology: TopologyConfig,
    checks: dict[str, dict[str, Any]],
    trials: list[TrialSpec],
    env: Mapping[str, str] = os.environ,
) -> TopologyConfig:
    """The topology, marked when a trial's replay compares bit for bit: on cuda its ranks then
    fix what recomputation needs, and the environment `env` they inherit must allow it (a
    ConfigError if not)."""
    each = [checks] + [t.checks for t in trials if t.checks is not None]
    exact = any(c.get("replay", {}).get("compare") == "exact" for c in each)
    if exact and topology.device == "cuda":
        determinism.settings(env, topology.backend)
    return replace(topology, deterministic=exact)


def _fault_model(key: str, value: Any) -> str:
    return _choice(key, value, ("none", *injectors.available_models()))


def _fault_site(key: str, value: Any) -> str:
    return _choice(key, value, ("none", *injectors.SITES))


def _fault_values(
    key: str, raw: dict[str, Any], workload: WorkloadConfig, topology: TopologyConfig
) -> dict[str, Any]:
    """Every fault key checked on its own, whatever the site: a mistyped value is an error even
    where the site would not use it."""
    values = {f.name: f.default for f in fields(FaultConfig)}
    values.update(raw)
    values["model"] = _fault_model(f"{key}.model", values["model"])
    width = BIT_WIDTH[workload.dtype]
    bit = values["bit"]
    if isinstance(bit, str):
        _choice(f"{key}.bit", bit, bits.CLASSES)
    elif bit is not None:
        values["bit"] = _int(f"{key}.bit", bit, 0, width - 1)
    if values["value"] is not None:
        values["value"] = _value_name(values["value"])
    factor = values["factor"]
    if factor is not None and (
        isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor)
    ):
        raise ConfigError(f"{key}.factor", f"'{factor}' must be a finite number")
    if factor is not None:
        values["factor"] = float(factor)
    if values["scope"] is not None:
        _choice(f"{key}.scope", values["scope"], SCOPES)
    stuck_at = values["stuck_at"]
    if stuck_at not in (None, 0, 1) or isinstance(stuck_at, bool):
        raise ConfigError(f"{key}.stuck_at", f"'{stuck_at}' is not allowed; allowed: 0, 1")
    values["schedule"] = _schedule(f"{key}.schedule", values["schedule"], workload, topology)
    for name, high in (("ranks", topology.world_size - 1), ("steps", workload.steps - 1)):
        if name in raw:
            values[name] = _int_list(f"{key}.{name}", raw[name], 0, high)
    _choice(f"{key}.persistence", values["persistence"], PERSISTENCE)
    _choice(f"{key}.select", values["select"], SELECT)
    _choice(f"{key}.follows", values["follows"], ("hardware", "data"))
    values["tensor"] = str(values["tensor"])  # Hydra reads a glob such as 0 as a number
    if values["bucket"] is not None:
        _int(f"{key}.bucket", values["bucket"], 0)
    if values["index"] is not None:
        _int(f"{key}.index", values["index"], 0)
    _int(f"{key}.elements", values["elements"], 1)
    _int(f"{key}.nbits", values["nbits"], 1, width)
    if not isinstance(values["adjacent"], bool):
        raise ConfigError(
            f"{key}.adjacent", f"'{values['adjacent']}' is not allowed; allowed: true, false"
        )
    probability = values["probability"]
    if (
        isinstance(probability, bool)
        or not isinstance(probability, int | float)
        or not 0 < probability <= 1
    ):
        raise ConfigError(f"{key}.probability", f"'{probability}' must be in (0, 1]")
    ber = values["ber"]
    if ber is not None and (
        isinstance(ber, bool) or not isinstance(ber, int | float) or not 0 < ber <= 1
    ):
        raise ConfigError(f"{key}.ber", f"'{ber}' must be a bit error rate in (0, 1]")
    return values


# What `fault=none` (experiments/fault/none.yaml) holds, as checked values: a scenario without a
# site may hold these and nothing else, since it ignores every other fault key.
NO_FAULT = {**{f.name: f.default for f in fields(FaultConfig)}, "ranks": (0,), "steps": (0,)}


def _ignored(values: dict[str, Any], raw: dict[str, Any]) -> str | None:
    """The first key of `raw` that a fault without a site would ignore, or None."""
    return next((k for k in raw if values[k] != NO_FAULT[k]), None)


def fault_config(
    key: str, raw: dict[str, Any], workload: WorkloadConfig, topology: TopologyConfig
) -> FaultConfig:
    _known_keys(f"{key}.", raw, [f.name for f in fields(FaultConfig)])
    site = _fault_site(f"{key}.site", raw.get("site", "none"))
    values = _fault_values(key, raw, workload, topology)
    if site == "none":
        ignored = _ignored(values, raw)
        if ignored is not None:
            raise ConfigError(
                f"{key}.site",
                f"none (no fault) ignores {key}.{ignored}={raw[ignored]}; choose a site "
                f"(allowed: {', '.join(injectors.SITES)}) or leave {key}.{ignored} unset",
            )
        return FaultConfig()
    model = values["model"]
    if model == "none":
        allowed = ", ".join(injectors.available_models())
        raise ConfigError(f"{key}.model", f"site '{site}' needs a model; allowed: {allowed}")
    if site in SITES_WITH_SCOPE:
        values["scope"] = _choice(f"{key}.scope", values["scope"] or "rank", SITES_WITH_SCOPE[site])
    elif values["scope"] is not None:
        raise ConfigError(f"{key}.scope", f"site '{site}' has no scope; leave it null")
    if values["schedule"]:
        values["ranks"], values["steps"] = (), ()
    elif not values["ranks"] or not values["steps"]:
        name = "ranks" if not values["ranks"] else "steps"
        raise ConfigError(f"{key}.{name}", "a fault needs a non-empty list of integers")
    if values["bucket"] is not None and site not in ("grad", "allreduce"):
        raise ConfigError(
            f"{key}.bucket", f"site '{site}' has no buckets; allowed: grad, allreduce"
        )
    if values["ber"] is not None and model != "bitflip":
        raise ConfigError(f"{key}.ber", "a bit error rate needs model bitflip")
    _shape(key, values, site, model)
    if (
        values["scope"] == "reduction"
        and not injectors.model_class(model).contribution
        and len(values["ranks"]) > 1
    ):
        # The reduction's result is wrong on every receiver; fault.ranks says which node's
        # hardware computes it wrong (what recovery locates and quarantines).
        raise ConfigError(
            f"{key}.ranks", "scope reduction puts the fault in one node's reduction; allowed: "
            "one rank, on the node whose reduction is broken"
        )  # fmt: skip
    fault = FaultConfig(**values)
    injectors.model_class(model).validate(key, fault)
    return fault


def _unused_fault(
    campaign: str, raw: dict[str, Any], workload: WorkloadConfig, topology: TopologyConfig
) -> None:
    """A campaign with scenarios of its own ignores `fault.*`: refuse an override there."""
    _known_keys("fault.", raw, [f.name for f in fields(FaultConfig)])
    _fault_site("fault.site", raw.get("site", "none"))
    ignored = _ignored(_fault_values("fault", raw, workload, topology), raw)
    if ignored is not None:
        raise ConfigError(
            "campaign",
            f"'{campaign}' runs its campaign.scenarios and ignores fault.{ignored}="
            f"{raw[ignored]}; use campaign=single to run that fault",
        )


def _shape(key: str, values: dict[str, Any], site: str, model: str) -> None:
    """Issue 14's keys: a burst's sub-model and stride, a matmul fault's pass; grouped models
    (swap, burst) draw their own positions, so they take no schedule and no `largest`."""
    if values.get("burst_model") is not None and model != "burst":
        raise ConfigError(f"{key}.burst_model", "only model burst has a sub-model; leave it null")
    values["stride"] = _int(f"{key}.stride", values.get("stride", 1), 1)
    if values["stride"] != 1 and model != "burst":
        raise ConfigError(f"{key}.stride", "only model burst has a stride; leave it 1")
    values["phase"] = _choice(f"{key}.phase", values.get("phase", "forward"), MATMUL_PHASES)
    if values["phase"] != "forward" and site != "matmul":
        raise ConfigError(f"{key}.phase", "only site matmul has a backward phase; leave it forward")
    if model in ("swap", "burst"):
        for name, unset in (("schedule", ()), ("select", "random")):
            if values.get(name, unset) not in (unset, None, ()):
                raise ConfigError(
                    f"{key}.{name}", f"model {model} draws its own group; leave it unset"
                )


def _schedule(
    key: str, raw: Any, workload: WorkloadConfig, topology: TopologyConfig
) -> tuple[dict[str, Any], ...]:
    """An explicit list of injections: {step, rank, tensor, index[, bit]} each."""
    if not raw:
        return ()
    width = BIT_WIDTH[workload.dtype]
    entries = []
    for i, entry in enumerate(raw):
        k = f"{key}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(k, "each entry is {step, rank, tensor, index[, bit]}")
        _known_keys(f"{k}.", entry, ["step", "rank", "tensor", "index", "bit"])
        clean = {
            "step": _int(f"{k}.step", entry.get("step"), 0, workload.steps - 1),
            "rank": _int(f"{k}.rank", entry.get("rank"), 0, topology.world_size - 1),
            "tensor": str(entry.get("tensor")),
            "index": _int(f"{k}.index", entry.get("index"), 0),
        }
        if entry.get("bit") is not None:
            clean["bit"] = _int(f"{k}.bit", entry["bit"], 0, width - 1)
        entries.append(clean)
    return tuple(entries)


def _check_target(key: str, fault: FaultConfig, model: torch.nn.Module) -> None:
    """The tensors a fault names must exist at its site on this workload's model."""
    if fault.clean:
        return
    reachable = dict(injector.targets(fault.site, model))
    names = ", ".join(reachable)
    for i, entry in enumerate(fault.schedule):
        at = f"{key}.schedule[{i}]"
        if entry["tensor"] not in reachable:
            message = f"'{entry['tensor']}' is not at site {fault.site}; allowed: {names}"
            raise ConfigError(f"{at}.tensor", message)
        size = reachable[entry["tensor"]]
        if size is not None and entry["index"] >= size:
            message = f"{entry['index']} is out of range; allowed: 0..{size - 1}"
            raise ConfigError(f"{at}.index", message)
    if fault.schedule:
        return
    matched = injector.matching(fault, model)
    if not matched:
        message = f"'{fault.tensor}' matches nothing at site {fault.site}; allowed: {names}"
        raise ConfigError(f"{key}.tensor", message)
    sizes = [size for _, size in matched]
    if fault.index is not None and None not in sizes and fault.index + fault.elements > sum(sizes):
        high = sum(sizes) - fault.elements
        raise ConfigError(f"{key}.index", f"{fault.index} is out of range; allowed: 0..{high}")


def _value_name(value: Any) -> str:
    """Hydra reads `nan` and `inf` as floats; the table and the model keep them as names."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value).strip().lower()


def expand_scenarios(
    raw: list[dict[str, Any]], dtype: torch.dtype
) -> list[tuple[int, dict[str, Any]]]:
    """Each scenario may carry `grid: {key: [values]}`; it expands to the cross product.
    `grid: {bit: all}` is every bit of the workload's dtype, so one campaign file serves every
    dtype."""
    expanded = []
    for i, scenario in enumerate(raw):
        scenario = dict(scenario)
        grid = dict(scenario.pop("grid", None) or {})
        if grid.get("bit") == "all":
            grid["bit"] = list(range(bits.width(dtype)))
        for key, values in grid.items():
            if not isinstance(values, list | tuple):
                raise ConfigError(
                    f"campaign.scenarios[{i}].grid.{key}",
                    f"'{values}' is not a list of values" + ("; or 'all'" if key == "bit" else ""),
                )
        keys = list(grid)
        for combo in itertools.product(*(grid[k] for k in keys)):
            expanded.append((i, {**scenario, **dict(zip(keys, combo, strict=True))}))
    return expanded


def overhead_config(raw: Any) -> OverheadConfig | None:
    """Off (null) or {steps: N, rounds: R}."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError("campaign.overhead", f"'{raw}' must be null or {{steps: N, rounds: R}}")
    _known_keys("campaign.overhead.", raw, ["steps", "rounds"])
    return OverheadConfig(
        steps=_int("campaign.overhead.steps", raw.get("steps"), 1),
        rounds=_int("campaign.overhead.rounds", raw.get("rounds", 1), 1),
    )


def recovery_config(raw: dict[str, Any]) -> RecoveryConfig:
    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError("recovery.enabled", f"'{enabled}' is not allowed; allowed: true, false")
    limit = _int("recovery.max_recoveries", raw.get("max_recoveries", 3), 1)
    return RecoveryConfig(enabled=enabled, max_recoveries=limit)


def detector_configs(
    raw: dict[str, Any] | None, topology: TopologyConfig
) -> dict[str, dict[str, Any]]:
    raw = raw or {}
    allowed = detectors.available()
    out = {}
    for name, params in raw.items():
        _choice("detectors", name, allowed)
        params = dict(params or {})
        out[name] = detectors.detector_class(name).validate(f"detectors.{name}", params, topology)
    return out


def scenario_checks(
    key: str, raw: Any, base: dict[str, dict[str, Any]], topology: TopologyConfig
) -> dict[str, dict[str, Any]] | None:
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
        merged = {**base[name], **params}
        checks[name] = detectors.detector_class(name).validate(f"{key}.{name}", merged, topology)
    return checks


def run_config(raw: dict[str, Any]) -> RunConfig:
    """Validate a composed config (as a plain dict) and expand its campaign into trials."""
    _known_keys("", raw, TOP_KEYS)
    _known_keys(
        "campaign.",
        raw["campaign"],
        ["name", "seeds", "noise_seeds", "scenarios", "fast_forward", "overhead"],
    )
    _known_keys("checkpoint.", raw["checkpoint"], ["interval", "keep"])
    _known_keys("recovery.", raw.get("recovery") or {}, ["enabled", "max_recoveries"])
    workload = workload_config(dict(raw["workload"]))
    topology = topology_config(dict(raw["topology"]))
    campaign = dict(raw["campaign"])
    launcher = _choice("launcher", raw.get("launcher", "spawn"), LAUNCHERS)
    topology = _placed(topology, launcher)
    recovery = recovery_config(dict(raw.get("recovery") or {}))
    checkpoint = dict(raw["checkpoint"])
    checkpoint_cfg = CheckpointConfig(
        interval=_int("checkpoint.interval", checkpoint.get("interval"), 1),
        keep=bool(checkpoint.get("keep", False)),
    )
    checks = detector_configs(raw.get("detectors"), topology)
    if recovery.enabled:
        if not checks:
            raise ConfigError("recovery.enabled", "recovery acts on alerts: choose detectors")
        # Recovery acts on alerts: every check stops the step that it alarms on.
        checks = {name: dict(params, mode="act") for name, params in checks.items()}
    seeds = _int("campaign.seeds", campaign.get("seeds"), 1)
    noise_seeds = _int("campaign.noise_seeds", campaign.get("noise_seeds"), 2)
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
        _unused_fault(str(campaign.get("name")), dict(raw.get("fault") or {}), workload, topology)
        scenarios_raw = list(campaign.get("scenarios") or [])
        scenario_raw = expand_scenarios(scenarios_raw, DTYPES[workload.dtype])
        if not scenario_raw:
            raise ConfigError("campaign.scenarios", "a campaign needs at least one scenario")
    model = Workload(workload).build_model()
    scenarios, trials = [], []
    for n, (i, scenario) in enumerate(scenario_raw):
        key = "fault" if campaign.get("name") == "single" else f"campaign.scenarios[{i}]"
        scenario = dict(scenario)
        trial_checks = scenario_checks(
            f"{key}.checks", scenario.pop("checks", None), checks, topology
        )
        fault = fault_config(key, scenario, workload, topology)
        _check_target(key, fault, model)
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
