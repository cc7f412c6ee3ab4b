"""The benchmarks under pytest-benchmark: `.venv/bin/pytest benchmarks` (not part of `pytest`,
whose testpaths is tests/).

Benchmarks 1-3 are one pytest-benchmark test per variant, grouped per figure, so its table
shows each check next to its read pass (the `(1.0)` column is the ratio within the group).
pytest-benchmark times the variants one after another, not interleaved as `python -m
benchmarks` does, so on a busy machine its ratios are noisier; the figures of record are the
latter's. Benchmarks 4-7 run once each (`pedantic`, one round), their figures stored in the
JSON report's `extra_info` (`--benchmark-json=FILE`). Targets are reported, never asserted.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks import growth, kernels, numerics, step_overhead, throughput
from benchmarks.common import Rotation, bucket, detector, gpt
from benchmarks.worlds import Worlds

FLOAT32_BUCKET = kernels.BUCKET_BYTES // 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    torch.set_num_threads(1)  # as a rank runs (topology.threads_per_rank=1)


@pytest.fixture(scope="module")
def buckets():
    return Rotation(lambda: bucket(FLOAT32_BUCKET, torch.float32), kernels.BUCKET_BYTES)


@pytest.fixture(scope="module")
def models():
    params = [p.detach() for p in gpt(**kernels.BIG_MODEL).parameters()]
    return Rotation(lambda: [p.clone() for p in params], sum(p.nbytes for p in params))


@pytest.mark.benchmark(group="1 nan_inf, 25 MiB float32 bucket")
@pytest.mark.parametrize("variant", ["torch.sum", "nan_inf"])
def test_nan_inf(benchmark, buckets, variant):
    check = detector("nan_inf")
    if variant == "torch.sum":
        benchmark(lambda: buckets.next().buffer.sum())
    else:
        benchmark(lambda: check.on_local_grad(kernels.STEP, buckets.next()))


@pytest.mark.benchmark(group="2 weight fingerprint, 59M float32 parameters")
@pytest.mark.parametrize("variant", ["read pass", "fingerprint", "sha1 (peer)"])
def test_fingerprint(benchmark, models, variant):
    fn = {"read pass": kernels.read_pass, "fingerprint": kernels.fingerprint_table,
          "sha1 (peer)": kernels.sha1_table}[variant]  # fmt: skip
    benchmark(lambda: fn(models.next()))


@pytest.mark.benchmark(group="3 allreduce_sketch, 25 MiB float32 bucket")
@pytest.mark.parametrize("variant", ["torch.sum", "allreduce_sketch"])
def test_sketch(benchmark, buckets, variant):
    sketch = detector("allreduce_sketch")
    if variant == "torch.sum":
        benchmark(lambda: buckets.next().buffer.sum())
    else:
        benchmark(lambda: kernels.sketch_work(sketch, buckets.next()))


@pytest.fixture(scope="module")
def worlds():
    with Worlds() as pool:
        yield pool


def _once(benchmark, fn, *args):
    figures = benchmark.pedantic(fn, args=args, rounds=1, iterations=1)
    benchmark.extra_info.update({f.key: f.value for f in figures})
    return figures


@pytest.mark.timeout(3600)
@pytest.mark.benchmark(group="4 step overhead")
def test_step_overhead(benchmark, worlds, tmp_path):
    _once(benchmark, step_overhead.run, worlds, tmp_path, step_overhead.Plan())


@pytest.mark.timeout(3600)
@pytest.mark.benchmark(group="4 the comm hook against plain DDP")
def test_hook_cost(benchmark, worlds):
    _once(benchmark, step_overhead.hook_run, worlds, step_overhead.Plan())


@pytest.mark.timeout(3600)
@pytest.mark.benchmark(group="5 campaign throughput")
def test_throughput(benchmark, tmp_path):
    _once(benchmark, throughput.run, tmp_path, throughput.Plan())


@pytest.mark.timeout(3600)
@pytest.mark.benchmark(group="6 growth")
def test_growth(benchmark, worlds, tmp_path):
    _once(benchmark, growth.run, worlds, tmp_path, growth.Plan())


@pytest.mark.timeout(3600)
@pytest.mark.benchmark(group="7 16-bit step on the CPU")
def test_numerics(benchmark):
    _once(benchmark, numerics.run, numerics.Plan())
