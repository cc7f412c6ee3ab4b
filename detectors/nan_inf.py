"""`nan_inf`: the first published check. Local gradients before the allreduce, and the averaged
gradients after it, must be finite.

One read pass per bucket: a finite sum proves every element finite, because a NaN or an infinity
can never be summed back into a finite number. Only a non-finite sum (which a huge but finite
gradient can also cause) pays for a closer look. No collective: each rank judges what it holds.
"""

from __future__ import annotations

import torch

from harness.plugins import Bucket, Detector


def first_non_finite(flat: torch.Tensor) -> int | None:
    """The flat index of the first NaN or infinity, or None when every element is finite."""
    if torch.isfinite(flat.sum()):
        return None
    bad = (~torch.isfinite(flat)).nonzero()
    return int(bad[0]) if len(bad) else None


class NanInf(Detector):
    name = "nan_inf"

    def _check(self, step: int, bucket: Bucket, phase: str, suspects: list[int]) -> None:
        index = first_non_finite(bucket.buffer)
        if index is None:
            return
        name, offset = _locate(bucket, index)
        evidence = {"bucket": bucket.index, "tensor": name, "index": offset}
        evidence["value"] = str(float(bucket.buffer[index]))
        self.alert(step, phase, suspects, evidence)

    def on_local_grad(self, step: int, bucket: Bucket) -> None:
        self._check(step, bucket, "pre_allreduce", [self.info.rank])

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        # Every receiver sees the same averaged value: the sender cannot be named from here.
        self._check(step, bucket, "post_allreduce", [])


def _locate(bucket: Bucket, index: int) -> tuple[str, int]:
    base = bucket.buffer.storage_offset()
    for name, view in bucket.tensors:
        start = view.storage_offset() - base
        if start <= index < start + view.numel():
            return name, index - start
    return "?", index


DETECTOR = NanInf
