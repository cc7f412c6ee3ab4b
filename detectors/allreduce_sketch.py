"""`allreduce_sketch`: closes the published checks' blind spot inside the allreduce.

A sum is linear: with fixed signs s, the projection of the average equals the average of the
projections. Each rank projects its local bucket (already divided by the world size) and the
projection rides along with the bucket's own allreduce (no collective of its own), together
with the bucket's L2 norm. After the collective every rank projects what it received and
compares it with the summed projections, within a bound derived from rounding:

    |s . received - sum_i s . g_i|  <=  rtol * sqrt(n) * sum_i ||g_i||_2

(sqrt(n) * ||g||_2 bounds the L1 norm, which bounds how far rounding can move the projection).
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
        # bound's scale, with 1 and 2 threads per rank.
        self.rtol = params["rtol"] or {torch.float32: 1e-6}.get(dtype, 1e-3)
        self.signs: dict[tuple[str, ...], torch.Tensor] = {}

    def _signs(self, bucket: Bucket) -> torch.Tensor:
        key = tuple(name for name, _ in bucket.tensors)
        if key not in self.signs:
            self.signs[key] = torch.cat([signs(n, t.numel()) for n, t in bucket.tensors])
        return self.signs[key]

    def _project(self, bucket: Bucket) -> torch.Tensor:
        return torch.dot(bucket.buffer.float(), self._signs(bucket))

    def rider(self, step: int, bucket: Bucket) -> torch.Tensor:
        flat = bucket.buffer.float()
        return torch.stack([torch.dot(flat, self._signs(bucket)), torch.dot(flat, flat).sqrt()])

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        expected, norms = (float(x) for x in bucket.riders[id(self)])
        got = float(self._project(bucket))
        bound = self.rtol * math.sqrt(bucket.buffer.numel()) * norms
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
