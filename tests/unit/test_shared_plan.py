"""Rank 0 validates a torchrun plan once and the other ranks take its result from the store:
the plan itself, or at once a refusal, whatever stopped the validation."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from harness.errors import ConfigError
from harness.launch.torchrun_world import PlanRefused, shared_plan
from tests.conftest import compose_run


def _store() -> dist.Store:
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    return store


def test_the_other_ranks_take_rank_0s_validated_plan_without_validating():
    store, run = _store(), compose_run("campaign=smoke")
    assert shared_plan(store, 0, lambda: run) is run

    def never() -> None:
        raise AssertionError("a rank other than 0 validated the plan")

    assert shared_plan(store, 1, never) == run


@pytest.mark.parametrize("error", [ConfigError("workload", "bad"), KeyError("topology")])
def test_whatever_stops_rank_0_refuses_the_plan_on_the_others_at_once(error):
    store = _store()

    def refuse() -> None:
        raise error

    with pytest.raises(type(error)):
        shared_plan(store, 0, refuse)
    with pytest.raises(PlanRefused):
        shared_plan(store, 3, refuse)
