"""`allreduce_sketch`: verifies every reduction, including faults that treat a whole
contribution consistently, at no collective of its own.

A sum is linear: projected onto any weights, the sum of the buckets equals the sum of their
projections. Each rank projects its local bucket (already divided by the world size) before the
collective and the harness sums the result with the bucket (its rider region,
harness/runtime/comm.py). After the collective every rank projects what it received and compares.

Why a faulty reduction cannot forge this in step with the data:
- Per-rank slots. Rank r writes its projection and a tag (step + 1) into slots that only it
  fills; every other rank sends zeros there, so the sum of the region is a gather (adding zeros
  is exact), not a sum. A contribution that is missing (drop), counted twice (duplicate) or
  last step's (stale) leaves a tag of 0, 2 (step + 1) or step: a known answer that a reduction
  handling contributions consistently cannot keep right without being right, and it names the
  rank whose contribution was wrong (a tag of no such answer was struck after its sender wrote
  it: the receiver that sees it is named). A rider slot corrupted in the reduction breaks either a
  tag or the equality of the summed projections with the received data's projection.
- Fresh weights every step, from a seed all ranks share (step and chunk index): the bucket is
  viewed as BLOCKS rows (WIDE_BLOCKS, longer ones, from 10 MiB of float32), and element (b, c)
  weighs u[b] * v[c], with u and v drawn afresh, each a random sign times a magnitude uniform
  in [1, 2]. A persistent pattern cannot stay aligned with them, a stale contribution was
  projected with last step's weights, and a change that sums to zero inside a row moves the
  projection by d * u[b] * (v[c] - v[c']), nonzero for almost every draw (the old fixed
  +1/-1 per row was blind to it, forever).
- `kernels: native` (the default): the rider's projection and sum of squares in one read, and
  the check's projection in another, by a C kernel that widens a bfloat16 bucket in registers
  (detectors/native_projection.py; float32 and bfloat16 buckets on the CPU): 1.07 read passes
  each on this CPU, against `torch.sum`'s one. `eager`, and the fallback where the kernel does
  not apply or no C compiler builds it (said once): one matrix-vector product of the bucket's
  rows with v, or of u with the rows, and a dot product; a 16-bit bucket is converted to
  float32 a piece at a time into one workspace, in cache, its norm taken from there (the
  rider about 1.9 read passes, the check 1.2-1.7: MKL's matrix-vector product streams slower
  than `torch.sum`). The two paths' projections differ within the float32 projection's
  rounding, their verdicts not at all (tests/unit/test_native_projection.py). The kernel's
  figures are host numbers: the slots and the verdict are made from them in Python and put in
  a tensor once, rounded as float32 tensors would round them (the same slots, bit for bit, as
  the tensors' path, which a GPU or eager bucket takes). Either way the weights cost rows +
  numel / rows random numbers, one draw each (docs/performance.md).

The comparison allows for the rounding of the projections and of the sum:

    |w . received - sum_r w . c_r|  <=  4 rtol sqrt(n) N  +  Z (7/3) (rho N + alpha sqrt(n))

where c_r is rank r's contribution (its bucket as the collective sums it) and N = sum_r ||c_r||_2
(the summed norms). The first term is the float32 projections' own rounding (calibrated: rtol
1e-6, whatever the bucket's dtype, since a 16-bit bucket is projected in float32 too; sqrt(n)
N bounds the L1 norm and every weight is at most 4 in magnitude; measured clean, at most 1e-8
of sqrt(n) N). The second is the sum's rounding, derived from the dtype it is summed in, of
unit roundoff u (half its epsilon) and subnormal spacing s:
- Per element, what arrives differs from the exact sum of the contributions by e_i, with
  |e_i| <= rho sum_r |c_r,i| + alpha: a sum of W terms rounds at each of its W - 1 additions,
  by at most u times a partial sum, and a wrapped hook that divides by W or casts to a wire
  dtype (torch's `fp16_compress_hook`, `bf16_compress_hook`) rounds once more per rank for each;
  so rho = (W - 1 + k) u, with k those roundings per rank (0 in the harness's own reduction,
  which projects exactly the divided bucket it sends), and below the smallest normal number
  each rounding is absolute instead, at most s / 2: alpha = (W - 1 + W k) s / 2. So
  ||e||_2 <= rho N + alpha sqrt(n): a bound with no factor sqrt(n) on the relative part.
- The weights are drawn independently of the data, so the projection of e is a sum of
  zero-mean terms with standard deviation (7/3) ||e||_2 exactly (E[u[b]^2] = E[v[c]^2] = 7/3),
  and the bound allows Z = 6 of them. For errors without structure (rounding errors) that is
  a Gaussian tail, about 2e-9. The worst shape, the same error pattern in every row up to
  scale, makes the projection a product of two such sums: 7e-4 beyond 6 at the worst ||e||_2;
  but the errors actually reached are far below the worst case (every rounding maximal and
  the ranks' gradients aligned): measured on clean bfloat16 runs (the mlp; a gpt of two
  chunks; 6-8 steps each), the discrepancy stays within 0.3 standard deviations of that
  worst case, so 6 of them are about 20 of the errors actually reached.
So a change of one element by more than the bound moves the projection by more (every weight
is at least 1): 6 (7/3) 3 u = 0.16 of the summed norms in bfloat16 with 4 ranks, plus 4e-6
sqrt(n) N; the bound used to be 4e-3 sqrt(n) N there, 1.2 N on the mlp and 14 N on a 25 MiB
bucket, which let a x1000 of a gradient element of 1.4e-4 pass. In float32 rho N is 1e-7 N
and the first term rules, as before.
A wrong value delivered to one receiver (`scope=rank`) alarms that rank; a wrong reduction alarms
every rank. Each rank also checks its own slots came back exactly as it sent them.

Slots used: 2 * world_size + 1 (a tag and a projection per rank, the summed norms), within the
harness's fixed rider region (harness/runtime/comm.py, rider_slots) next to grad_stats' 2 *
world_size.

Cost per step (sdc-plan): bytes = 2*B*N, flops = 4*N: the rider's projection before the reduction
and the check's after: two read passes with a multiply-add per element each (the symbols:
harness/analysis/estimates.py).
"""

from __future__ import annotations

import ctypes
import functools
import math
import zlib
from dataclasses import dataclass

import torch

from detectors import native_build, native_projection
from harness.core.checks import CheckConfig
from harness.core.events import Sensitivity
from harness.core.plugins import Bucket, Detector, DetectorContext, EventLog
from harness.core.values import choice, fraction

BLOCKS = 4096
# Rows of a bucket whose BLOCKS rows would be at least STREAM_WIDTH wide: a vector-matrix product
# streams fewer, longer rows faster (25 MiB of float32 on this machine's CPU: 0.95-1.06 read
# passes in 256-1,024 rows, 1.18 in 4,096), for 12,800 instead of 1,600 column weights.
WIDE_BLOCKS = 512
# Elements read at a time from a float32 bucket whose norm is taken too, and converted at a time
# from a 16-bit one (4 MiB of float32: the second kernel over a piece reads it from the
# last-level cache instead of from memory; smaller pieces cost more in per-operation overhead
# than the nearer cache saves).
PIECE = 1 << 20
# Rows at least this wide are projected by a vector-matrix product (`_pass`).
STREAM_WIDTH = 640
# Standard deviations of the projected rounding errors the bound allows, and the standard
# deviation of one weight u[b] * v[c] (each factor a sign times uniform [1, 2]: E = 7/3).
Z = 6.0
WEIGHT_RMS = 7 / 3
KERNELS = ("native", "eager")


def step_weights(step: int, index: int | str, numel: int) -> tuple[torch.Tensor, ...]:
    """(u, v, z): block weights, weights across blocks and the remainder's weights for one
    chunk at one step, the same on every rank (a seed from the step and the chunk index
    alone)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"allreduce_sketch:{step}:{index}".encode()))
    rows = min(BLOCKS, numel)
    if numel // rows >= STREAM_WIDTH:
        rows = WIDE_BLOCKS
    width = numel // rows
    rest = numel - rows * width

    # All three from one uniform draw t in [-1, 1): magnitude 1 + |t|, uniform in [1, 2], and
    # the sign of t, independent of it; six tensor operations per chunk and step, where a sign
    # and a magnitude drawn apart for each vector took eighteen (about 0.1 of a read pass of
    # a 25 MiB bucket, and more than the read itself on gpt's gradient).
    t = torch.rand(rows + width + rest, generator=gen).mul_(2).sub_(1)
    weights = torch.copysign(t.abs().add_(1), t)
    return weights[:rows], weights[rows : rows + width], weights[rows + width :]


def project(
    buffer: torch.Tensor, weights: tuple[torch.Tensor, ...], native: bool = False
) -> torch.Tensor:
    """`buffer` projected onto the weights, in float32 (module docstring); `native`: by the
    fused kernel where it applies (detectors/native_projection.py)."""
    figures = _native(buffer, weights) if native else None
    if figures is not None:
        return figures[0].float()
    return _pass(buffer, weights, norm=False)[0]


def rider_of(
    buffer: torch.Tensor, weights: tuple[torch.Tensor, ...], native: bool = False
) -> torch.Tensor:
    """The bucket's projection and its L2 norm, in float32 (what one rank contributes)."""
    figures = _native(buffer, weights) if native else None
    if figures is not None:
        figures[1].sqrt_()
        return figures.float()
    return torch.stack(_pass(buffer, weights, norm=True))


def _native(buffer: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """(projection, sum of squares) in float64 by the fused kernel, or None: eager instead."""
    figures = native_projection.project(buffer.reshape(-1), weights)
    return None if figures is None else torch.tensor(figures, dtype=torch.float64)


def _f32(value: float) -> float:
    """`value` rounded to float32, as a float32 tensor holds it (overflow to infinity)."""
    return ctypes.c_float(value).value


def _bits(value: float) -> bytes:
    """`value`'s float32 bits: a NaN equals itself, and -0 differs from 0."""
    return bytes(ctypes.c_float(value))


def _pass(
    buffer: torch.Tensor, weights: tuple[torch.Tensor, ...], norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(projection, L2 norm or 0). The body of the bucket is u.numel() rows of `width` elements,
    u . (rows) . v. Wide rows are summed as (u @ rows) . v, a vector-matrix product that
    streams through them, narrow ones as u . (rows @ v); same weights, whichever is faster on
    the CPU (the crossover measured between 424 and 848). A float32 bucket larger than PIECE
    whose norm is taken is read a piece at a time: the sum of squares first, from memory, then
    the projection from the cache (0.83-1.02 of the other order's time: the vector-matrix
    product streams from memory slower than the dot product). A 16-bit bucket on
    the CPU is converted into one float32 workspace a piece at a time and both are taken from
    it: a whole-bucket copy costs several times the arithmetic, and a fresh tensor per piece
    costs its allocation. A smaller float32 bucket, or one on a GPU, is read at once."""
    u, v, z = (w.to(buffer.device) for w in weights)
    flat = buffer.reshape(-1)
    if flat.dtype != torch.float32 and flat.device.type != "cpu":
        flat = flat.float()  # a device converts the whole bucket faster than in pieces
    rows, width = u.numel(), v.numel()
    body = rows * width
    grid = flat[:body].view(rows, width)
    rest = flat[body:].float()
    convert = flat.dtype != torch.float32
    step = max(1, PIECE // width) if convert or (norm and flat.device.type == "cpu") else rows
    by_piece = step < rows or convert
    work = torch.empty(min(step, rows) * width, device=flat.device) if convert else None
    projection = torch.dot(rest, z)
    squares = [torch.dot(rest, rest)] if norm and by_piece else []
    for at in range(0, rows, step):
        block, row_weights = grid[at : at + step], u[at : at + step]  # slices: split costs 10 us
        if work is not None:
            block = work[: block.numel()].view(block.shape).copy_(block)
        if norm and by_piece:
            squares.append(torch.dot(block.view(-1), block.view(-1)))
        if width >= STREAM_WIDTH:
            projection = projection + torch.dot(row_weights @ block, v)
        else:
            projection = projection + torch.dot(block @ v, row_weights)
    if not norm:
        return projection, projection.new_zeros(())
    if not by_piece:
        return projection, torch.linalg.vector_norm(flat)
    return projection, torch.stack(squares).sum().sqrt()


@functools.cache
def sum_rounding(dtype: torch.dtype, world: int, per_rank: int) -> tuple[float, float]:
    """(rho, alpha): what a sum of `world` contributions in `dtype` adds per element, relative
    to sum_r |c_r,i| and absolute, when each contribution was rounded `per_rank` more times on
    its way (a wrapped hook's division and cast; module docstring)."""
    info = torch.finfo(dtype)
    unit, subnormal = info.eps / 2, info.smallest_normal * info.eps
    roundings = world - 1 + per_rank
    return roundings * unit, (roundings + (world - 1) * per_rank) * subnormal / 2


def tolerance(
    norms: torch.Tensor | float, n: int, rtol: float, rho: float, alpha: float
) -> torch.Tensor | float:
    """The bound on |received projection - summed projections| (module docstring), for the
    summed norms `norms` (a tensor or a float) of n-element contributions."""
    # 4 rtol sqrt(n) N + Z (7/3) ||e||_2, with ||e||_2 <= rho N + alpha sqrt(n), as two tensor
    # operations: N's factor, then the constant.
    factor = 4 * rtol * math.sqrt(n) + Z * WEIGHT_RMS * rho
    return norms * factor + Z * WEIGHT_RMS * alpha * math.sqrt(n)


class AllreduceSketch(Detector):
    name = "allreduce_sketch"
    verifies_reduction = True
    # Per receiver: a reduce-scattered shard is the sum of the senders' rows for it.
    parallel = ("ddp", "fsdp", "hsdp")

    @dataclass(frozen=True)
    class Config(CheckConfig):
        rtol: float | None = None  # of the projections' rounding; None: 1e-6 (float32)
        # native: the projection and norm in one read by a C kernel, where a C compiler and a
        # float32 or bfloat16 CPU bucket allow (else eager, said once); eager: torch only.
        kernels: str = "native"

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.rtol is not None:
                fraction("rtol", self.rtol, ", or null for the dtype's default")
            choice("kernels", self.kernels, KERNELS)

    def __init__(self, config: Config, ctx: DetectorContext, log: EventLog):
        super().__init__(config, ctx, log)
        # The float32 projections' rounding (module docstring); the sum's is derived.
        self.rtol = config.rtol or 1e-6
        self.native = config.kernels == "native"
        self.eager_instead = self.native and native_projection.load() is None
        self.sent: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}

    def rider(self, step: int, bucket: Bucket) -> torch.Tensor:
        world, rank = self.info.world_size, self.info.rank
        if self.eager_instead:
            self.eager_instead = False
            self.warn(step, native_build.EAGER_INSTEAD, {"kernels": "eager"})
        rows = bucket.buffer.view(bucket.shards, -1)
        if self.native and native_projection.applies(bucket.buffer):
            return self._rider_on_host(step, bucket, rows)
        slot = torch.zeros(bucket.shards, 2 * world + 1, device=bucket.buffer.device)
        slot[:, 1 + rank] = step + 1
        for row in range(bucket.shards):
            weights = step_weights(step, _chunk(bucket, row), rows.shape[1])
            # Projection and norm are linear in the buffer: scaling them scales what is summed.
            figures = rider_of(rows[row], weights, self.native) * bucket.contribution
            slot[row, 0] = figures[1]
            slot[row, 1 + world + rank] = figures[0]
            if row == bucket.shard:
                self.sent[bucket.index] = (weights, figures[0])  # the value sent, bit for bit
        return slot.view(-1)

    def _rider_on_host(self, step: int, bucket: Bucket, rows: torch.Tensor) -> torch.Tensor:
        """`rider` from the kernel's host figures: rounded as the tensors would round them (to
        float32, then times the contribution in float32) and made one tensor. The tensors'
        small operations, eight a row here and fifteen in the check, took about 0.15 ms a
        bucket, a tenth of a read pass of 25 MiB and most of a small bucket's check."""
        world, rank = self.info.world_size, self.info.rank
        contribution = _f32(bucket.contribution)
        slots: list[float] = []
        for row in range(bucket.shards):
            weights = step_weights(step, _chunk(bucket, row), rows.shape[1])
            projection, squares = native_projection.project(rows[row], weights)
            slot = [0.0] * (2 * world + 1)
            slot[0] = _f32(_f32(math.sqrt(squares)) * contribution)
            slot[1 + rank] = step + 1
            slot[1 + world + rank] = sent = _f32(_f32(projection) * contribution)
            slots += slot
            if row == bucket.shard:
                self.sent[bucket.index] = (weights, sent)
        return torch.tensor(slots, dtype=torch.float32)

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        world, rank = self.info.world_size, self.info.rank
        weights, own = self.sent[bucket.index]  # kept: a retried reduction is checked again
        n = bucket.buffer.numel()
        # A wrapped hook divides (contribution 1 / W) and may cast (wire) after the riders.
        per_rank = (bucket.contribution != 1) + (bucket.wire is not None)
        rho, alpha = sum_rounding(bucket.wire or bucket.buffer.dtype, world, per_rank)
        if isinstance(own, float):  # the rider's figures were the kernel's, on the host
            norms, *tags_and_projections = bucket.riders[id(self)].tolist()
            tags, projections = tags_and_projections[:world], tags_and_projections[world:]
            wrong = any(t != _f32(step + 1) for t in tags)  # from step 2^24 a tag is rounded
            changed = _bits(projections[rank]) != _bits(own)
            got = _f32(native_projection.project(bucket.buffer, weights)[0])
            # In float64, exactly rounded: the world's few float32 projections then add as
            # torch's float64 sum below adds them unless they cancel from magnitudes 2^29 apart
            # (a fault's, in practice), where this sum is the right one. fsum refuses an
            # infinity of each sign; there, as torch's sum, NaN.
            finite = all(map(math.isfinite, projections))
            expected = math.fsum(projections) if finite else sum(projections)
            bound = tolerance(norms, n, self.rtol, rho, alpha)
            off = not abs(got - expected) <= bound  # not ">": a NaN cannot be verified
            broken = torch.tensor(wrong or changed or off)
            verified = torch.tensor(not (wrong or changed))
            detail = torch.tensor([*tags, *projections, changed, got, expected, bound],
                                  dtype=torch.float64)  # fmt: skip
        else:
            slot = bucket.riders[id(self)]
            norms, tags, projections = slot[0], slot[1 : 1 + world], slot[1 + world :]
            wrong = (tags != step + 1).any()
            changed = projections[rank].view(torch.int32) != own.view(torch.int32)
            got = project(bucket.buffer, weights, self.native).double()
            expected = projections.sum(dtype=torch.float64)
            bound = tolerance(norms.double(), n, self.rtol, rho, alpha)
            off = ~((got - expected).abs() <= bound)
            broken, verified = wrong | changed | off, ~(wrong | changed)
            detail = torch.cat([tags.double(), projections.double(),
                                torch.stack([changed.double(), got, expected, bound])])  # fmt: skip
        self._judge(step, bucket, broken, verified, detail)

    def _judge(
        self,
        step: int,
        bucket: Bucket,
        broken: torch.Tensor,
        verified: torch.Tensor,
        detail: torch.Tensor,
    ) -> None:
        """The verdict (`detail`: the tags, each rank's projection, then whether the own slot
        changed, the received projection, the expected one and the bound),
        and at step 0 the sensitivity where the slots were `verified`. A rank that sent a
        contribution not finite (a NaN in its gradient) makes every receiver's sum NaN, the
        reduction right: the slots name it, where the received sum is not finite either (a
        strike on one receiver's slots alone leaves its sum finite: that receiver is named)."""
        world, rank, index = self.info.world_size, self.info.rank, bucket.index

        def explain(values: list[float]) -> None:
            tag_values, projections = values[:world], values[world : 2 * world]
            was_changed, received, summed, limit = values[2 * world :]
            evidence = {"bucket": index}
            bad = {r: t for r, t in enumerate(tag_values) if t != step + 1}
            senders = [r for r, p in enumerate(projections) if not math.isfinite(p)]
            if bad:
                # A tag of a known answer names the sender whose contribution was summed wrong;
                # one no way of summing contributions gives was struck after the sender wrote
                # it, in the reduction or here: this receiver is named, as for a struck slot.
                known = {r: _known_answer(t, step) for r, t in bad.items()}
                named = {r if answer else rank for r, answer in known.items()}
                verdicts = {r: known[r] or f"corrupted (tag {t})" for r, t in bad.items()}
                self.alert(step, "post_allreduce", sorted(named), evidence | {"tags": verdicts})
            elif senders and not was_changed and not math.isfinite(received):
                reason = {"reason": "contribution not finite"}
                self.alert(step, "post_allreduce", senders, evidence | reason)
            elif was_changed:
                reason = {"reason": "own slot changed"}
                self.alert(step, "post_allreduce", [rank], evidence | reason)
            else:
                evidence |= {"received": received, "expected": summed, "bound": limit}
                self.alert(step, "post_allreduce", [rank], evidence)

        self.defer(step, "post_allreduce", broken, explain, detail)
        if step == 0:
            # The smallest change of one element this check can see, next to the gradient norm.
            def sensitivity(values: list[float]) -> None:
                self._log.emit(Sensitivity(step=step, detector=self.name, bucket=index,
                                           bound=values[0], grad_norm=values[1]))  # fmt: skip

            norm = bucket.buffer.float().norm().double().reshape(1)
            self.defer(step, "post_allreduce", verified, sensitivity,  # what the bound applies to
                       torch.cat([detail[-1:], norm]), alarm=False)  # fmt: skip


def _chunk(bucket: Bucket, row: int) -> int | str:
    """What one receiver's chunk is named by in the weights' seed: the DDP chunk's index, or
    under sharding the group's index and the receiver's row."""
    return bucket.index if bucket.shards == 1 else f"{bucket.index}.{row}"


def _known_answer(tag: float, step: int) -> str | None:
    """What a sender's wrong tag says of its contribution, where a reduction handling it
    consistently gives that tag; None for any other."""
    if tag == 0:
        return "missing from the sum"
    if tag == 2 * (step + 1):
        return "counted twice"
    if tag == step:
        return "from the previous step"
    return None


DETECTOR = AllreduceSketch
