"""What a run is, as plain frozen dataclasses: every layer reads these, and ranks receive them
instead of an OmegaConf object. Built and checked from the composed Hydra config by
harness/config/load.py; this module imports neither torch nor any other part of the harness.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

from harness.core.checks import CheckConfig
from harness.core.matmuls import ForwardModules
from harness.core.settings import Settings
from harness.core.vocabulary import Parallel, Persistence, Scope, Site

SCOPES = tuple(s.value for s in Scope)
SITES_WITH_SCOPE = {Site.ALLREDUCE.value: SCOPES}
PERSISTENCE = tuple(p.value for p in Persistence)
SELECT = ("random", "largest")
MATMUL_PHASES = ("forward", "backward")
WORKLOADS = ("mlp", "gpt", "llama", "custom")
# Lightning's precision names: (the weights' dtype, autocast's dtype or None).
PRECISIONS = {
    "32-true": ("float32", None),
    "bf16-true": ("bfloat16", None),
    "16-true": ("float16", None),
    "bf16-mixed": ("float32", "bfloat16"),
}
LR_SCHEDULES = ("constant", "warmup_cosine")
CUSTOM_TARGETS = ("model", "data", "loss", "optimizer")
BACKENDS = ("gloo", "nccl")
LAUNCHERS = ("spawn", "torchrun")


@dataclass(frozen=True)
class WorkloadConfig:
    name: str
    steps: int
    dtype: str
    seed: int
    micro_batches: int
    micro_batch_size: int
    lr: float
    # mlp
    in_dim: int = 64
    hidden: int = 256
    classes: int = 10
    # gpt and llama
    vocab: int = 128
    context: int = 64
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    # llama: key-value heads (grouped-query attention) and the feed-forward width; None: heads,
    # and 8/3 of d_model rounded up to a multiple of 8, as Llama sizes it
    kv_heads: int | None = None
    intermediate: int | None = None
    # The recipe: Lightning's precision name (set from dtype when not given), clipping of the
    # gradient's global norm, the learning-rate schedule, and (built-in workloads) AdamW's betas
    # and weight decay, torch's defaults when not given.
    precision: str | None = None
    clip_grad_norm: float | None = None
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    betas: tuple[float, float] | None = None
    weight_decay: float | None = None
    # custom: Hydra targets the user names (instantiated from their config, never from results)
    model: dict | None = None  # the nn.Module
    data: dict | None = None  # (seed, step, rank, micro_batch, size) -> (inputs, targets)
    loss: dict | None = None  # (outputs, targets) -> scalar
    optimizer: dict | None = None  # partial: (params) -> optimizer

    @property
    def autocast(self) -> str | None:
        """The dtype forward runs in under autocast (a mixed precision), or None."""
        return PRECISIONS[self.precision or "32-true"][1]

    def lr_factor(self, step: int) -> float:
        """The learning rate at `step`, as a fraction of the optimizer's own: a linear warmup
        over warmup_steps up to the full rate, then a cosine from it down to min_lr_ratio at the
        last step. A function of the
        step alone, so fast-forward, recovery and resume need no scheduler state."""
        if self.lr_schedule == "constant":
            return 1.0
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        peak = max(self.warmup_steps - 1, 0)  # the last warmup step, at the full rate
        progress = min((step - peak) / max(self.steps - 1 - peak, 1), 1.0)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (
            1 + math.cos(math.pi * progress)
        )

    def imports(self) -> tuple[str, ...]:
        """The packages its ranks import beyond the harness and torch (the rank server imports
        them once, harness/launch/rank_server.py)."""
        targets = [spec["_target_"] for spec in (self.model, self.data, self.loss, self.optimizer)
                   if spec and "_target_" in spec]  # fmt: skip
        roots = {str(t).split(".")[0] for t in targets} - {"harness", "torch"}
        if self.name == "llama":
            roots.add("transformers")
        return tuple(sorted(roots))


PARALLEL = tuple(p.value for p in Parallel)


@dataclass(frozen=True)
class TopologyConfig:
    nodes: int
    ranks_per_node: int
    spares: int
    backend: str
    threads_per_rank: int | tuple[int, ...]
    collective_timeout_s: float
    trial_timeout_s: float
    # The CPU kernels every rank is pinned to (harness.runtime.environment): rows reproduce on any
    # machine that has them; `native` lets each machine choose its own.
    cpu_kernels: str = "avx2"
    # How CPU ranks compute 16-bit matrix products (harness/runtime/numerics.py): `emulated` as a
    # GPU's tensor cores do, through float32 kernels, or `native`; None resolves per device.
    cpu_numerics: str | None = None
    startup_timeout_s: float = 60.0
    # How the world trains (harness/runtime/sharding.py): ddp replicas, fsdp (FSDP2's
    # fully_shard over the world) or hsdp (replicas of `shard_size`-rank shard groups).
    parallel: str = "ddp"
    shard_size: int | None = None
    # cpu or cuda (harness/runtime/devices.py); None until resolved on the machine that runs the
    # ranks.
    device: str | None = None
    # Set by validation, not a key: a check compares replays bit for bit on cuda, so the ranks
    # fix what GPU recomputation needs before NCCL and cuBLAS start
    # (harness/runtime/determinism.py).
    deterministic: bool = False

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def sharded(self) -> bool:
        return self.parallel != "ddp"

    @property
    def shard_group(self) -> int | None:
        """Ranks that split each parameter between them: the world under fsdp, `shard_size`
        under hsdp; None for replicas."""
        if not self.sharded:
            return None
        return self.shard_size if self.parallel == "hsdp" else self.world_size

    def threads(self, rank: int) -> int:
        if isinstance(self.threads_per_rank, int):
            return self.threads_per_rank
        return self.threads_per_rank[rank]


# A fault's settings that trials.csv holds in no column of their own (site, model, bit, factor,
# value, scope, persistence, ranks, steps, phase and schedule have theirs, or their steps'):
# `FaultConfig.settings_text` writes them into `fault_settings`.
OWN_SETTINGS = (
    "probability", "tensor", "index", "elements", "select", "nbits", "adjacent", "stuck_at",
    "ber", "bucket", "follows", "burst_model", "stride", "product",
)  # fmt: skip


@dataclass(frozen=True)
class FaultConfig:
    site: str = "none"
    model: str = "none"
    bit: int | str | None = None
    factor: float | None = None
    value: str | None = None
    scope: str | None = None
    ranks: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    persistence: str = "transient"
    probability: float = 0.5
    tensor: str = "*"
    index: int | None = None
    elements: int = 1
    select: str = "random"
    nbits: int = 1
    adjacent: bool = True
    stuck_at: int | None = None
    ber: float | None = None
    schedule: tuple[dict[str, Any], ...] = ()
    bucket: int | None = None
    follows: str = "hardware"
    # A burst's sub-model and stride, a matmul fault's pass and product.
    burst_model: str | None = None
    stride: int = 1
    phase: str = "forward"
    product: int = 1  # site matmul: the K-th product made while the target runs, 1-based
    # The model's own keys (its `Config`, injectors/model.py), parsed.
    settings: Settings = Settings()

    @property
    def clean(self) -> bool:
        return self.site == "none"

    @property
    def first_step(self) -> int:
        """The first step at which this fault can strike (0 for a clean trial): until then a
        trial is its golden run."""
        if self.clean:
            return 0
        steps = [e["step"] for e in self.schedule] or list(self.steps)
        # A stale contribution is the previous step's: the trial must run that step too.
        return max(min(steps, default=0) - (self.model == "stale"), 0)

    def label(self) -> str:
        if self.clean:
            return "clean"
        parts = [self.site, self.model]
        if self.bit is not None:
            parts.append(f"b{self.bit}" if isinstance(self.bit, int) else self.bit)
        if self.factor is not None:
            parts.append(f"x{self.factor:g}")
        if self.value is not None:
            parts.append(self.value)
        if self.stuck_at is not None:
            parts.append(f"at{self.stuck_at}")
        if self.burst_model is not None:
            parts.append(f"{self.burst_model}k{self.elements}")
            if self.stride > 1:
                parts.append(f"s{self.stride}")
        if self.phase != "forward":
            parts.append(self.phase)
        if self.product != 1:
            parts.append(f"p{self.product}")
        if self.nbits > 1:
            parts.append(f"n{self.nbits}{'adj' if self.adjacent else 'rnd'}")
        if self.ber is not None:
            parts.append(f"ber{self.ber:g}")
        if self.select != "random":
            parts.append(self.select)
        if self.scope:
            parts.append(self.scope)
        if self.schedule:
            parts.append("schedule")
        elif self.persistence != "transient":
            parts.append(self.persistence)
        # A model's settings away from their defaults, as `factor` is: `delta1e+06`.
        parts += [f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}"
                  for k, v in self.model_settings().items()]  # fmt: skip
        return "-".join(parts)

    def model_settings(self) -> dict[str, Any]:
        """The model's own settings that are away from their defaults."""
        defaults = type(self.settings)().params()
        return {k: v for k, v in self.settings.params().items() if v != defaults[k]}

    def settings_text(self) -> str:
        """Every setting away from its default that no trials.csv column of its own holds
        (`OWN_SETTINGS`, then the model's; a campaign's faults hold none that they would
        ignore, harness/config/faults.py), numbers in their exact shortest form: what else
        tells two scenarios of one site, model and bit class apart ("tensor=blocks.0.fc
        nbits=2"); blank for a clean trial. A schedule reads as its number of strikes and a
        checksum of its entries ("schedule=3@5e1f0a2c")."""
        if self.clean:
            return ""
        plain = FaultConfig()
        changed = {
            k: getattr(self, k) for k in OWN_SETTINGS if getattr(self, k) != getattr(plain, k)
        }
        changed |= self.model_settings()
        words = [f"{k}={v}" for k, v in changed.items()]  # a float's str is its shortest repr
        if self.schedule:
            entries = json.dumps(self.schedule, sort_keys=True).encode()
            words.append(f"schedule={len(self.schedule)}@{zlib.crc32(entries):08x}")
        return " ".join(words)


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int
    keep: bool

    def after(self, step: int) -> bool:
        """Whether a trial writes a checkpoint after `step` (harness/runtime/trainer.py)."""
        return (step + 1) % self.interval == 0


@dataclass(frozen=True)
class Segment:
    """Where a trial resumes after a recovery, and on which hardware.

    `hardware[r]` is the original rank whose machine new rank r runs on (-1: a healthy spare);
    `data[r]` lists the original ranks whose micro-batches new rank r trains on, so the global
    batch stays the same when the world shrinks. `struck`: the steps at which the fault struck
    in the earlier segments.
    """

    start_step: int
    checkpoint: str
    hardware: tuple[int, ...]
    data: tuple[tuple[int, ...], ...]
    struck: tuple[int, ...] = ()

    def unmet(self, fault: FaultConfig) -> FaultConfig:
        """`fault` as this segment meets it: a transient fault on hardware struck once, so the
        re-execution of its step after a rollback does not meet it again, on the same machine
        or another (one that follows the data does: the data is still what it was)."""
        if fault.persistence != "transient" or fault.follows != "hardware" or not self.struck:
            return fault
        return replace(
            fault,
            steps=tuple(s for s in fault.steps if s not in self.struck),
            schedule=tuple(e for e in fault.schedule if e["step"] not in self.struck),
        )


def golden_id(seed: int) -> str:
    return f"golden-s{seed}"


@dataclass(frozen=True)
class FaultClass:
    """A scenario's place in a weighed mix of faults (`campaign=field_mix`): the class it
    samples, and the class's weight, its share of the SDC a fleet sees (harness/config/mix.py)."""

    name: str
    weight: float


@dataclass(frozen=True)
class TrialSpec:
    trial_id: str
    seed: int
    fault: FaultConfig
    golden: bool = False
    segment: Segment | None = None
    # Golden runs only: the steps after which to save a fast-forward snapshot.
    snapshots: tuple[int, ...] = ()
    # The checks with this trial's parameters, when its scenario changes them (None: the run's).
    checks: dict[str, CheckConfig] | None = None
    # False: plain DDP without the harness's comm hook (overhead's outermost reference).
    hook: bool = True
    # The fault class the trial samples, in a campaign that weighs its faults (None: unweighed).
    mix: FaultClass | None = None


@dataclass(frozen=True)
class OverheadConfig:
    """`campaign.overhead`: clean timed runs after the trials (harness/campaign/overhead.py)."""

    steps: int  # timed steps per run, after the warm-up
    rounds: int = 1  # reference/detector sandwiches; overhead.csv keeps the median over rounds


@dataclass(frozen=True)
class RecoveryConfig:
    enabled: bool = False
    max_recoveries: int = 3


@dataclass(frozen=True)
class RunConfig:
    campaign: str
    workload: WorkloadConfig
    topology: TopologyConfig
    detectors: dict[str, CheckConfig]
    checkpoint: CheckpointConfig
    seeds: int
    noise_seeds: int
    scenarios: tuple[FaultConfig, ...]
    launcher: str = "spawn"
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    trials: tuple[TrialSpec, ...] = field(default=())
    fast_forward: bool = True
    overhead: OverheadConfig | None = None
    # What the workload's forward runs, traced when the config was validated, where a scenario's
    # fault strikes a module (sites activation and matmul): the targets it may draw from.
    forward: ForwardModules | None = None
    # The golden store's folder (harness/campaign/golden_store.py); None: every golden runs.
    # Where goldens come from never changes a row, so it is not part of a campaign's identity.
    golden_cache: str | None = None

    @property
    def reference_seeds(self) -> range:
        """The golden runs whose spread is the harm threshold: a fixed set, not the trial seeds."""
        return range(self.workload.seed, self.workload.seed + self.noise_seeds)

    def checks(self, spec: TrialSpec) -> dict[str, CheckConfig]:
        """The checks of one trial: the run's, with its scenario's parameters."""
        return self.detectors if spec.checks is None else spec.checks
