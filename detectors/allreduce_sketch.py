"""`allreduce_sketch`: verifies every reduction, including faults that treat a whole
contribution consistently, at no collective of its own.

A sum is linear: projected onto any weights, the sum of the buckets equals the sum of their
projections. Each rank projects its local bucket (already divided by the world size) before the
collective and the harness sums the result with the bucket (its rider region,
harness/runtime/comm.py). After the collective every rank projects what it received and compares.

Why a faulty reduction cannot forge this in step with the data (issue 14):
- Per-rank slots. Rank r writes its projection and a tag (step + 1) into slots that only it
  fills; every other rank sends zeros there, so the sum of the region is a gather (adding zeros
  is exact), not a sum. A contribution that is missing (drop), counted twice (duplicate) or
  last step's (stale) leaves a tag of 0, 2 (step + 1) or step: a known answer that a reduction
  handling contributions consistently cannot keep right without being right, and it names the
  rank whose contribution was wrong. A rider slot corrupted in the reduction breaks either a
  tag or the equality of the summed projections with the received data's projection.
- Fresh weights every step, from a seed all ranks share (step and chunk index): the bucket is
  viewed as BLOCKS rows, and element (b, c) weighs u[b] * v[c], with u and v drawn afresh, each
  a random sign times a magnitude uniform in [1, 2]. A persistent pattern cannot stay aligned
  with them, a stale contribution was projected with last step's weights, and a change that
  sums to zero inside a row moves the projection by d * u[b] * (v[c] - v[c']), nonzero for
  almost every draw (the old fixed +1/-1 per row was blind to it, forever).
- The projection is one matrix-vector product of the bucket's rows with v, or of u with the rows
  (one read pass either way), and a dot product; the weights cost BLOCKS + numel / BLOCKS random
  numbers. A 16-bit bucket is converted to float32 a few rows at a time, in cache, its norm
  taken on the way.

The comparison allows for rounding of a sum of world_size terms and of the projection:

    |w . received - sum_r w . g_r|  <=  rtol * 4 * sqrt(n) * sum_r ||g_r||_2

(sqrt(n) * ||g||_2 bounds the L1 norm, every weight is at most 4 in magnitude). Any single
element changed by more than the bound moves the projection by more (every weight is at least 1).
A comm hook that compresses (torch's `fp16_compress_hook`, `bf16_compress_hook`: the bucket is
rounded to the wire dtype, divided by the world size there, and summed there) adds its own
rounding, bounded from the wire dtype's unit roundoff u (half its epsilon) and world size W.
Per element of rank i's bucket g_i: the cast and the division round twice, |c_i - g_i/W| <=
2u |g_i|/W; a sum of W terms rounded at each of its W - 1 additions moves by at most (W - 1) u
sum_i |c_i|. So what arrives is within (W + 1) u sum_i |g_i| / W of the exact average, and the
projection within 4 (W + 1) u sqrt(n) sum_i ||g_i / W||_2: that relative term joins rtol. Below
the wire dtype's smallest normal number the roundings are absolute, at most half a subnormal
step each: one subnormal step per element and rank, n W steps in all (float16's step is 6e-8).
A wrong value delivered to one receiver (`scope=rank`) alarms that rank; a wrong reduction alarms
every rank. Each rank also checks its own slots came back exactly as it sent them.

Slots used: 2 * world_size + 1 (a tag and a projection per rank, the summed norms), within the
harness's fixed rider region (harness/runtime/comm.py, rider_slots) next to grad_stats' 2 *
world_size.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

from harness.errors import ConfigError
from harness.runtime.plugins import Bucket, Detector

BLOCKS = 4096
# Elements of a 16-bit bucket converted to float32 at a time (512 KiB: stays in cache).
CONVERT = 1 << 17
# Rows at least this wide are projected by a vector-matrix product (`_pass`).
STREAM_WIDTH = 640


def step_weights(step: int, index: int, numel: int) -> tuple[torch.Tensor, ...]:
    """(u, v, z): block weights, weights across blocks and the remainder's weights for one
    chunk at one step, the same on every rank (a seed from the step and the chunk index
    alone)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"allreduce_sketch:{step}:{index}".encode()))
    rows = min(BLOCKS, numel)
    width = numel // rows
    rest = numel - rows * width

    def draw(n: int) -> torch.Tensor:
        sign = torch.randint(0, 2, (n,), generator=gen).float().mul_(2).sub_(1)
        return sign * (1 + torch.rand(n, generator=gen))

    return draw(rows), draw(width), draw(rest)


def project(buffer: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`buffer` projected onto the weights, in float32 (module docstring)."""
    return _pass(buffer, weights, norm=False)[0]


def rider_of(buffer: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The bucket's projection and its L2 norm, in float32 (what one rank contributes)."""
    return torch.stack(_pass(buffer, weights, norm=True))


def _pass(
    buffer: torch.Tensor, weights: tuple[torch.Tensor, ...], norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(projection, L2 norm or 0). The body of the bucket is BLOCKS rows of `width` elements,
    u . (rows) . v. Wide rows are summed as (u @ rows) . v, a vector-matrix product that
    streams through them, narrow ones as u . (rows @ v); same weights, whichever is faster on
    the CPU (the crossover measured between 424 and 848). A 16-bit bucket is converted to
    float32 a few rows at a time, in cache: a whole-bucket copy costs several times the
    arithmetic."""
    u, v, z = (w.to(buffer.device) for w in weights)
    flat = buffer.reshape(-1)
    if flat.dtype != torch.float32 and flat.device.type != "cpu":
        flat = flat.float()  # a device converts the whole bucket faster than in pieces
    rows, width = u.numel(), v.numel()
    body = rows * width
    grid = flat[:body].view(rows, width)
    rest = flat[body:].float()
    whole = flat.dtype == torch.float32
    step = rows if whole else max(1, CONVERT // width)
    projection = torch.dot(rest, z)
    norms = [torch.linalg.vector_norm(flat if whole else rest)] if norm else []
    for at in range(0, rows, step):
        block = grid[at : at + step].float()  # float32 already: the rows themselves
        row_weights = u[at : at + step]
        if width >= STREAM_WIDTH:
            projection = projection + torch.dot(row_weights @ block, v)
        else:
            projection = projection + torch.dot(block @ v, row_weights)
        if norm and not whole:
            norms.append(torch.linalg.vector_norm(block))
    size = torch.linalg.vector_norm(torch.stack(norms)) if norm else projection.new_zeros(())
    return projection, size


def wire_rounding(wire: torch.dtype, world: int, n: int) -> tuple[float, float]:
    """What summing n elements per rank in `wire` adds to the bound: a relative term (of
    sqrt(n) times the summed norms) and an absolute one (module docstring)."""
    info = torch.finfo(wire)
    return (world + 1) * info.eps / 2, n * world * info.smallest_normal * info.eps


class AllreduceSketch(Detector):
    name = "allreduce_sketch"
    verifies_reduction = True
    defaults = {"rtol": None}

    @classmethod
    def check_params(cls, key: str, params: dict[str, Any], topology: Any) -> None:
        rtol = params["rtol"]
        if rtol is not None and (not isinstance(rtol, int | float) or not 0 < rtol < 1):
            raise ConfigError(
                f"{key}.rtol", f"'{rtol}' must be in (0, 1), or null for the dtype's default"
            )

    def __init__(self, params, ctx, log):
        super().__init__(params, ctx, log)
        dtype = next(ctx.model.parameters()).dtype
        # Rounding of a sum of world_size terms and of an n-term projection, with margin; the
        # clean discrepancy measured is at most 1e-8 (float32) and 2e-5 (bfloat16) of the
        # bound's scale (tests/test_detectors.py and the campaigns' clean trials).
        self.rtol = params["rtol"] or {torch.float32: 1e-6}.get(dtype, 1e-3)
        self.sent: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}

    def rider(self, step: int, bucket: Bucket) -> torch.Tensor:
        world, rank = self.info.world_size, self.info.rank
        weights = step_weights(step, bucket.index, bucket.buffer.numel())
        # Projection and norm are linear in the buffer: scaling them is scaling what is summed.
        projection, norm = rider_of(bucket.buffer, weights) * bucket.contribution
        slot = torch.zeros(2 * world + 1, device=bucket.buffer.device)
        slot[0] = norm
        slot[1 + rank] = step + 1
        slot[1 + world + rank] = projection
        self.sent[bucket.index] = (weights, slot[1 + world + rank].clone())
        return slot

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        world, rank = self.info.world_size, self.info.rank
        weights, own = self.sent[bucket.index]  # kept: a retried reduction is checked again
        slot = bucket.riders[id(self)]
        norms, tags, projections = slot[0], slot[1 : 1 + world], slot[1 + world :]
        wrong = tags != step + 1
        changed = projections[rank].view(torch.int32) != own.view(torch.int32)
        got = project(bucket.buffer, weights).double()
        # In float64, in rank order: the world's few float32 projections add with an error far
        # below the bound (the exactly rounded sum differs in the 16th digit at most).
        expected = projections.double().sum()
        n = bucket.buffer.numel()
        relative, absolute = (
            (0.0, 0.0)
            if bucket.wire is None
            else wire_rounding(bucket.wire, self.info.world_size, n)
        )
        bound = 4 * ((self.rtol + relative) * math.sqrt(n) * norms.double() + absolute)
        # Not "> bound": NaN is caught too, since a NaN cannot be verified.
        off = ~((got - expected).abs() <= bound)
        index = bucket.index

        def explain(values: list[float]) -> None:
            tag_values, (was_changed, received, summed, limit) = values[:world], values[world:]
            evidence = {"bucket": index}
            bad = {r: t for r, t in enumerate(tag_values) if t != step + 1}
            if bad:
                verdicts = {r: _tag_verdict(t, step) for r, t in bad.items()}
                self.alert(step, "post_allreduce", sorted(bad), evidence | {"tags": verdicts})
            elif was_changed:
                reason = {"reason": "own slot changed"}
                self.alert(step, "post_allreduce", [rank], evidence | reason)
            else:
                evidence |= {"received": received, "expected": summed, "bound": limit}
                self.alert(step, "post_allreduce", [rank], evidence)

        detail = torch.cat([tags.double(), torch.stack([changed.double(), got, expected, bound])])
        self.defer(step, "post_allreduce", wrong.any() | changed | off, explain, detail)
        if step == 0:
            # The smallest change of one element this check can see, next to the gradient norm.
            def sensitivity(values: list[float]) -> None:
                self._log.emit("sensitivity", step=step, detector=self.name, bucket=index,
                               bound=values[0], grad_norm=values[1])  # fmt: skip

            norm = bucket.buffer.float().norm().double()
            verified = ~(wrong.any() | changed)  # what the bound applies to
            self.defer(step, "post_allreduce", verified, sensitivity, torch.stack([bound, norm]),
                       alarm=False)  # fmt: skip


def _tag_verdict(tag: float, step: int) -> str:
    if tag == 0:
        return "missing from the sum"
    if tag == 2 * (step + 1):
        return "counted twice"
    if tag == step:
        return "from the previous step"
    return f"corrupted (tag {tag})"


DETECTOR = AllreduceSketch
