"""`nan_inf`: the first published check. Local gradients before the allreduce, and the averaged
gradients after it, must be finite.

One read pass per bucket: a finite sum proves every element finite, because a NaN or an infinity
can never be summed back into a finite number. The sum accumulates in float64, where no sum of
finite float32 (or 16-bit) elements overflows, so a non-finite sum also proves a non-finite
element: the verdict stays on the device (harness.runtime.verdicts.Verdicts) and only an alarm pays
for the closer look that names the element. No collective: each rank judges what it holds.
"""

from __future__ import annotations

import torch

from harness.runtime.plugins import Bucket, Detector


def non_finite(flat: torch.Tensor) -> torch.Tensor:
    """Whether `flat` holds a NaN or an infinity: a 0-d bool tensor on its device, unread."""
    return ~torch.isfinite(flat.sum(dtype=torch.float64))


def first_non_finite(flat: torch.Tensor) -> int | None:
    """The flat index of the first NaN or infinity, or None when every element is finite."""
    if not non_finite(flat):
        return None
    bad = (~torch.isfinite(flat)).nonzero()
    return int(bad[0]) if len(bad) else None


class NanInf(Detector):
    name = "nan_inf"

    def _check(self, step: int, bucket: Bucket, phase: str, suspects: list[int]) -> None:
        # The buffer is kept until the verdict is read: dividing it by the world size (before
        # the collective) leaves its NaNs and infinities where they are.
        buffer, tensors, index = bucket.buffer, bucket.tensors, bucket.index

        def explain(_: list[float]) -> None:
            evidence: dict = {"bucket": index}
            first = self.read((~torch.isfinite(buffer)).nonzero().reshape(-1)[:1])
            if first:  # a buffer reused before the read (a user's DDP bucket) may hold no more
                name, offset = _locate(buffer, tensors, first[0])
                evidence |= {"tensor": name, "index": offset}
                evidence["value"] = str(self.read(buffer[first[0]]))
            self.alert(step, phase, suspects, evidence)

        self.defer(step, phase, non_finite(buffer), explain)

    def on_local_grad(self, step: int, bucket: Bucket) -> None:
        self._check(step, bucket, "pre_allreduce", [self.info.rank])

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        # Every receiver sees the same averaged value: the sender cannot be named from here.
        self._check(step, bucket, "post_allreduce", [])


def _locate(
    buffer: torch.Tensor, tensors: list[tuple[str, torch.Tensor]], index: int
) -> tuple[str, int]:
    base = buffer.storage_offset()
    for name, view in tensors:
        start = view.storage_offset() - base
        if start <= index < start + view.numel():
            return name, index - start
    return "?", index


DETECTOR = NanInf
