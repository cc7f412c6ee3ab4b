"""A fault's keys (`fault.*`, or one entry of `campaign.scenarios`) checked and turned into a
`FaultConfig`: its site and model, the values the model needs and no value it would ignore, its
ranks and steps within the world and the run, and the tensors it names on the workload's model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import injectors
from harness.config.schema import (
    MATMUL_PHASES,
    PERSISTENCE,
    SCOPES,
    SELECT,
    SITES_WITH_SCOPE,
    FaultConfig,
    TopologyConfig,
    WorkloadConfig,
)
from harness.core.formats import BIT_CLASSES, FLOAT_FORMATS, unchanging_scale
from harness.core.values import choice, int_list, integer, known_keys
from harness.errors import ConfigError
from injectors import sites
from injectors.value import unstored

# The keys every fault has; a model's own keys (its `Config`) come beside them.
FAULT_KEYS = [f.name for f in fields(FaultConfig) if f.name != "settings"]


def _fault_model(key: str, value: Any) -> str:
    return choice(key, value, ("none", *injectors.available_models()))


def _model_keys(model: str) -> list[str]:
    return [] if model == "none" else injectors.model_class(model).Config.names()


def _split(
    key: str, raw: dict[str, Any], models: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`raw` as (the keys every fault has, the model's own keys), refusing a key that neither
    the fault nor any of `models` has."""
    known_keys(f"{key}.", raw, FAULT_KEYS + [k for m in models for k in _model_keys(m)])
    own = {k: v for k, v in raw.items() if k in FAULT_KEYS}
    return own, {k: v for k, v in raw.items() if k not in FAULT_KEYS}


def _fault_site(key: str, value: Any) -> str:
    return choice(key, value, ("none", *injectors.SITES, injectors.GATHER))


def _width(site: str, workload: WorkloadConfig) -> int:
    """The bits a fault at `site` may name: its workload dtype's, but elsewhere (a module site,
    the loss, a user's optimizer's moments) the widest format's: a module's outputs and
    products may be wider than the workload's (attention's float32 scores under bf16-true), and
    the dtypes a forward trace or a stepped optimizer records bound the bits there
    (harness/config/fault_targets.py)."""
    if _in_workload_dtype(site, workload):
        return FLOAT_FORMATS[workload.dtype][0]
    return max(width for width, _ in FLOAT_FORMATS.values())


def _fault_values(
    key: str, raw: dict[str, Any], workload: WorkloadConfig, topology: TopologyConfig, site: str
) -> dict[str, Any]:
    """Every fault key checked on its own, whatever the site: a mistyped value is an error even
    where the site would not use it."""
    values = {f.name: f.default for f in fields(FaultConfig)}
    values.update(raw)
    values["model"] = _fault_model(f"{key}.model", values["model"])
    width = _width(site, workload)
    bit = values["bit"]
    if isinstance(bit, str):
        choice(f"{key}.bit", bit, BIT_CLASSES)
    elif bit is not None:
        values["bit"] = integer(f"{key}.bit", bit, 0, width - 1)
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
        choice(f"{key}.scope", values["scope"], SCOPES)
    stuck_at = values["stuck_at"]
    if stuck_at not in (None, 0, 1) or isinstance(stuck_at, bool):
        raise ConfigError(f"{key}.stuck_at", f"'{stuck_at}' is not allowed; allowed: 0, 1")
    values["schedule"] = _schedule(f"{key}.schedule", values["schedule"], workload, topology, width)
    for name, high in (("ranks", topology.world_size - 1), ("steps", workload.steps - 1)):
        if name in raw:
            values[name] = int_list(f"{key}.{name}", raw[name], 0, high)
    choice(f"{key}.persistence", values["persistence"], PERSISTENCE)
    choice(f"{key}.select", values["select"], SELECT)
    choice(f"{key}.follows", values["follows"], ("hardware", "data"))
    values["tensor"] = str(values["tensor"])  # Hydra reads a glob such as 0 as a number
    if values["bucket"] is not None:
        integer(f"{key}.bucket", values["bucket"], 0)
    if values["index"] is not None:
        integer(f"{key}.index", values["index"], 0)
    integer(f"{key}.elements", values["elements"], 1)
    integer(f"{key}.nbits", values["nbits"], 1, width)
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
    given, settings = _split(key, raw, [_fault_model(f"{key}.model", raw.get("model", "none"))])
    site = _fault_site(f"{key}.site", given.get("site", "none"))
    values = _fault_values(key, given, workload, topology, site)
    if site == "none":
        ignored = _ignored(values, given) or next(iter(settings), None)
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
        values["scope"] = choice(f"{key}.scope", values["scope"] or "rank", SITES_WITH_SCOPE[site])
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
    _parallel_fault(key, values, site, topology)
    if values["ber"] is not None and model != "bitflip":
        raise ConfigError(f"{key}.ber", "a bit error rate needs model bitflip")
    if values["ber"] is not None and site == "matmul":
        # A matmul fault strikes one module's product, drawn with the elements: a rate draws
        # none, and no product would ever be struck.
        raise ConfigError(
            f"{key}.ber", "site matmul strikes one product's elements; leave it unset (allowed "
            "there: elements, select, or model defective_unit for a unit's rate)"
        )  # fmt: skip
    _shape(key, values, site, model)
    broken_reduction = (
        values["scope"] == "reduction" and not injectors.model_class(model).contribution
    )
    if broken_reduction and values["schedule"]:
        # Each receiver's injector strikes the entries naming its own rank: a copy, not the sum.
        raise ConfigError(
            f"{key}.schedule", "a broken reduction gives every receiver the same wrong sum, and a "
            "schedule strikes only the ranks its entries name; use scope rank with a schedule"
        )  # fmt: skip
    if broken_reduction and len(values["ranks"]) > 1:
        # The reduction's result is wrong on every receiver; fault.ranks says which node's
        # hardware computes it wrong (what recovery locates and quarantines).
        raise ConfigError(
            f"{key}.ranks", "scope reduction puts the fault in one node's reduction; allowed: "
            "one rank, on the node whose reduction is broken"
        )  # fmt: skip
    _largest(key, values, model)
    _bit_error_rate(key, values)
    _changes_a_value(key, values, site, model, workload)
    _index_placed(key, values, site, model, topology)
    values["settings"] = injectors.model_class(model).Config.parse(key, settings)
    fault = FaultConfig(**values)
    injectors.model_class(model).validate(key, fault)  # a model's own reasons first
    _read_by_the_fault(key, fault)
    return fault


def _largest(key: str, values: dict[str, Any], model: str) -> None:
    """`select: largest` picks the largest elements of what it strikes: a key that names the
    elements too would be ignored, and a model that changes no element cannot honour it."""
    if values["select"] != "largest":
        return
    for name in ("index", "ber", "schedule"):
        if values[name] not in (None, ()):
            raise ConfigError(
                f"{key}.{name}", "select largest picks the elements itself; leave it unset"
            )
    if injectors.model_class(model).contribution:
        raise ConfigError(
            f"{key}.select",
            f"model {model} changes a rank's whole contribution, not an element; allowed: random",
        )


def _bit_error_rate(key: str, values: dict[str, Any]) -> None:
    """A bit error rate draws its own elements and bits, any bit of each word: a key that names
    them too would be ignored."""
    if values["ber"] is None:
        return
    for name in ("bit", "index", "schedule"):
        if values[name] not in (None, ()):
            raise ConfigError(
                f"{key}.{name}", "a bit error rate draws its own bits and elements; leave it unset"
            )
    for name, default in (("nbits", 1), ("elements", 1)):
        if values[name] != default:
            raise ConfigError(
                f"{key}.{name}",
                f"a bit error rate draws its own bits and elements; leave it {default}",
            )


def _read_by_the_fault(key: str, fault: FaultConfig) -> None:
    """Keys that only some faults read must keep their defaults in the others, where they would
    be ignored, and yet tell the trials' scenarios apart (trials.csv's `fault_settings`)."""
    inner = fault.burst_model if fault.model == "burst" else fault.model  # what corrupts
    named = bool(fault.schedule) and all(e.get("bit") is not None for e in fault.schedule)
    ignored = [
        ("bit", fault.bit is not None and inner not in ("bitflip", "stuck", "defective_unit"),
         f"model {inner} changes no chosen bit; leave it unset"),
        ("bit", fault.bit is not None and named,
         "each of the schedule's entries names its bit; leave it unset"),
        ("factor", fault.factor is not None and inner != "scale",
         f"only model scale multiplies (this is {inner}); leave it unset"),
        ("value", fault.value is not None and inner not in ("value", "crash"),
         f"only models value and crash take a value (this is {inner}); leave it unset"),
        ("nbits", fault.nbits != 1 and (fault.model != "bitflip" or named), "only model "
         "bitflip flips several bits, where it draws them (a burst flips one bit of each "
         "element, a schedule's entry its bit); leave it 1"),
        ("adjacent", not fault.adjacent and fault.nbits == 1,
         "it places the extra bits of nbits > 1; leave it true"),
        ("stuck_at", fault.stuck_at is not None and fault.model != "stuck",
         "only model stuck holds a bit at a value; leave it unset"),
        ("probability", fault.probability != FaultConfig.probability
         and fault.persistence != "intermittent" and not fault.schedule,
         "only an intermittent fault draws its steps with it; leave it 0.5"),
        ("index", fault.index is not None and bool(fault.schedule),
         "a schedule names each strike's element; leave it unset"),
        ("elements", fault.elements != 1 and bool(fault.schedule),
         "a schedule names each strike's element; leave it 1"),
        ("tensor", fault.tensor != "*" and bool(fault.schedule),
         "a schedule names each strike's tensor; leave it '*'"),
        ("follows", fault.follows != "hardware" and fault.scope == "reduction",
         "a broken reduction is one node's hardware, whatever data it sums; leave it hardware"),
        ("probability", fault.probability != FaultConfig.probability and bool(fault.schedule),
         "a schedule names each strike's step; leave it 0.5"),
        ("persistence", fault.persistence != "transient" and bool(fault.schedule),
         "a schedule names each strike's step; leave it transient"),
        ("steps", len(fault.steps) > 1 and fault.persistence != "transient",
         f"{'an' if fault.persistence == 'intermittent' else 'a'} {fault.persistence} fault "
         "strikes from its first step on and reads no other; give one step"),
        ("schedule", inner not in ("bitflip", "stuck", "defective_unit")
         and any(e.get("bit") is not None for e in fault.schedule),
         f"model {inner} changes no chosen bit; leave the entries' bit unset"),
        ("schedule", len({(e["step"], e["rank"], e["tensor"], e["index"]) for e in fault.schedule})
         < len(fault.schedule), "two entries strike one element at one step (a bit flipped "
         "twice is restored, and the fault recorded as never striking); list each once"),
    ]  # fmt: skip
    for name, refused, why in ignored:
        if refused:
            raise ConfigError(f"{key}.{name}", why)


# The sites whose tensors hold the workload's dtype, with the moments of the built-in workloads'
# AdamW (made like their weights). A module site's outputs and products may be 16-bit where it
# is float32 (autocast's products) or float32 where it is 16-bit (attention's scores), the loss
# is float32 from 16-bit scores, and a user's optimizer may keep float32 moments: their values
# are checked in the dtypes a forward trace or a stepped optimizer records
# (harness/config/fault_targets.py).
IN_WORKLOAD_DTYPE = ("grad", "allreduce", "weight", "gather")


def _in_workload_dtype(site: str, workload: WorkloadConfig) -> bool:
    return site in IN_WORKLOAD_DTYPE or (site == "optimizer" and workload.name != "custom")


# The one element of the loss: nothing to exchange, and its range is that element.
ONE_ELEMENT = {"loss"}


def _changes_a_value(
    key: str, values: dict[str, Any], site: str, model: str, workload: WorkloadConfig
) -> None:
    """A fault that would store every element unchanged, or another value than its record
    says, could never strike as configured."""
    if site in ONE_ELEMENT and (model == "swap" or values["value"] == "random"):
        what = "swap exchanges two elements" if model == "swap" else "random draws within its range"
        raise ConfigError(f"{key}.site", f"{what}, and the {site} is one element")
    if not _in_workload_dtype(site, workload):
        return
    if model == "burst" and values.get("burst_model"):
        model = values["burst_model"]  # a burst corrupts each of its elements with it
    factor = values["factor"]
    least = unchanging_scale(workload.dtype)
    if model == "scale" and factor is not None and 0 < abs(factor - 1) < least:
        raise ConfigError(
            f"{key}.factor",
            f"{factor:g} rounds back to every element in {workload.dtype}: the fault could "
            f"never strike; allowed: |factor - 1| >= {least:g}",
        )
    lost = unstored(values["value"], workload.dtype) if model == "value" else None
    if lost is not None:
        stored, allowed = lost
        raise ConfigError(
            f"{key}.value",
            f"{values['value']} is stored as {stored:g} in {workload.dtype}; allowed: {allowed}",
        )


def _index_placed(
    key: str, values: dict[str, Any], site: str, model: str, topology: TopologyConfig
) -> None:
    """`index` places the fault's first element among the named tensors' elements, which a
    module site knows only when its forward runs, and a sharded rank only when its shard is at
    hand: there one tensor is drawn and its elements in it (a grouped model takes the index as
    its first within that tensor), so an index would be ignored."""
    chosen = injectors.model_class(model)
    # A grouped model places its group at the index; a per-product one refuses it itself.
    if values["index"] is None or chosen.grouped or chosen.per_product:
        return
    if site in sites.MODULE_SITES:
        raise ConfigError(
            f"{key}.index", f"site {site} draws its elements when the module's forward runs; "
            "leave it unset (fault.tensor names the module)"
        )  # fmt: skip
    if topology.sharded and site in sites.SHARD_HELD:
        raise ConfigError(
            f"{key}.index", f"under {topology.parallel}, site {site} draws its elements in the "
            "rank's own shard when it is at hand; leave it unset, or name the element in "
            "fault.schedule"
        )  # fmt: skip


def _parallel_fault(key: str, values: dict[str, Any], site: str, topology: TopologyConfig) -> None:
    """A fault that the world's `topology.parallel` has a site for."""
    parallel = topology.parallel
    if not topology.sharded:
        if site == injectors.GATHER:
            raise ConfigError(
                f"{key}.site", "gather is sharded training's all-gather; it needs "
                "topology.parallel=fsdp or hsdp (this world is ddp)"
            )  # fmt: skip
        return
    if injectors.model_class(values["model"]).contribution:
        raise ConfigError(
            f"{key}.model", f"a contribution model changes what a rank sends into the ddp "
            f"reduction; under {parallel} allowed: an element model (scale, bitflip, value, ...)"
        )  # fmt: skip
    if values["bucket"] is not None:
        raise ConfigError(f"{key}.bucket", f"{parallel} has no buckets; leave it null")


def unused_fault(
    campaign: str, raw: dict[str, Any], workload: WorkloadConfig, topology: TopologyConfig
) -> None:
    """A campaign with scenarios of its own ignores `fault.*`: refuse an override there."""
    given, settings = _split("fault", raw, list(injectors.available_models()))
    site = _fault_site("fault.site", given.get("site", "none"))
    ignored = _ignored(_fault_values("fault", given, workload, topology, site), given)
    ignored = ignored or next(iter(settings), None)
    if ignored is not None:
        raise ConfigError(
            "campaign",
            f"'{campaign}' runs its campaign.scenarios and ignores fault.{ignored}="
            f"{raw[ignored]}; use campaign=single to run that fault",
        )


def _shape(key: str, values: dict[str, Any], site: str, model: str) -> None:
    """A burst's sub-model and stride, a matmul fault's pass; grouped models
    (swap, burst) draw their own positions, so they take no schedule and no `largest`."""
    if values.get("burst_model") is not None and model != "burst":
        raise ConfigError(f"{key}.burst_model", "only model burst has a sub-model; leave it null")
    values["stride"] = integer(f"{key}.stride", values.get("stride", 1), 1)
    if values["stride"] != 1 and model != "burst":
        raise ConfigError(f"{key}.stride", "only model burst has a stride; leave it 1")
    values["phase"] = choice(f"{key}.phase", values.get("phase", "forward"), MATMUL_PHASES)
    if values["phase"] != "forward" and site != "matmul":
        raise ConfigError(f"{key}.phase", "only site matmul has a backward phase; leave it forward")
    values["product"] = integer(f"{key}.product", values.get("product", 1), 1)
    if values["product"] != 1 and site != "matmul":
        raise ConfigError(f"{key}.product", "only site matmul picks a product; leave it 1")
    if model in ("swap", "burst"):
        for name, unset in (("schedule", ()), ("select", "random")):
            if values.get(name, unset) not in (unset, None, ()):
                raise ConfigError(
                    f"{key}.{name}", f"model {model} draws its own group; leave it unset"
                )


def _schedule(
    key: str, raw: Any, workload: WorkloadConfig, topology: TopologyConfig, width: int
) -> tuple[dict[str, Any], ...]:
    """An explicit list of injections: {step, rank, tensor, index[, bit]} each, a bit among
    `width`."""
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple):  # 0 or false read as no schedule; 5 raised TypeError
        raise ConfigError(key, f"'{raw}' is not a list of {{step, rank, tensor, index[, bit]}}")
    entries = []
    for i, entry in enumerate(raw):
        k = f"{key}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(k, "each entry is {step, rank, tensor, index[, bit]}")
        known_keys(f"{k}.", entry, ["step", "rank", "tensor", "index", "bit"])
        clean = {
            "step": integer(f"{k}.step", entry.get("step"), 0, workload.steps - 1),
            "rank": integer(f"{k}.rank", entry.get("rank"), 0, topology.world_size - 1),
            "tensor": str(entry.get("tensor")),
            "index": integer(f"{k}.index", entry.get("index"), 0),
        }
        if entry.get("bit") is not None:
            clean["bit"] = integer(f"{k}.bit", entry["bit"], 0, width - 1)
        entries.append(clean)
    return tuple(entries)


def _value_name(value: Any) -> str:
    """Hydra reads `nan` and `inf` as floats; the table and the model keep them as names."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value).strip().lower()


def expand_scenarios(
    raw: list[dict[str, Any]], width: Callable[[int, dict[str, Any]], int]
) -> list[tuple[int, dict[str, Any]]]:
    """Each scenario may carry `grid: {key: [values]}`; it expands to the cross product.
    `grid: {bit: all}` is every bit of the dtype each expanded scenario strikes, `width(i,
    scenario)` bits (the workload's dtype, or under a mixed precision a module's 16-bit output
    or product), so one campaign file serves every dtype and precision."""
    expanded = []
    for i, scenario in enumerate(raw):
        scenario = dict(scenario)
        grid = dict(scenario.pop("grid", None) or {})
        every_bit = grid.get("bit") == "all"
        if every_bit:
            grid["bit"] = list(range(64))  # each scenario's past its width left out below
        for key, values in grid.items():
            if not isinstance(values, list | tuple):
                raise ConfigError(
                    f"campaign.scenarios[{i}].grid.{key}",
                    f"'{values}' is not a list of values" + ("; or 'all'" if key == "bit" else ""),
                )
        keys = list(grid)
        widths: dict[str, int] = {}
        for combo in itertools.product(*(grid[k] for k in keys)):
            chosen = {**scenario, **dict(zip(keys, combo, strict=True))}
            if every_bit:
                rest = {k: v for k, v in chosen.items() if k != "bit"}
                known = widths.setdefault(repr(sorted(rest.items())), width(i, rest))
                if chosen["bit"] >= known:
                    continue
            expanded.append((i, chosen))
    return expanded
