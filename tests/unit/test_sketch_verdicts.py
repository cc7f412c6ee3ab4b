"""allreduce_sketch's verdict on what a reduction handed each receiver, which ranks its alerts
name: four ranks' riders made and their sum handed back in one process (the collective is not
under test here; tests/test_campaigns.py has the NaN contribution in a real world)."""

from __future__ import annotations

import pytest
import torch

from detectors.allreduce_sketch import AllreduceSketch
from harness.core.events import Alert
from harness.core.plugins import Bucket, DetectorContext, EventLog, RankInfo

WORLD, STEP = 4, 3


def _named(
    kernels: str, grads: list[torch.Tensor], struck: tuple[int, float] | None
) -> list[list[int]]:
    """Each receiver's alerts' suspects, the sum right; `struck`: a rider slot (1 + r: sender
    r's tag, 1 + WORLD + r: its projection) and the value written there on receiver 1 alone,
    after the collective."""
    data = tuple((r,) for r in range(WORLD))
    ranks = []
    for r in range(WORLD):
        log = EventLog(r, r)
        ctx = DetectorContext(RankInfo(r, WORLD, 1), torch.nn.Linear(2, 2), None, 10, data)
        check = AllreduceSketch(AllreduceSketch.Config(kernels=kernels), ctx, log)
        ranks.append((check, Bucket(0, grads[r].clone(), [], is_last=True), log))
    summed = sum(c.rider(STEP, b) for c, b, _ in ranks)
    named = []
    for r, (check, bucket, log) in enumerate(ranks):
        bucket.buffer.copy_(sum(grads))
        riders = summed.clone()
        if struck is not None and r == 1:
            riders[struck[0]] = struck[1]
        bucket.riders[id(check)] = riders
        check.on_reduced_grad(STEP, bucket)
        log.verdicts.resolve()
        named += [e.suspect_ranks for e in log.events if isinstance(e, Alert)]
    return named


@pytest.mark.parametrize("kernels", ["native", "eager"])
def test_a_contribution_not_finite_names_its_sender_and_a_struck_slot_its_receiver(kernels):
    """A NaN in rank 3's gradient, summed right: every receiver's sum is NaN, and each named
    itself; the slots name rank 3. Sender 3's slot made NaN on receiver 1 alone (a rider
    strike after the collective): receiver 1's sum is finite, and it names itself, not rank 3."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, generator=gen) for _ in range(WORLD)]
    poisoned = [*grads[:3], grads[3].clone().index_fill_(0, torch.tensor([7]), float("nan"))]
    assert _named(kernels, poisoned, None) == [[3]] * WORLD
    assert _named(kernels, grads, struck=(1 + WORLD + 3, float("nan"))) == [[1]]


@pytest.mark.parametrize("kernels", ["native", "eager"])
@pytest.mark.parametrize(
    ("size", "dtype"),
    [(4096, torch.float32), (600_000, torch.bfloat16)],
    ids=["small", "1.2MB-bf16"],
)
def test_a_garbled_tag_names_its_receiver_and_a_known_answer_its_sender(kernels, size, dtype):
    """Sender 2's tag (STEP + 1 = 4) garbled on receiver 1 alone, by a flip of its lowest
    exponent bit (to 2, a value no way of summing contributions gives): no sender wrote it, and
    receiver 1 names itself. A tag of 0 there reads as sender 2's contribution missing from the
    sum, the one answer the slots give for it: the sender is named. On a bucket of 1.2 MB of
    bfloat16 gradients as on a small float32 one."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(size, generator=gen).to(dtype) for _ in range(WORLD)]
    assert _named(kernels, grads, struck=(1 + 2, 2.0)) == [[1]]
    assert _named(kernels, grads, struck=(1 + 2, 0.0)) == [[2]]
