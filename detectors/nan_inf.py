"""`nan_inf`: the first published check. Local gradients before the allreduce, and the averaged
gradients after it, must be finite.

One read pass per bucket: its smallest and largest element (`torch.aminmax`, one reduction
without a temporary) are both finite exactly when every element is, since a NaN makes both NaN
and an infinity becomes one of them; unlike a sum, finite elements can never overflow them. The
verdict stays on the device (harness.core.verdicts.Verdicts) and only an alarm pays for the
closer look that names the element. No collective: each rank judges what it holds.

A sum would be one pass too, but finite float32 elements above 1e31 (an exponent flip's size)
overflow it, and accumulating in float64 instead, as this check did for a while, costs about 20
read passes on the CPU (a conversion per element); aminmax costs 1.25-1.4 (benchmarks/kernels.py).

Cost per step (sdc-plan): bytes = 2*B*N, flops = 0: one read pass of the local gradients and one of
the averaged ones (the symbols: harness/analysis/estimates.py).
"""

from __future__ import annotations

import torch

from harness.core.plugins import Bucket, Detector


def non_finite(flat: torch.Tensor) -> torch.Tensor:
    """Whether `flat` holds a NaN or an infinity: a 0-d bool tensor on its device, unread."""
    if flat.is_complex():  # its real and imaginary parts
        flat = torch.view_as_real(flat)
    if flat.numel() == 0:  # a chunk of a dtype that only empty parameters hold
        return torch.zeros((), dtype=torch.bool, device=flat.device)
    low, high = torch.aminmax(flat)
    return ~(torch.isfinite(low) & torch.isfinite(high))


class NanInf(Detector):
    name = "nan_inf"
    # Each rank judges what it holds: its local gradient, whole, and the shard it receives.
    parallel = ("ddp", "fsdp", "hsdp")

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
