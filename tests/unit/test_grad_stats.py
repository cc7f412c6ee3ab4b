"""grad_stats's verdict on the norms the reduction gathered (its rider table), on one rank: which
ranks an outlier names."""

from __future__ import annotations

import pytest
import torch

from detectors.grad_stats import GradStats
from harness.core.events import Alert
from harness.core.plugins import Bucket, DetectorContext, EventLog, RankInfo


def _suspects(norms: list[float]) -> list[list[int]]:
    """The suspects of each alert rank 0 raises on these gathered gradient norms (losses 1)."""
    world = len(norms)
    log = EventLog(0, 0)
    ctx = DetectorContext(RankInfo(0, world, 1), torch.nn.Linear(2, 2), None, 1, ((0,),))
    check = GradStats(GradStats.Config(), ctx, log)
    table = torch.tensor([[n, 1.0] for n in norms]).reshape(-1)
    bucket = Bucket(0, torch.zeros(4), [], is_last=True, riders={id(check): table})
    check.on_reduced_grad(3, bucket)
    log.verdicts.resolve()
    return [e.suspect_ranks for e in log.events if isinstance(e, Alert)]


@pytest.mark.parametrize(
    ("norms", "named"),
    [
        # Rank 1's gradient scaled by 0.001 in a world of 2: the median of two is the lower,
        # rank 1's, so rank 0 stood out and was named alone, the healthy one. Of two, neither
        # is the odd one out: an alarm naming none (recovery rolls back without quarantining a
        # node, the guard's alarm exits 87; naming both quarantined every node).
        ([0.267, 0.0017], [[]]),
        ([0.267, 267.0], [[]]),
        ([0.267, 0.27], []),
        # A norm not finite names its rank, whatever the world.
        ([0.267, float("inf")], [[1]]),
        # Of four, the outlier alone, above or below.
        ([0.26, 0.27, 0.0017, 0.25], [[2]]),
        ([0.26, 0.27, 267.0, 0.25], [[2]]),
    ],
)
def test_an_outlier_names_its_rank_where_one_stands_out(norms, named):
    assert _suspects(norms) == named
