"""Turn the composed Hydra config into plain, validated dataclasses.

Everything a user can get wrong is checked here, in the Hydra process, before any rank is
spawned. A problem raises `ConfigError`, which the command prints as one line and exits 2.
Ranks only ever receive the dataclasses below, never an OmegaConf object.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

import detectors
from harness.config.fault_targets import (
    check_bucket,
    check_moment_values,
    check_moments,
    check_riders,
    check_target,
    struck_width,
)
from harness.config.faults import expand_scenarios, fault_config, unused_fault
from harness.config.mix import check_mix, scenario_class
from harness.config.schema import (
    BACKENDS,
    LAUNCHERS,
    PARALLEL,
    CheckpointConfig,
    OverheadConfig,
    RecoveryConfig,
    RunConfig,
    TopologyConfig,
    TrialSpec,
)
from harness.config.workload import MODULE_SITES, forward_modules, probe, workload_config
from harness.core.checks import CheckConfig
from harness.core.values import choice, flag, integer, known_keys, positive, writable
from harness.errors import ConfigError
from harness.runtime import determinism, devices, numerics
from harness.runtime.comm import fixed_layout, rider_slots
from harness.runtime.environment import check_cpu_kernels
from harness.runtime.workloads import DTYPES, Workload, WorkloadConfig
from injectors import bits

# The sites whose faults are checked against one forward's trace: the modules it runs, and the
# loss's dtype.
TRACED_SITES = (*MODULE_SITES, "loss")

TOP_KEYS = [
    "workload", "topology", "fault", "detectors", "campaign", "out", "launcher", "recovery",
    "checkpoint",
]  # fmt: skip


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
    _parallel(raw)
    return TopologyConfig(**raw)


def _parallel(raw: dict[str, Any]) -> None:
    """`topology.parallel`, and a `shard_size` that HSDP needs and nothing else reads."""
    parallel = choice("topology.parallel", raw.get("parallel", "ddp"), PARALLEL)
    size, world = raw.get("shard_size"), raw["nodes"] * raw["ranks_per_node"]
    if parallel != "hsdp":
        if size is not None:
            raise ConfigError(
                "topology.shard_size", f"only hsdp reads it; leave it null under {parallel}"
            )
        return
    if size is None:
        raise ConfigError("topology.shard_size", "hsdp needs the size of its shard groups")
    integer("topology.shard_size", size, 2)
    if size >= world or world % size:
        # One group of the whole world is fsdp; HSDP's replicas need two groups at least.
        raise ConfigError(
            "topology.shard_size",
            f"{size} must divide the world of {world} ranks into two or more equal shard "
            f"groups; allowed: {', '.join(str(d) for d in range(2, world) if world % d == 0)}",
        )


def _sharded_recovery(topology: TopologyConfig, recovery: RecoveryConfig) -> None:
    """A recovery that keeps the world's size (its mesh): a spare for every recovery it may
    make."""
    if recovery.enabled and topology.spares < recovery.max_recoveries:
        raise ConfigError(
            "topology.spares",
            f"a sharded world keeps its size, so each of recovery.max_recoveries="
            f"{recovery.max_recoveries} needs a spare node; allowed: {recovery.max_recoveries} "
            "or more (or lower recovery.max_recoveries)",
        )


def _applicable(topology: TopologyConfig, checks: dict[str, CheckConfig]) -> None:
    """The checks derived for the way the world trains (`Detector.parallel`): a sharded step
    has sites a replicated one lacks, and the reverse."""
    parallel = topology.parallel
    for name in checks:
        if parallel not in detectors.detector_class(name).parallel:
            allowed = [
                n for n in detectors.available() if parallel in detectors.detector_class(n).parallel
            ]
            raise ConfigError(
                f"detectors.{name}",
                f"does not apply under topology.parallel={parallel}; allowed: "
                + ", ".join(allowed),
            )


def _smallest_world(topology: TopologyConfig, recovery: RecoveryConfig) -> int:
    """The ranks of the smallest world a DDP trial may train in: a recovery with no spare left
    drops the quarantined node (harness/campaign/recovery.py), one node for each."""
    lost = max(0, recovery.max_recoveries - topology.spares) if recovery.enabled else 0
    return max(1, topology.nodes - lost) * topology.ranks_per_node


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


def _numerics_matter(workload: WorkloadConfig, topology: TopologyConfig) -> None:
    """`topology.cpu_numerics` decides how 16-bit products are computed: a built-in workload
    trained in float32 makes none, and its rows are the same bits under either setting, while
    campaign.json and the report would name the one given. A custom model may cast inside its
    forward, which its precision does not say: its setting is taken as given."""
    given = topology.cpu_numerics
    if given is None or workload.name == "custom" or (workload.precision or "32-true") != "32-true":
        return
    raise ConfigError(
        numerics.KEY, f"'{given}' sets how 16-bit matrix products are computed, and workload "
        f"{workload.name} at precision 32-true makes only float32 ones (the same bits either "
        "way); leave it unset, or set a 16-bit workload.precision (bf16-true, 16-true, "
        "bf16-mixed)"
    )  # fmt: skip


def _optimizer_suits(
    key: str,
    checks: dict[str, CheckConfig],
    workload: WorkloadConfig,
    stepped: Callable[[], torch.optim.Optimizer],
    named: str,
) -> None:
    """Each check's needs of a custom workload's optimizer (a built-in's AdamW meets them),
    under `key`.NAME."""
    for name, config in checks.items() if workload.name == "custom" else ():
        detectors.detector_class(name).check_optimizer(f"{key}.{name}", config, stepped, named)


def recovery_config(raw: dict[str, Any]) -> RecoveryConfig:
    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError("recovery.enabled", f"'{enabled}' is not allowed; allowed: true, false")
    limit = integer("recovery.max_recoveries", raw.get("max_recoveries", 3), 1)
    if not enabled and limit != RecoveryConfig.max_recoveries:
        raise ConfigError(
            "recovery.max_recoveries", "only recovery reads it; set recovery.enabled=true, or "
            f"leave it {RecoveryConfig.max_recoveries}"
        )  # fmt: skip
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
        check = detectors.detector_class(name)
        merged = {**base[name].params(), **params}
        defaults = {f.name: f.default for f in fields(check.Config)}
        for given in params:
            reset = check.Config.resets.get(given, ())
            merged.update({f: defaults[f] for f in reset if f not in params})
        checks[name] = check.configure(f"{key}.{name}", merged, topology)
    return checks


def _checks_in_run(
    key: str, checks: dict[str, CheckConfig], steps: int, checkpoint: CheckpointConfig
) -> None:
    """What each check needs of the run (`Detector.check_steps`: a step it lists is in it), and
    each periodic check looks at the interval it is set to (what trials.csv's `check_intervals`,
    the report's interval table, overhead.csv and sdc-plan credit its catches to):
    weight_consensus also looks before every checkpoint, and checkpoints off its own looks made
    it look more often than its interval said."""
    for name, config in checks.items():
        check = detectors.detector_class(name)
        check.check_steps(f"{key}.{name}", config, steps)
        if not check.looks_in(config, range(steps), checkpoint.after):
            raise ConfigError(
                f"{key}.{name}.interval", f"{name} never looks in this {steps}-step run "
                f"(every {config.every} steps, its first after step {config.every - 1}), so it "
                f"would be recorded as running and catching nothing; allowed: 1..{steps}, or "
                "more workload.steps"
            )  # fmt: skip
        every = check.ran_every(config, range(steps), checkpoint.after)
        if every != config.every:
            raise ConfigError(
                f"{key}.{name}.interval", f"{name} also looks before every checkpoint: with "
                f"checkpoint.interval={checkpoint.interval} it looks every {every} steps of this "
                f"{steps}-step run, not every {config.every}; set it to {every}, or "
                f"checkpoint.interval to a multiple of {config.every}"
            )  # fmt: skip


def _stepped_optimizer(workload: WorkloadConfig) -> torch.optim.Optimizer:
    """A custom workload's optimizer after one step on zeroed copies of its model's parameters
    (an optimizer makes its state on its first step)."""
    copies = nn.ParameterList(
        nn.Parameter(torch.zeros_like(p)) for p in probe(workload).model.parameters()
    )
    for p in copies:
        p.grad = torch.zeros_like(p)
    optimizer = Workload(workload).build_optimizer(copies)
    optimizer.step()
    return optimizer


def _timed_alike(
    timed: dict[tuple[str, int | None], tuple[str, CheckConfig]],
    key: str,
    checks: dict[str, CheckConfig],
) -> None:
    """overhead.csv times one setting of each check at each interval (harness/campaign/overhead.py):
    scenarios that set one otherwise at the same interval would have the other's cost
    reported as theirs. `timed`: the first scenario's (key, config) of each, filled here."""
    for name, config in checks.items():
        first, timed_config = timed.setdefault((name, config.every), (key, config))
        if timed_config != config:
            raise ConfigError(
                f"{key}.checks.{name}", f"campaign.overhead times one setting of {name} at each "
                f"interval, and {first} sets it otherwise; give them the same settings, or "
                "campaign.overhead=null"
            )  # fmt: skip


# Where `campaign.golden_cache: true` keeps goldens: $SDC_BENCH_CACHE/goldens, else this.
DEFAULT_CACHE = "results/cache"


def golden_cache(raw: Any) -> str | None:
    """`campaign.golden_cache`: true (the default store), false (off) or a folder; the store's
    folder as an absolute path, or None. A folder that cannot be created or written is refused
    here, not found out after the golden runs."""
    if raw is False:
        return None
    if raw is True:
        raw = str(Path(os.environ.get("SDC_BENCH_CACHE") or DEFAULT_CACHE) / "goldens")
    # A yes/no word is a mistyped flag, not the name of a folder to create.
    if not isinstance(raw, str) or not raw.strip() or raw.lower() in ("yes", "no", "on", "off"):
        raise ConfigError("campaign.golden_cache", f"'{raw}' is not allowed; allowed: true, "
                          "false or a folder")  # fmt: skip
    folder = Path(raw).expanduser().resolve()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir() or not writable(existing):
        raise ConfigError(
            "campaign.golden_cache", f"{existing} is not a writable folder; choose another "
            "folder, or false"
        )  # fmt: skip
    return str(folder)


def run_config(raw: dict[str, Any]) -> RunConfig:
    """Validate a composed config (as a plain dict) and expand its campaign into trials."""
    known_keys("", raw, TOP_KEYS)
    known_keys(
        "campaign.",
        raw["campaign"],
        ["name", "seeds", "noise_seeds", "scenarios", "fast_forward", "overhead", "golden_cache"],
    )
    known_keys("checkpoint.", raw["checkpoint"], ["interval", "keep"])
    known_keys("recovery.", raw.get("recovery") or {}, ["enabled", "max_recoveries"])
    workload = workload_config(dict(raw["workload"]))
    topology = topology_config(dict(raw["topology"]))
    campaign = dict(raw["campaign"])
    launcher = choice("launcher", raw.get("launcher", "spawn"), LAUNCHERS)
    topology = _placed(topology, launcher)
    _numerics_matter(workload, topology)
    recovery = recovery_config(dict(raw.get("recovery") or {}))
    checkpoint = dict(raw["checkpoint"])
    checkpoint_cfg = CheckpointConfig(
        interval=integer("checkpoint.interval", checkpoint.get("interval"), 1),
        keep=flag("checkpoint.keep", checkpoint.get("keep", False)),
    )
    checks = detector_configs(raw.get("detectors"), topology)
    if recovery.enabled:
        if not checks:
            raise ConfigError("recovery.enabled", "recovery acts on alerts: choose detectors")
        # Recovery acts on alerts: every check stops the step that it alarms on, so an observe
        # given for one would be overridden without a word.
        for name, params in (raw.get("detectors") or {}).items():
            mode = (params or {}).get("mode")
            if mode is not None and mode != "act":
                raise ConfigError(
                    f"detectors.{name}.mode", f"{mode}: recovery acts on alerts, so its run's "
                    "checks stop the step they alarm on; allowed: act, or leave it null (or "
                    "recovery.enabled=false to observe)"
                )  # fmt: skip
        checks = {name: config.in_mode("act") for name, config in checks.items()}
    _applicable(topology, checks)
    _checks_in_run("detectors", checks, workload.steps, checkpoint_cfg)
    if topology.spares and not recovery.enabled:
        raise ConfigError(
            "topology.spares", "spares take a quarantined node's place, which only recovery "
            "does; set recovery.enabled=true, or leave it 0"
        )  # fmt: skip
    if topology.sharded:
        _sharded_recovery(topology, recovery)
    elif recovery.enabled and topology.nodes + topology.spares < 2:
        # DDP's recovery drops the quarantined node where no spare takes its place
        # (harness/campaign/recovery.py): a world of one node would have none left to run on.
        raise ConfigError(
            "topology.spares", "recovery quarantines the suspect node, and a world of one node "
            "with no spare has none left to train on: it could never recover; allowed: 1 or "
            "more (or topology.nodes=2 or more)"
        )  # fmt: skip
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
        if campaign.get("scenarios"):
            raise ConfigError(
                "campaign.scenarios", "campaign single runs the one fault fault.* describes and "
                "would ignore them; leave them out, or run a campaign of scenarios (campaign.name "
                "other than single)"
            )  # fmt: skip
        scenario_raw = [(0, dict(raw["fault"]))]
    # Names and shapes are all the fault checks need: a custom workload's dry step has built its
    # one model in this process already; any other comes from a model on `meta`, which
    # allocates nothing. A fault at a module needs what the forward runs, found by running one.
    if workload.name == "custom":
        model = probe(workload).model
    else:
        model = Workload(workload, device="meta").build_model()
    traced = functools.cache(lambda: forward_modules(workload))
    if campaign.get("name") != "single":
        unused_fault(str(campaign.get("name")), dict(raw.get("fault") or {}), workload, topology)
        scenarios_raw = list(campaign.get("scenarios") or [])

        def width(i: int, scenario: dict[str, Any]) -> int:
            """The bits of what the scenario strikes (`grid: {bit: all}`), its bit aside."""
            key = f"campaign.scenarios[{i}]"
            fault = fault_config(key, {**scenario, "bit": 0}, workload, topology)
            module = fault.site in TRACED_SITES and not fault.clean
            narrowest = struck_width(fault, model, traced() if module else None)
            return narrowest or bits.width(DTYPES[workload.dtype])

        scenario_raw = expand_scenarios(scenarios_raw, width)
        if not scenario_raw:
            raise ConfigError("campaign.scenarios", "a campaign needs at least one scenario")
    riders = None if topology.sharded else rider_slots(_smallest_world(topology, recovery))
    traced_sites = {str(s.get("site")) for _, s in scenario_raw} & set(TRACED_SITES)
    forward = traced() if traced_sites else None
    overhead = overhead_config(campaign.get("overhead"))
    if overhead is not None and not checks:
        # harness/campaign/overhead.py times checks: with none it measures nothing, and wrote
        # no overhead.csv without a word.
        raise ConfigError(
            "campaign.overhead", "times each of the run's checks against runs without them, and "
            "detectors=[] chooses none, so no overhead.csv would be written; choose detectors, "
            "or leave it null"
        )  # fmt: skip
    timed: dict[tuple[str, int | None], tuple[str, CheckConfig]] = {}
    scenarios, trials, classes = [], [], []
    # A custom workload's optimizer, stepped once, for every scenario and check that needs it.
    stepped = functools.cache(lambda: _stepped_optimizer(workload))
    named = f"workload.optimizer ({(workload.optimizer or {}).get('_target_')})"
    _optimizer_suits("detectors", checks, workload, stepped, named)
    for n, (i, scenario) in enumerate(scenario_raw):
        key = "fault" if campaign.get("name") == "single" else f"campaign.scenarios[{i}]"
        scenario = dict(scenario)
        trial_checks = scenario_checks(
            f"{key}.checks", scenario.pop("checks", None), checks, topology
        )
        if trial_checks is not None:
            _checks_in_run(f"{key}.checks", trial_checks, workload.steps, checkpoint_cfg)
            _optimizer_suits(f"{key}.checks", trial_checks, workload, stepped, named)
            observed = [n for n, c in trial_checks.items() if recovery.enabled and c.mode != "act"]
            if observed:
                raise ConfigError(
                    f"{key}.checks.{observed[0]}.mode", f"{trial_checks[observed[0]].mode}: "
                    "recovery acts on alerts, so its run's checks stop the step they alarm on; "
                    "allowed: act (or recovery.enabled=false to observe)"
                )  # fmt: skip
        if overhead is not None:
            _timed_alike(timed, key, checks if trial_checks is None else trial_checks)
        mix = scenario_class(key, scenario)
        fault = fault_config(key, scenario, workload, topology)
        check_bucket(key, fault, model)
        layout = None if topology.sharded else fixed_layout(model)
        check_target(key, fault, model, forward, topology.shard_group, layout, riders)
        if fault.follows == "data" and not recovery.enabled:
            raise ConfigError(
                f"{key}.follows", "data: a fault follows its data once recovery hands a node's "
                "batches to another, and without recovery (recovery.enabled=true) each rank "
                "keeps its own, so it strikes as hardware's would; leave it hardware"
            )  # fmt: skip
        check_riders(key, fault, checks if trial_checks is None else trial_checks)
        if fault.site == "optimizer" and workload.name == "custom":
            check_moments(key, stepped(), named)
            check_moment_values(key, fault, stepped())
        scenarios.append(fault)
        classes.append((key, not fault.clean, mix))
        for s in range(seeds):
            seed = workload.seed + s
            trial_id = f"{n:03d}-{fault.label()}-s{seed}"
            trials.append(TrialSpec(trial_id, seed, fault, checks=trial_checks, mix=mix))
    check_mix(classes)
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
        forward=forward,
        overhead=overhead,
        golden_cache=golden_cache(campaign.get("golden_cache", True)),
    )
