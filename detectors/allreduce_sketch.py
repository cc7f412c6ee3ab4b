"""`allreduce_sketch`: closes the published checks' blind spot inside the allreduce.

A sum is linear: with fixed signs s (one per block of the bucket), the projection of the
average equals the average of the projections. Each rank projects its local bucket (already
divided by the world size) and the projection rides along with the bucket's own allreduce (no
collective of its own), together with the bucket's L2 norm. After the collective every rank
projects what it received and compares it with the summed projections, within a bound
derived from rounding:

    |s . received - sum_i s . g_i|  <=  rtol * sqrt(n) * sum_i ||g_i||_2

(sqrt(n) * ||g||_2 bounds the L1 norm, which bounds how far rounding can move the projection).
A comm hook that compresses (torch's `fp16_compress_hook`, `bf16_compress_hook`: the bucket is
rounded to the wire dtype, divided by the world size there, and summed there) adds its own
rounding, bounded from the wire dtype's unit roundoff u (half its epsilon) and world size W.
Per element of rank i's bucket g_i: the cast and the division round twice, |c_i - g_i/W| <=
2u |g_i|/W; a sum of W terms rounded at each of its W - 1 additions moves by at most (W - 1) u
sum_i |c_i|. So what arrives is within (W + 1) u sum_i |g_i| / W of the exact average, and the
projection within (W + 1) u sqrt(n) sum_i ||g_i / W||_2: that relative term joins rtol. Below the
wire dtype's smallest normal number the roundings are absolute, at most half a subnormal step
each: one subnormal step per element and rank, n W steps in all (float16's step is 6e-8).
A wrong value delivered to one receiver (`scope=rank`) alarms that rank; a wrong reduction
(`scope=reduction`) alarms every rank, though all replicas agree with each other. Each alert
carries the bound, the smallest perturbation of one element that this step could have seen.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from detectors.fingerprint import signs
from harness.errors import ConfigError
from harness.plugins import Bucket, Detector

# One sign per block of the bucket, BLOCKS equal blocks: the projection is then a row-wise sum
# (one read pass at the speed of `torch.sum`) and a dot product of BLOCKS numbers, where a sign
# per element would read a sign vector as long as the bucket as well. Any one changed element
# still moves the projection by plus or minus its change (in bfloat16, up to the rounding of
# its block's sum, a few percent of the bound at most).
BLOCKS = 4096


def project(buffer: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """`buffer` projected onto `signs` (one per block; the last numel % BLOCKS elements take
    the first signs, one each), in float32."""
    flat = _summable(buffer)
    width = flat.numel() // BLOCKS
    body = width * BLOCKS
    blocks = flat[:body].view(BLOCKS, width).sum(1).float()
    rest = flat[body:].float()
    return torch.dot(blocks, signs) + torch.dot(rest, signs[: rest.numel()])


def rider_of(buffer: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """What rides on the allreduce: the bucket's projection and its L2 norm, in float32."""
    flat = _summable(buffer)
    return torch.stack([project(flat, signs), torch.linalg.vector_norm(flat).float()])


def _summable(buffer: torch.Tensor) -> torch.Tensor:
    """The buffer in a dtype whose sums and norms accumulate in float32 without a converted
    copy (a copy alone costs twice a read pass). float16 is converted: its squares of small
    gradients underflow."""
    return buffer if buffer.dtype in (torch.float32, torch.bfloat16) else buffer.float()


def wire_rounding(wire: torch.dtype, world: int, n: int) -> tuple[float, float]:
    """What summing n elements per rank in `wire` adds to the bound: a relative term (of
    sqrt(n) times the summed norms) and an absolute one (module docstring)."""
    info = torch.finfo(wire)
    return (world + 1) * info.eps / 2, n * world * info.smallest_normal * info.eps


class AllreduceSketch(Detector):
    name = "allreduce_sketch"
    defaults = {"rtol": None}

    @classmethod
    def check(cls, key: str, params: dict[str, Any], topology: Any) -> None:
        rtol = params["rtol"]
        if rtol is not None and (not isinstance(rtol, int | float) or not 0 < rtol < 1):
            raise ConfigError(
                f"{key}.rtol", f"'{rtol}' must be in (0, 1), or null for the dtype's default"
            )

    def __init__(self, params, ctx, log):
        super().__init__(params, ctx, log)
        dtype = next(ctx.model.parameters()).dtype
        # Rounding of a sum of world_size terms and of an n-term projection, with margin; the
        # clean discrepancy measured here is at most 1e-8 (float32) and 2e-5 (bfloat16) of the
        # bound's scale, with 1 and 2 threads per rank, and at most 7e-9 and 7e-5 in synthetic
        # 4-rank reductions of buckets of 1,000 to 6.5M elements.
        self.rtol = params["rtol"] or {torch.float32: 1e-6}.get(dtype, 1e-3)
        self.signs = signs(self.name, BLOCKS)

    def rider(self, step: int, bucket: Bucket) -> torch.Tensor:
        # Projection and norm are linear in the buffer: scaling them is scaling what is summed.
        return rider_of(bucket.buffer, self.signs) * bucket.contribution

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        expected, norms = (float(x) for x in bucket.riders[id(self)])
        got = float(project(bucket.buffer, self.signs))
        n = bucket.buffer.numel()
        relative, absolute = (
            (0.0, 0.0)
            if bucket.wire is None
            else wire_rounding(bucket.wire, self.info.world_size, n)
        )
        bound = (self.rtol + relative) * math.sqrt(n) * norms + absolute
        if step == 0:
            # The smallest change of one element this check can see, next to the gradient norm.
            norm = float(bucket.buffer.float().norm())
            self._log.emit("sensitivity", step=step, detector=self.name, bucket=bucket.index,
                           bound=bound, grad_norm=norm)  # fmt: skip
        if not abs(got - expected) <= bound:  # also true for NaN: a NaN cannot be verified
            evidence = {"bucket": bucket.index, "received": got, "expected": expected,
                        "bound": bound}  # fmt: skip
            self.alert(step, "post_allreduce", [self.info.rank], evidence)


DETECTOR = AllreduceSketch
