"""The sketch's fused C kernel (detectors/native_projection.py) against its eager reference:
values within the float32 projection's rounding, verdicts equal, and where the kernel cannot
run (no compiler, a dtype it does not read), the eager path, said once."""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.common import bucket, detector
from benchmarks.kernels import sketch_work
from detectors import allreduce_sketch as sketch
from detectors import native_build, native_projection
from detectors.native_build import EAGER_INSTEAD
from harness.core.events import CheckWarning
from harness.core.plugins import Bucket, DetectorContext, EventLog, RankInfo

COMPILER = shutil.which(os.environ.get("CC", "cc"))
# Narrow rows read one at a time (4,096 rows of 17-625), wide ones eight at a time (512 rows of
# more than 4,096: over 1 MiB of gradient), with a remainder and a row tail off the vectors.
SIZES = [17, 1000, 437_760, 2_700_001]


def _values(n: int, dtype: torch.dtype, special: str, seed: int = 0) -> torch.Tensor:
    """Gradient-like values over eight decades, subnormals of the dtype among them, and NaN or
    infinity at a few places where asked."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 1, (n,), generator=gen)
    x = x.to(dtype)
    tiny = torch.finfo(dtype).smallest_normal
    x[:: max(1, n // 7)] = tiny / 4  # subnormal in the dtype
    if special == "nan":
        x[n // 3] = math.nan
    elif special == "inf":
        x[n // 2] = -math.inf
    return x


def _eager_and_native(x: torch.Tensor, step: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    weights = sketch.step_weights(step, 0, x.numel())
    return sketch.rider_of(x, weights, native=False), sketch.rider_of(x, weights, native=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_the_kernel_agrees_with_eager_within_the_projections_rounding(dtype, n):
    x = _values(n, dtype, "")
    weights = sketch.step_weights(3, 0, n)
    if COMPILER is None:
        # No compiler here: the native setting is the eager path, exactly.
        assert native_projection.load() is None
        assert torch.equal(*_eager_and_native(x))
        return
    fused = native_projection.project(x, weights)
    assert fused is not None
    eager = sketch.rider_of(x, weights, native=False).double()
    u, v, z = (w.double() for w in weights)
    body = u.numel() * v.numel()
    wide = x.double()
    exact = float(u @ wide[:body].view(u.numel(), v.numel()) @ v + wide[body:] @ z)
    norm = float(wide.norm())
    bound = 4 * 1e-6 * math.sqrt(n) * norm  # the float32 projection's rounding, as calibrated
    assert abs(float(fused[0]) - exact) <= bound
    assert abs(float(eager[0]) - exact) <= bound
    assert math.isclose(math.sqrt(float(fused[1])), norm, rel_tol=1e-5)
    assert math.isclose(float(eager[1]), norm, rel_tol=1e-4)  # float32 sums of squares


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("special", ["nan", "inf"])
def test_nan_and_infinity_reach_both_paths_alike(dtype, special):
    eager, native = _eager_and_native(_values(437_760, dtype, special))
    assert not torch.isfinite(eager[0]) and not torch.isfinite(native[0])
    assert torch.isnan(eager[1]) == torch.isnan(native[1])
    assert torch.isinf(eager[1]) == torch.isinf(native[1])


def test_a_float16_bucket_is_projected_eagerly_said_once(caplog):
    """The kernel reads float32 and bfloat16; a float16 bucket takes the eager path, bit for bit,
    and the log says so once, as docs/configuration.md promises (it said nothing)."""
    x = _values(437_760, torch.float16, "")
    weights = sketch.step_weights(3, 0, x.numel())
    native_build.said.clear()
    built = native_projection.load() is not None  # if not, the build's failure said it
    with caplog.at_level(logging.WARNING, logger=native_build.__name__):
        assert native_projection.project(x, weights) is None
        assert torch.equal(*_eager_and_native(x))
        assert torch.equal(*_eager_and_native(x[::2]))  # not contiguous: said apart
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"{native_projection.WHO} does not apply to a {what} bucket on cpu; the eager path "
        "runs instead, with the same verdicts"
        for what in ("torch.float16", "non-contiguous torch.float16")
        if built
    ], said


def test_weights_that_do_not_cover_the_bucket_are_refused_before_the_kernel_reads():
    x = _values(1000, torch.float32, "")
    weights = sketch.step_weights(3, 0, 999)
    if COMPILER is None:
        assert native_projection.project(x, weights) is None
        return
    with pytest.raises(ValueError, match="not the bucket's 1000"):
        native_projection.project(x, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_verdicts_of_a_reduction_are_the_same_on_both_paths(dtype):
    """Four ranks' contributions summed in the bucket's dtype: clean, within the bound on both
    paths; one element of the sum moved by twice the bound, beyond it on both."""
    world, n = 4, 437_760
    contributions = [_values(n, dtype, "", seed=r) for r in range(world)]
    received = torch.stack([c.float() for c in contributions]).sum(0).to(dtype)
    faulty = received.clone()
    weights = sketch.step_weights(5, 0, n)
    rho, alpha = sketch.sum_rounding(dtype, world, per_rank=0)
    for native in (False, True):
        riders = [sketch.rider_of(c, weights, native) for c in contributions]
        expected = sum(float(r[0]) for r in riders)
        bound = float(sketch.tolerance(sum(float(r[1]) for r in riders), n, 1e-6, rho, alpha))
        faulty[1234] = float(received[1234]) + 2 * bound
        for buffer, alarm in ((received, False), (faulty, True)):
            got = float(sketch.project(buffer, weights, native))
            assert (not abs(got - expected) <= bound) is alarm, (native, alarm)


def _checked_world(
    native: bool, as_tensors: bool, contributions: list[torch.Tensor], spoil, step: int = 0
) -> tuple[list[torch.Tensor], list[tuple[bool, list[float]]]]:
    """Each rank's sketch on a world of len(contributions) ranks whose wrapped hook divides by
    the world (the contribution 1/W, not a float32 number): every rank's rider, then the summed
    riders (`spoil`ed in place, as a faulty reduction would) and the received sum checked on
    every rank. The riders, and each rank's (alarm, detail), step 0's sensitivity after it."""
    world = len(contributions)
    dtype = contributions[0].dtype
    ranks = []
    for r in range(world):
        info, model = RankInfo(r, world, 1), nn.Linear(1, 1).to(dtype)
        ctx = DetectorContext(info, model, None, steps=1, data=tuple((q,) for q in range(world)))
        config = sketch.AllreduceSketch.configure(
            "allreduce_sketch", {"kernels": "native" if native else "eager"}, None
        )
        ranks.append(sketch.AllreduceSketch(config, ctx, EventLog(r, 0)))
    with pytest.MonkeyPatch.context() as patch:
        if as_tensors:  # the path a GPU bucket takes, here with the same figures
            patch.setattr(native_projection, "applies", lambda _bucket: False)
        riders = [
            check.rider(step, Bucket(0, c, [], True, contribution=1 / world))
            for check, c in zip(ranks, contributions, strict=True)
        ]
        summed = torch.stack(riders).sum(0)
        spoil(summed)
        received = torch.stack([(c.float() / world).to(dtype) for c in contributions]).sum(0)
        verdicts = []
        for check in ranks:
            reduced = Bucket(0, received, [], True, {id(check): summed}, contribution=1 / world)
            check.on_reduced_grad(step, reduced)
            for pending in check._log.verdicts.pending:
                verdicts.append((bool(pending.flag), pending.detail.tolist()))
    return riders, verdicts


def _lose_rank_1s_tag(summed: torch.Tensor) -> None:
    summed[2] = 0


def _change_rank_2s_projection(summed: torch.Tensor) -> None:
    summed[-1] *= 1.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("spoil", "alarms"),
    [(lambda _summed: None, [False] * 3), (_lose_rank_1s_tag, [True] * 3),
     (_change_rank_2s_projection, [True] * 3)],
    ids=["clean", "tag", "projection"],
)  # fmt: skip
def test_the_checks_host_figures_give_the_slots_and_verdicts_of_its_tensors(dtype, spoil, alarms):
    """The kernel's figures are read on the host and rounded there as float32 tensors round
    them: the same slots bit for bit, and on every rank the same verdicts and evidence, as
    through tensors (a GPU bucket's path); and the eager kernels' verdicts."""
    contributions = [_values(437_760, dtype, "", seed=r) for r in range(3)]
    host, as_tensors = (_checked_world(True, t, contributions, spoil) for t in (False, True))
    assert all(torch.equal(a, b) for a, b in zip(host[0], as_tensors[0], strict=True))
    assert host[1] == as_tensors[1]
    eager = _checked_world(False, True, contributions, spoil)
    assert [alarm for alarm, _ in eager[1]] == [alarm for alarm, _ in host[1]]
    assert [alarm for alarm, _ in host[1]][::2] == alarms  # each rank's verdict, its sensitivity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_overflowed_with_opposite_signs_alarm_alike_on_both_paths(dtype):
    """Two ranks' gradients overflowed at one element with opposite signs (a float16 step's
    too high loss scale): the slots' sum is NaN, which every rank alarms on, on the host as
    through tensors, with the same evidence."""
    contributions = [_values(437_760, dtype, "", seed=r) for r in range(3)]
    contributions[0][10], contributions[1][10] = math.inf, -math.inf
    host, as_tensors = (_checked_world(True, t, contributions, lambda _s: None) for t in (0, 1))
    alarms = [alarm for alarm, _ in host[1]]
    assert alarms == [alarm for alarm, _ in as_tensors[1]] and alarms[::2] == [True] * 3
    for (_, a), (_, b) in zip(host[1], as_tensors[1], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=0, equal_nan=True)


def test_a_clean_reduction_past_step_2_to_the_24_is_clean_on_both_paths():
    """The slots' step tag is a float32, which from step 2^24 holds step + 1 rounded: the host
    path compares it as the tensors do, rounded alike, and finds no lost tag."""
    contributions = [_values(1000, torch.float32, "", seed=r) for r in range(3)]
    for as_tensors in (False, True):
        _, verdicts = _checked_world(True, as_tensors, contributions, lambda _s: None, 2**24 + 2)
        assert [alarm for alarm, _ in verdicts] == [False] * 3, as_tensors


def test_without_a_compiler_the_sketch_says_so_once_and_runs_eagerly(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SDC_BENCH_CACHE", str(tmp_path / "cache"))
    native_projection.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native_projection.__name__):
            x = _values(1000, torch.float32, "")
            for _ in range(3):
                eager, native = _eager_and_native(x)
                assert torch.equal(eager, native)
        said = [r.getMessage() for r in caplog.records if "native projection" in r.getMessage()]
        assert len(said) == 1 and "no C compiler" in said[0], said
    finally:
        native_projection.load.cache_clear()


def test_a_trial_whose_sketch_kernel_was_not_built_records_that_it_checked_eagerly(
    tmp_path, monkeypatch
):
    """Without a compiler the sketch runs eagerly with the same verdicts; its trial's record
    (the row's `warnings`) says so once over two buckets, not only the log."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("SDC_BENCH_CACHE", str(tmp_path / "cache"))
    native_projection.load.cache_clear()
    try:
        check = detector("allreduce_sketch", torch.float32, kernels="native")
        for index in range(2):
            sketch_work(check, bucket(4096, torch.float32, index=index))
        warned = [e.what for e in check._log.events if isinstance(e, CheckWarning)]
        assert warned == [EAGER_INSTEAD]
    finally:
        native_projection.load.cache_clear()


def _build(cache: Path) -> bool:
    return native_projection.load_from(COMPILER or "cc", cache) is not None


def test_ranks_building_at_once_each_load_a_whole_kernel(tmp_path):
    """Four processes build into one empty cache together (a world's first step): each renames
    its own build into place, so every one loads a complete library, and one file remains
    (without a compiler: none loads, and nothing is left half-written)."""
    cache = tmp_path / "cache"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        built = pool.map(_build, [cache] * 4)
    assert built == [COMPILER is not None] * 4
    left = sorted(p.name for p in cache.iterdir()) if cache.exists() else []
    if COMPILER is None:
        assert left == []
    else:  # the library and its digest
        assert len(left) == 2 and left[1] == f"{left[0]}.sha256", left


def _built_apart(cache: Path) -> bool:
    """`_build` in a process of its own: a damaged library may kill the process that maps it
    (BrokenProcessPool here, where a pool would wait for the dead worker)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_build, cache).result(timeout=120)


def test_a_damaged_cached_kernel_is_rebuilt_not_loaded(tmp_path):
    """A cached build cut short (a full disk, a copy interrupted) was loaded because it existed:
    every rank that touched it died of SIGBUS, each trial a crash, and it stayed in the cache
    for every later run. A build is loaded only when it matches the digest written beside it;
    otherwise it is built again."""
    cache = tmp_path / "cache"
    assert _build(cache) == (COMPILER is not None)  # a whole build: loaded here
    if COMPILER is None:
        assert not cache.exists()
        return
    (library,) = cache.glob("projection-*.so")
    whole = library.read_bytes()
    # Damaged by a copy put in its place: this process maps the whole one, which must stay.
    cut = cache / "cut.so"
    cut.write_bytes(whole[:4000])
    os.replace(cut, library)
    assert _built_apart(cache)
    assert library.read_bytes() == whole
    (cache / f"{library.name}.sha256").unlink()  # a build from before digests were written
    assert _built_apart(cache)
    assert (cache / f"{library.name}.sha256").exists()
