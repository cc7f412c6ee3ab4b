"""Checks keep their verdicts on the device (docs/design.md, section 6): a step reads them back
at most once (act mode's stop point), observe mode only at checkpoint time and when the trial
ends. Counted through the one way a check reads (harness.core.verdicts.Verdicts.read), on real
3-rank DDP over gloo; the placement of what the checks keep is shown on the `meta` device,
where any host read or stray CPU tensor fails."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from detectors import allreduce_sketch, grad_stats, nan_inf, spiky_loss
from harness.config.schema import FaultConfig, TrialSpec
from harness.core.events import Alert, HostReads, of
from harness.core.plugins import Bucket, DetectorContext, EventLog, RankInfo
from harness.launch.world import World
from harness.runtime.workloads import Workload
from tests.conftest import compose_run

CHECKS = "detectors=[nan_inf,grad_stats,allreduce_sketch,weight_consensus,spiky_loss]"
# Checkpoints after steps 2 and 5, consensus at each (its own looks).
BASE = ("campaign=single", "topology.nodes=3", CHECKS, "workload.steps=6",
        "checkpoint.interval=3", "detectors.weight_consensus.interval=3",
        "workload.micro_batches=2")  # fmt: skip
CHECKPOINT_STEPS = {2, 5}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reads")
    w = World(compose_run(*BASE).topology, tmp / "world", tmp / "store")
    yield w
    w.close()


def _trial(world, name: str, mode: str, *overrides: str, fault: FaultConfig | None = None):
    fault = fault or FaultConfig()
    run = compose_run(*BASE, *overrides)
    run = replace(run, detectors={n: c.in_mode(mode) for n, c in run.detectors.items()})
    outcome = world.run(run, TrialSpec(name, 0, fault))
    assert outcome.crash is None, outcome.crash
    return outcome.parts


def test_act_mode_reads_the_verdicts_once_a_step_and_at_a_checkpoint_once_more(world):
    parts = _trial(world, "act", "act")
    for part in parts:
        assert len(part.host_reads) == 6 and part.stopped_step is None
        for step, reads in enumerate(part.host_reads):
            # The stop point's read; a checkpoint's own stop point reads the approval with it.
            assert reads == (2 if step in CHECKPOINT_STEPS else 1), (part.rank, step, reads)
        (summary,) = of(HostReads, part.events)
        assert summary.most_in_a_step == 2 and summary.total == sum(part.host_reads)


def test_observe_mode_reads_nothing_between_checkpoints(world):
    parts = _trial(world, "observe", "observe")
    for part in parts:
        for step, reads in enumerate(part.host_reads):
            # At a checkpoint: the approval with every verdict taken since the last one.
            assert reads == (1 if step in CHECKPOINT_STEPS else 0), (part.rank, step, reads)


def test_a_deferred_verdict_still_stops_every_rank_in_its_step_in_bfloat16(world):
    nan = FaultConfig(site="grad", model="value", value="nan", ranks=(1,), steps=(3,))
    parts = _trial(world, "bf16-nan", "act", "workload.dtype=bfloat16", fault=nan)
    assert {p.stopped_step for p in parts} == {3}
    # Every rank receives the NaN; only rank 1 held it before the collective.
    assert [p.stopped_by for p in parts] == ["nan_inf"] * 3
    phases = [{e.phase for e in of(Alert, p.events)} for p in parts]
    assert phases == [{"post_allreduce"}, {"pre_allreduce", "post_allreduce"}, {"post_allreduce"}]
    (local,) = [e for e in of(Alert, parts[1].events) if e.phase == "pre_allreduce"]
    assert local.step == 3 and local.evidence["value"] == "nan"
    # Steps before the fault read once each; the alarm's explanation costs its own reads.
    assert parts[0].host_reads[:3] == [1, 1, 2]


def _meta_bucket(numel: int, dtype: torch.dtype) -> Bucket:
    buffer = torch.empty(numel, dtype=dtype, device="meta")
    return Bucket(0, buffer, [("w", buffer)], is_last=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_what_the_checks_keep_lives_on_the_models_device_and_is_never_read_in_the_step(dtype):
    """On `meta` a tensor has no values: any read in a hook, or a CPU tensor mixed into the
    device's, raises. The verdicts wait, unread, on the model's device."""
    run = compose_run("campaign=single", "topology.nodes=3", "workload.hidden=4096")
    info = RankInfo(1, 3, 1, device="meta")
    model = Workload(run.workload, "meta").build_model().to(dtype)
    ctx = DetectorContext(info, model, None, 4, ((0,), (1,), (2,)))
    log = EventLog(info.rank, info.node)
    checks = [
        module.DETECTOR(module.DETECTOR.configure("d", {"mode": "act"}, run.topology), ctx, log)
        for module in (nan_inf, grad_stats, allreduce_sketch, spiky_loss)
    ]
    for step in (0, 1):
        for check in checks:
            check.on_loss(step, torch.empty((), device="meta"))
        bucket = _meta_bucket(300_000, dtype)
        for check in checks:
            check.on_local_grad(step, bucket)
        riders = {id(c): r for c in checks if (r := c.rider(step, bucket)) is not None}
        assert {r.device.type for r in riders.values()} == {"meta"}
        bucket.riders = {owner: torch.empty_like(r) for owner, r in riders.items()}
        for check in checks:
            check.on_reduced_grad(step, bucket)
    pending = log.verdicts.pending
    assert log.verdicts.reads == 0 and {p.flag.device.type for p in pending} == {"meta"}
    # nan_inf twice a step, grad_stats' outliers and spikes, the sketch (and its step-0
    # sensitivity record), spiky_loss once per loss.
    assert len(pending) == 2 * 2 + 2 * 2 + 3 + 2 and not log.events
