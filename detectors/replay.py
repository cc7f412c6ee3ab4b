"""`replay`: the second published check. On audit steps each rank regenerates the micro-batches
of a rank on the next node (ring shift by ranks_per_node), recomputes loss and gradient with its
own replica, and the ranks compare what they recomputed with what each rank computed itself.
On a mismatch a rank on a third node recomputes the same micro-batches, and the majority of the
three names the suspect: the rank that computed it (its own result is the odd one out) or the
rank that replayed it. The mismatched rank also recomputes its own micro-batches: when no two of
the four results agree, not even the rank with itself, the forward does not reproduce (a
non-deterministic op), which is no evidence against any rank: replay warns "not deterministic"
instead of alerting.

The gradient is compared through a fingerprint: one projection onto fixed +1/-1 signs per
parameter, summed in name order, plus its L2 norm. `exact` mode compares bit patterns of loss
and projection (needs deterministic compute); `tolerant` mode allows a relative difference of
`rtol` (of the loss, and of the gradient's L2 norm): float32's is calibrated on clean runs, the
16-bit dtypes' is derived (`derived_rtol`) and checked against clean runs.

Where the micro-batches come from is `ctx.replay_data`'s business: in campaigns (None) any rank
regenerates any other's from the workload (`Regenerated`); in a user's loop the guard ships the
batch each rank trained on to the ranks that replay it (harness/runtime/batch_exchange.py). Both
offer `ship` (every rank calls it with the same routes before the batches are needed), `losses`
(each micro-batch's loss, computed under the random state its own rank computed it under, so
dropout masks the same elements) and `backpropagated` (what the loop backpropagates of such a
loss: divided by the step's count of micro-batches, or however the user's trainer scales it).

Replay never disturbs training: gradients come from torch.autograd.grad (param.grad is never
touched) and `losses` draws from forked generators, so a clean run with replay on ends bit-
identical to one without. Its floor is one forward and backward of the audited rank's micro-
batches per audit.

Cost per step (sdc-plan): bytes = B*N/k, flops = 0, train = 6*N*t/k: one forward and backward again
every k steps, and a fingerprint of its gradient (the symbols: harness/analysis/estimates.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from detectors.fingerprint import signs
from harness.core import inflight
from harness.core.checks import CheckConfig, looks_at_multiples
from harness.core.plugins import Bucket, Detector, DetectorContext, EventLog
from harness.core.values import choice, fraction, int_list, integer
from harness.errors import ConfigError

# Slots of the exchanged row: own loss, own projection, own norm, then the same for the replay.
_OWN, _REPLAY = 0, 3
# How a mismatch is judged: a third node's majority, or Megatron-LM's rerun flow.
VERDICTS = ("majority", "megatron")
COMPARES = ("tolerant", "exact")
DEFAULT_INTERVAL = 5  # steps between audits where neither interval nor steps is given


class Regenerated:
    """Campaigns: every micro-batch is a pure function of (seed, step, rank, micro-batch), so a
    replaying rank makes its own copy and nothing travels."""

    def __init__(self, ctx: Any):
        self.ctx = ctx

    def backpropagated(self, loss: torch.Tensor, rank: int) -> torch.Tensor:
        return loss / self.ctx.divisor

    def ship(self, step: int, routes: list[tuple[int, int]]) -> None:
        """Nothing to ship: (source, destination) routes are regenerated at the destination."""

    def losses(self, model: nn.Module, step: int, rank: int) -> Iterator[torch.Tensor]:
        """Each of `rank`'s micro-batch losses at `step`, computed on `model`, one at a time, each
        under its micro-batch's random state (harness/runtime/workloads.py, `forward_rng`): the
        caller's backward of a loss runs before the next is computed, inside that state."""
        workload = self.ctx.workload
        for source, m in self.ctx.batches(rank):
            with workload.forward_rng(step, source, m):
                yield workload.loss(model, workload.batch(step, source, m))


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a step's backward gives gradients to, by name: not a frozen one (a
    fine-tuned model's backbone, LoRA's base weights), by which autograd refuses to
    differentiate."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def gradients(loss: torch.Tensor, params: Sequence[nn.Parameter]) -> tuple[torch.Tensor, ...]:
    """d loss / d params, recomputed; zeros for a parameter the step did not use (DDP with
    find_unused_parameters), as DDP's bucket holds for it, where autograd would refuse."""
    return torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)


def as_sent(grads: list[torch.Tensor], divided_by: float) -> list[torch.Tensor]:
    """The recomputed gradient as the checks saw the step's own: divided where the collective's
    input was divided before them (`Bucket.divided_by`, FSDP2's float16 pre-divide), by the same
    division in the same dtype, so bit for bit. Compared undivided, every replay of a float16
    FSDP step differed from its own by that factor."""
    return grads if divided_by == 1 else [g / divided_by for g in grads]


class Replay(Detector):
    name = "replay"
    recomputes_batches = True
    parallel = ("ddp", "fsdp", "hsdp")

    @dataclass(frozen=True)
    class Config(CheckConfig):
        resets = {"steps": ("interval",), "interval": ("steps",), "compare": ("rtol",)}
        interval: int | None = None  # audit every N steps (step % N == 0; None: 5) ...
        steps: tuple[int, ...] | None = None  # ... or exactly these steps, in its place
        compare: str = "tolerant"  # exact: bit patterns (needs deterministic compute)
        rtol: float | None = None  # tolerant; None: 1e-5 in float32, derived for 16 bits
        verdict: str = "majority"

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.steps is None:
                every = DEFAULT_INTERVAL if self.interval is None else self.interval
                self._normalise("interval", integer("interval", every, 1))
            elif self.interval is not None:
                # Either would be obeyed silently over the other.
                raise ConfigError(
                    "steps", "listed steps replace the interval: give one of interval and steps"
                )
            else:
                self._normalise("steps", int_list("steps", self.steps, 0, 2**31 - 1))
            choice("compare", self.compare, COMPARES)
            if self.rtol is not None:
                fraction("rtol", self.rtol, ", or null for the dtype's default")
                if self.compare == "exact":
                    raise ConfigError("rtol", "only compare=tolerant reads it; leave it null")
            choice("verdict", self.verdict, VERDICTS)

        @property
        def every(self) -> int | None:
            return self.interval if self.steps is None else None

    @classmethod
    def check_steps(cls, key: str, config: Config, steps: int) -> None:
        past = [s for s in config.steps or () if s >= steps]
        if past:
            raise ConfigError(
                f"{key}.steps", f"{past[0]} is past the run's last step; allowed: 0..{steps - 1}"
            )

    @classmethod
    def looks_from(cls, config: Config, start_step: int) -> bool:
        return config.steps is None or max(config.steps) >= start_step

    @classmethod
    def looks(cls, config: Config, steps: range, checkpointed: Callable[[int], bool]) -> int:
        """Counted: listed steps in `steps`, or its audits there (a window of steps measured
        holds a whole number of them, which its length over the interval need not be)."""
        if config.steps is not None:
            return sum(s in steps for s in config.steps)
        return looks_at_multiples(config.interval, steps)

    @classmethod
    def check_topology(cls, config: Config, topology: Any) -> None:
        if topology.nodes < 3:
            raise ConfigError(
                "topology.nodes", f"replay needs at least 3 nodes; got {topology.nodes}"
            )

    @classmethod
    def compares_bits(cls, config: Config) -> bool:
        return config.compare == "exact"

    @classmethod
    def first_suspect_step(
        cls, config: Config, alarm_step: int, checkpointed: Callable[[int], bool]
    ) -> int:
        """The step before the last audit before the alarm: an audit vouches for the weights its
        step began with and what the step computed from them, not for that step's update, nor
        for the optimizer state the step before left (Adam's moments, which reach the weights
        at the audited step's update): their corruption shows at the next audit."""
        audits = config.steps or range(0, alarm_step, config.interval)
        earlier = [s for s in audits if s < alarm_step]
        return max(max(earlier) - 1, 0) if earlier else 0

    def __init__(self, config: Config, ctx: DetectorContext, log: EventLog):
        super().__init__(config, ctx, log)
        self.data = ctx.replay_data or Regenerated(ctx)
        # The dtype the products round to: autocast's under a mixed precision (the weights stay
        # float32, but every product, and so the gradient, carries 16-bit rounding).
        workload = ctx.workload
        dtype = (workload and workload.autocast) or next(ctx.model.parameters()).dtype
        # Calibrated on clean runs with 1 and 2 threads per rank: float32 replays differ by up to
        # 2e-7 of the gradient norm, bfloat16 up to 1.1e-2 (every partial sum rounds to 8 bits).
        self.rtol = config.rtol or (1e-5 if dtype == torch.float32 else derived_rtol(dtype))
        self.device = torch.device(ctx.info.device)
        # This step's own loss (summed over its micro-batches, `own_count` of them), projections
        # and squared norm, on the device until the audit.
        self.own_loss: float | torch.Tensor = 0.0
        self.own_count = 0
        self.own_dots: dict[str, torch.Tensor] = {}
        self.own_sq: float | torch.Tensor = 0.0
        self.divided_by: float = 1

    def _audited(self, step: int) -> bool:
        if self.config.steps is not None:
            return step in self.config.steps
        return step % self.config.interval == 0

    def on_loss(self, step: int, loss: torch.Tensor) -> None:
        if self._audited(step):
            self.own_loss = self.own_loss + loss.detach().double()
            self.own_count += 1
        return None

    def on_local_grad(self, step: int, bucket: Bucket) -> None:
        if not self._audited(step):
            return
        self.divided_by = bucket.divided_by
        for name, grad in bucket.tensors:
            dot, sq = _project_on_device(name, grad)
            self.own_dots[name] = dot
            self.own_sq = self.own_sq + sq

    def _recompute(self, model: nn.Module, step: int, rank: int) -> tuple[float, float, float]:
        """Loss, projection and norm of `rank`'s local gradient, recomputed on `model`."""
        loss, dots, sq = self._recompute_on_device(model, step, rank)
        values = self.read(torch.stack([loss, *dots.values(), sq]))
        return values[0], _fold(dict(zip(dots, values[1:-1], strict=True))), math.sqrt(values[-1])

    def _recompute_on_device(
        self, model: nn.Module, step: int, rank: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Loss, per-parameter projections and squared norm of `rank`'s local gradient,
        recomputed on `model`, unread."""
        names, params = zip(*trainable(model), strict=True)
        total_loss, grads, count = 0.0, None, 0
        for loss in self.data.losses(model, step, rank):
            part = gradients(self.data.backpropagated(loss, rank), params)
            grads = (
                list(part) if grads is None else [a + b for a, b in zip(grads, part, strict=True)]
            )
            total_loss, count = total_loss + loss.detach().double(), count + 1
        total_loss = total_loss / count
        dots, sq = {}, 0.0
        for name, g in zip(names, as_sent(grads, self.divided_by), strict=True):
            dots[name], part = _project_on_device(name, g)
            sq = sq + part
        return total_loss, dots, sq

    def _same(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Two (loss, projection, norm) triples agree. Rounding differences between replicas
        move a +1/-1 projection like a random walk, about rtol * ||g||; the smaller norm sets
        the scale, so a corrupted (huge) gradient cannot widen its own tolerance."""
        if self.config.compare == "exact":
            return bool(torch.equal(a[:2], b[:2]))
        return agree(a.tolist(), b.tolist(), self.rtol)

    def on_audit(self, step: int) -> None:
        if not self._audited(step):
            return
        world, per_node = self.info.world_size, self.info.ranks_per_node
        peer = (self.info.rank + per_node) % world
        self.data.ship(step, [(p, (p - per_node) % world) for p in range(world)])
        model = self.ctx.replica(step)
        # Unfolded, on the device: every rank's own and replayed projections come back in one
        # read, and are folded exactly (math.fsum) on the host.
        loss, dots, sq = self._recompute_on_device(model, step, peer)
        own_loss = self.own_loss / max(self.own_count, 1)
        own = [own_loss, *(self.own_dots[n] for n in dots), self.own_sq]
        row = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device)
                           for v in (*own, loss, *dots.values(), sq)])  # fmt: skip
        self.own_loss, self.own_count, self.own_dots, self.own_sq = 0.0, 0, {}, 0.0
        width = len(dots) + 2
        table = [
            torch.tensor(_triple(values[:width], dots) + _triple(values[width:], dots),
                         dtype=torch.float64)
            for values in self.read(torch.stack(_gather(row, world)))
        ]  # fmt: skip
        # table[r] holds r's own result and r's replay of rank r + per_node.
        mismatched = [
            p for p in range(world)
            if not self._same(table[p][_OWN:_OWN + 3], table[(p - per_node) % world][_REPLAY:])
        ]  # fmt: skip
        if not mismatched:
            return
        # Tie-break: the rank one node further on recomputes each mismatched rank's work, and
        # each mismatched rank its own again; both come back in one gather.
        self.data.ship(step, [(p, (p + per_node) % world) for p in mismatched])
        again = torch.zeros(world, 3, dtype=torch.float64)
        if self.info.rank in mismatched:
            again[self.info.rank] = torch.tensor(
                self._recompute(model, step, self.info.rank), dtype=torch.float64
            )
        third = torch.zeros(world, 3, dtype=torch.float64)
        for p in mismatched:
            if (p + per_node) % world == self.info.rank:
                third[p] = torch.tensor(self._recompute(model, step, p), dtype=torch.float64)
        both = self._gather_read(torch.cat([again, third]).reshape(-1), world)
        for p in mismatched:
            verifier, tiebreaker = (p - per_node) % world, (p + per_node) % world
            results = {
                "own": table[p][_OWN : _OWN + 3],
                "replay": table[verifier][_REPLAY:],
                "same_rank": both[p].reshape(2, world, 3)[0][p],
                "third": both[tiebreaker].reshape(2, world, 3)[1][p],
            }
            evidence = {"rank": p, "verifier": verifier, "tiebreaker": tiebreaker,
                        **{k: v.tolist() for k, v in results.items()}}  # fmt: skip
            if self._irreproducible(results):
                self.warn(step, "not deterministic", dict(evidence, verdict="no two of four "
                          "computations of the same micro-batches agree, not even the rank's "
                          "own two: the forward does not reproduce"))  # fmt: skip
                continue
            judge = self._megatron if self.config.verdict == "megatron" else self._majority
            suspects, verdict = judge(p, verifier, results)
            self.alert(step, "audit", suspects, dict(evidence, verdict=verdict))

    def _irreproducible(self, results: dict[str, torch.Tensor]) -> bool:
        """No two of the four computations agree: not a fault on one rank, which the others'
        agreement would outvote, but a forward that does not reproduce. A result that is not
        finite never counts as that: weights already NaN give NaN every time (and NaN equals
        nothing), which is corruption for the verdict to name."""
        values = list(results.values())
        if not all(bool(torch.isfinite(v).all()) for v in values):
            return False
        return not any(self._same(a, b) for i, a in enumerate(values) for b in values[i + 1 :])

    def _majority(
        self, p: int, verifier: int, results: dict[str, torch.Tensor]
    ) -> tuple[list[int], str]:
        """The published tie-break: the third node's replay sides with the rank or its verifier."""
        if self._same(results["replay"], results["third"]):
            return [p], "computed differently from two replays"
        if self._same(results["own"], results["third"]):
            return [verifier], "its replay disagreed with the rank and a third"
        return [p, verifier], "three different results"

    def _gather_read(self, row: torch.Tensor, world: int) -> list[torch.Tensor]:
        """Every rank's `row`, on the host (one read)."""
        table = torch.stack(_gather(row.to(self.device), world))
        return list(torch.tensor(self.read(table), dtype=torch.float64))

    def _megatron(
        self, p: int, verifier: int, results: dict[str, torch.Tensor]
    ) -> tuple[list[int], str]:
        """Megatron-LM's rerun verdicts (megatron/core/rerun_state_machine.py): rerun on the
        same rank first; a result it does not reproduce was a transient fault. A reproduced one
        is rerun on another node (here the rank one node further on): reproduced there too, the
        result was correct (Megatron: "possible application error"; here the replay that
        disagreed with it is the suspect); not reproduced there, the rank's hardware has a
        persistent fault."""
        own = results["own"]
        if not self._same(own, results["same_rank"]):
            return [p], "not reproduced on the same rank: transient fault"
        if self._same(own, results["third"]):
            return [verifier], "reproduced on another node: the replay differed"
        return [p], "reproduced on its own rank only: persistent fault"


# The derivation's assumptions: at most ROUNDINGS roundings to the dtype on an element's way
# through forward and backward (the workloads' linear layers accumulate in float32 and round
# their outputs), and a false alarm rate of a Z-sigma deviation.
ROUNDINGS = 8
Z = 6.0


def derived_rtol(dtype: torch.dtype) -> float:
    """Replay's tolerance for a 16-bit dtype, from rounding alone.

    Each rounding to the dtype moves a value by a relative error uniform in [-u, u] (u, the unit
    roundoff, is half the dtype's eps: 2^-8 for bfloat16, 2^-11 for float16), standard deviation
    u / sqrt(3). Two replicas that sum in different orders round independently, so an element
    of their gradients differs by a relative standard deviation of sqrt(2 * ROUNDINGS / 3) * u.
    Projected onto +1/-1 signs, n such independent differences add like a random walk: the
    projections differ by that times ||g||_2, and so, at most, do the norms. The tolerance is Z
    of those: 6 * sqrt(16 / 3) * 2^-8 = 5.4e-2 for bfloat16 (the calibrated 8e-2 it replaces was
    a guess with margin over the 1.1e-2 measured), 6.8e-3 for float16. A scaled element is caught
    when its change exceeds it: (factor - 1) * |g_i| > rtol * ||g||_2
    (tests/test_replay_tolerance.py shows the smallest factor per dtype).
    """
    unit_roundoff = torch.finfo(dtype).eps / 2
    return Z * math.sqrt(2 * ROUNDINGS / 3) * unit_roundoff


def agree(a: list[float], b: list[float], rtol: float) -> bool:
    """Two (loss, projection, norm) triples agree within `rtol` (see Replay._same)."""
    scale = min(a[2], b[2])
    return (
        abs(a[0] - b[0]) <= rtol * min(abs(a[0]), abs(b[0]))
        and abs(a[1] - b[1]) <= rtol * scale
        and abs(a[2] - b[2]) <= rtol * scale
    )


def triple(loss: float, named_grads: list[tuple[str, torch.Tensor]]) -> list[float]:
    """The (loss, projection, norm) that replay compares, for a gradient given by name."""
    dots, sq = {}, 0.0
    for name, g in named_grads:
        dots[name], part = _project(name, g)
        sq += part
    return [loss, _fold(dots), math.sqrt(sq)]


def _triple(values: list[float], names: dict) -> list[float]:
    """(loss, projection, norm) from a loss, per-parameter projections in `names`' order and a
    squared norm."""
    return [values[0], _fold(dict(zip(names, values[1:-1], strict=True))), math.sqrt(values[-1])]


def _project_on_device(name: str, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_project`, unread: two 0-d float64 tensors on the gradient's device."""
    flat = grad.reshape(-1).double()
    return torch.dot(flat, signs(name, flat.numel()).to(flat.device).double()), torch.dot(
        flat, flat
    )


def _project(name: str, grad: torch.Tensor) -> tuple[float, float]:
    """Projection onto the name's signs and squared norm, in float64: ranks with different
    thread counts sum a float32 dot in different orders, an error as large as the one sought."""
    flat = grad.reshape(-1).double()
    return float(torch.dot(flat, signs(name, flat.numel()).double())), float(torch.dot(flat, flat))


def _fold(dots: dict[str, float]) -> float:
    """Sum per-parameter projections in name order, identically on every rank."""
    return math.fsum(dots[name] for name in sorted(dots))


def _gather(row: torch.Tensor, world: int) -> list[torch.Tensor]:
    table = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(table, row)
    inflight.hold(row, *table)
    return table


DETECTOR = Replay
