"""`workload`: the model, data and training recipe, validated in the Hydra process before any
rank starts. A built-in workload's keys are checked against what it can train; a custom one
(`workload=custom`) is imported and run for one micro-batch here, so that a model that cannot
train, or whose data is not a pure function of (seed, step, rank, micro-batch), exits 2 with one
line instead of crashing every trial."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from harness.config.schema import (
    CUSTOM_TARGETS,
    LR_SCHEDULES,
    PRECISIONS,
    WORKLOADS,
    WorkloadConfig,
)
from harness.core import vocabulary
from harness.core.matmuls import ForwardModules, traced
from harness.core.values import choice, integer, known_keys, positive
from harness.errors import ConfigError
from harness.runtime.workloads import DTYPES, Workload

# The keys that describe one workload's model or data, by the workloads that read them: another
# workload never does (a `+workload.kv_heads=2` under gpt changed nothing).
SHAPE_KEYS = {
    "in_dim": ("mlp",), "hidden": ("mlp",), "classes": ("mlp",),
    **dict.fromkeys(("vocab", "context", "d_model", "layers", "heads"), ("gpt", "llama")),
    "kv_heads": ("llama",), "intermediate": ("llama",),
    **dict.fromkeys(("model", "data", "loss", "optimizer"), ("custom",)),
}  # fmt: skip
# The model's sizes among them: counts of units, positive integers.
SIZES = ("in_dim", "hidden", "classes", "vocab", "context", "d_model", "layers", "heads",
         "kv_heads", "intermediate")  # fmt: skip


def workload_config(raw: dict[str, Any]) -> WorkloadConfig:
    known_keys("workload.", raw, [f.name for f in fields(WorkloadConfig)])
    choice("workload.name", raw.get("name"), WORKLOADS)
    for key, readers in SHAPE_KEYS.items():
        if key in raw and raw["name"] not in readers:
            raise ConfigError(
                f"workload.{key}", f"workload {raw['name']} never reads it (only "
                f"{' and '.join(readers)}); leave it out"
            )  # fmt: skip
    choice("workload.dtype", raw.get("dtype"), tuple(DTYPES))
    integer("workload.steps", raw.get("steps"), 1)
    integer("workload.seed", raw.get("seed"), 0)
    integer("workload.micro_batches", raw.get("micro_batches"), 1)
    integer("workload.micro_batch_size", raw.get("micro_batch_size"), 1)
    positive("workload.lr", raw.get("lr"))
    for key in SIZES:  # a model of no width, no layer or no head trains nothing, or divides by 0
        if raw.get(key) is not None:
            integer(f"workload.{key}", raw[key], 1)
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
    if warmup >= raw["steps"]:
        # The rate would only climb: no cosine, and min_lr_ratio never read.
        raise ConfigError(
            "workload.warmup_steps", f"{warmup} leaves the cosine no step of the "
            f"{raw['steps']}-step run; allowed: 0..{raw['steps'] - 1}"
        )  # fmt: skip
    ratio = raw.get("min_lr_ratio", WorkloadConfig.min_lr_ratio)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
        raise ConfigError("workload.min_lr_ratio", f"'{ratio}' must be a number in [0, 1]")
    if raw.get("lr_schedule") != "warmup_cosine" and ratio != WorkloadConfig.min_lr_ratio:
        raise ConfigError(
            "workload.min_lr_ratio", "only the cosine ends at it: needs "
            f"workload.lr_schedule=warmup_cosine, or leave it {WorkloadConfig.min_lr_ratio}"
        )  # fmt: skip
    for key in ("betas", "weight_decay"):
        if raw.get(key) is not None and raw["name"] == "custom":
            raise ConfigError(
                f"workload.{key}", "a custom workload builds its own optimizer: set it on "
                "workload.optimizer"
            )  # fmt: skip
    optimizer = raw.get("optimizer") if raw["name"] == "custom" else None
    if isinstance(optimizer, dict) and "lr" in optimizer and optimizer["lr"] != raw.get("lr"):
        # The optimizer is built from workload.optimizer alone; workload.lr, which its lr
        # follows by default (${..lr}), would be recorded but never read.
        raise ConfigError(
            "workload.lr", f"{raw.get('lr')} is not the rate the custom optimizer takes "
            f"(workload.optimizer.lr={optimizer['lr']}), which a custom workload builds from "
            "workload.optimizer alone; allowed: set workload.lr only (workload.optimizer.lr "
            "follows it), or the two equal"
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
        if part != "model" and spec.get("_partial_") is not True:
            raise ConfigError(
                f"workload.{part}._partial_", f"'{spec.get('_partial_')}': the harness calls "
                f"{part} with its own arguments (experiments/workload/custom.yaml says which), "
                "so Hydra must make it a partial; allowed: true"
            )  # fmt: skip


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
        model = probe(cfg).model
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
        _every_parameter_trained(cfg, model)
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


def _every_parameter_trained(cfg: WorkloadConfig, model: nn.Module) -> None:
    """A trainable parameter the loss does not reach fails the ranks' training: DDP (no
    `find_unused_parameters`) raises at the next step, and FSDP2's reduce-scatter leaves it out
    of the fixed layout (harness/runtime/sharding.py). Frozen, it trains as intended."""
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        raise ConfigError(
            "workload.model", f"'{cfg.model['_target_']}' leaves {', '.join(unused[:4])}"
            f"{' ...' if len(unused) > 4 else ''} without a gradient in a dry step of one "
            "micro-batch: data-parallel training refuses a parameter the loss does not reach; "
            "freeze it (requires_grad_(False)) or leave it out of the model"
        )  # fmt: skip


MODULE_SITES = tuple(s.value for s in vocabulary.MODULE_SITES)


def forward_modules(cfg: WorkloadConfig) -> ForwardModules:
    """What one forward of micro-batch 0 runs, on the CPU, in this process: the modules an
    activation or a matmul fault can strike (harness/core/matmuls.py)."""
    built = probe(cfg)
    if built.forward is None:
        workload = Workload(cfg)
        batch = workload.batch(0, 0, 0)
        with torch.no_grad(), workload.forward_rng(0, 0, 0):
            built.forward = traced(built.model, lambda: workload.loss(built.model, batch))
    return built.forward


@dataclass
class Probe:
    """The command's one model of a workload, on the CPU: a custom workload's dry step trains it
    one step and the fault checks read its parameters' names and shapes (any other workload's
    come from `meta`), the forward trace runs it (`forward`, once traced), and the campaign
    counts its products (harness/campaign/coverage.py). A user's model is then built once in
    the command's process, whatever validation and campaign.json need of it; none of these
    reads its values as they were at initialisation."""

    model: nn.Module
    forward: ForwardModules | None = None


# Keyed by the workload's repr: a custom workload's targets are dicts, which do not hash.
_probes: dict[str, Probe] = {}


def probe(cfg: WorkloadConfig) -> Probe:
    """The workload's one model in this process, built on first use."""
    key = repr(cfg)
    if key not in _probes:
        _probes[key] = Probe(Workload(cfg).build_model())
    return _probes[key]


def release_probes() -> None:
    """This process is done with its validation's models: a rank trains a model of its own."""
    _probes.clear()
