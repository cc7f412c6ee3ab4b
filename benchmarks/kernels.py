"""Benchmarks 1-3: each check's arithmetic against one read pass (`torch.sum`) over its bytes.

1. `nan_inf` over a gradient bucket (the detector's hook, as the comm hook calls it).
2. The weight fingerprint table over a model's parameters (what `weight_consensus` gathers),
   and the peer method: Megatron-LM's copy to the CPU and SHA-1 per tensor.
3. `allreduce_sketch` per bucket: its rider before the allreduce, its projection after.
4. `matmul_checksum` on one product of the `gpt` workload (its MLP's first Linear, 1024 tokens
   of 128 features into 512): the forward check against the product itself, and against one read
   pass over the product's operands and output, its arithmetic in C (the default), eager and
   compiled (per kind of product and per workload step: benchmarks/products.py).

The reference bucket is DDP's default (25 MiB); the reference model is the `gpt` workload
widened to about 59M parameters, so that both, like real ones, are read from memory rather
than from the cache. The tiny workload's own sizes and bfloat16 are shown for information.
Runs on one thread, like a rank (`topology.threads_per_rank=1`).
"""

from __future__ import annotations

import csv
import hashlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import Rotation, bucket, detector, gpt, params_of
from benchmarks.timing import Figure, interleaved, paired_ratio
from detectors.fingerprint import bits_fingerprint
from harness.core.matmuls import MatmulCall
from harness.core.plugins import Bucket

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
# The gpt workload at width 512 and 16 layers, vocabulary 8192: about 59M parameters.
BIG_MODEL = {"width": 512, "layers": 16, "vocab": 8192}
STEP = 1  # any step but 0, where the sketch also logs its sensitivity once


def read_pass(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.sum()


def fingerprint_table(tensors: list[torch.Tensor]) -> torch.Tensor:
    """What weight_consensus gathers: two words per tensor (its `_consensus`, before the
    all_gather)."""
    return torch.tensor([w for t in tensors for w in bits_fingerprint(t)], dtype=torch.int64)


def sha1_table(tensors: list[torch.Tensor]) -> list[bytes]:
    """The peer method, as Megatron-LM's check_param_hashes_across_dp_replicas computes it.
    On the CPU its copy to the CPU is free, which only flatters it."""
    return [hashlib.sha1(t.data.to("cpu").float().numpy(force=True)).digest() for t in tensors]


def sketch_work(sketch, b: Bucket) -> None:
    """The sketch's per-bucket work: rider before the collective, projection after. A world of
    one: the reduced rider is the rider itself."""
    b.riders = {id(sketch): sketch.rider(STEP, b)}
    sketch.on_reduced_grad(STEP, b)


def bucket_ratio(kind: str, numel: int, dtype: torch.dtype, rounds: int, **params: Any) -> float:
    """Time of one check (`nan_inf` or `allreduce_sketch`, with `params` set) over a bucket /
    `torch.sum` of it."""
    check = detector(kind, dtype, **params)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    buckets = Rotation(lambda: bucket(numel, dtype), nbytes)
    work: Callable[[Bucket], None] = (
        (lambda b: check.on_local_grad(STEP, b))
        if kind == "nan_inf"
        else (lambda b: sketch_work(check, b))
    )
    fns = {"read": lambda: buckets.next().buffer.sum(), "check": lambda: work(buckets.next())}
    return paired_ratio(interleaved(fns, rounds), "check", "read")


def model_times(model: nn.Module, rounds: int, peer: bool) -> dict[str, list[float]]:
    params = [p.detach() for p in model.parameters()]
    models = Rotation(lambda: [p.clone() for p in params], sum(p.nbytes for p in params))
    fns = {
        "read": lambda: read_pass(models.next()),
        "fingerprint": lambda: fingerprint_table(models.next()),
    }
    if peer:
        fns["sha1"] = lambda: sha1_table(models.next())
    return interleaved(fns, rounds)


def fingerprint_figures(model: nn.Module, rounds: int, tag: str, targets: bool) -> list[Figure]:
    n = params_of(model)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    times = model_times(model, rounds, peer=targets)
    what = f"{n / 1e6:.3g}M params, {dtype}"
    figures = [
        Figure(
            f"fingerprint_vs_read{tag}",
            f"weight fingerprint / one read pass ({what})",
            paired_ratio(times, "fingerprint", "read"),
            target=1.25 if targets else None,
        )
    ]
    if targets:
        speedup = paired_ratio(times, "sha1", "fingerprint")
        label = f"speed-up over copy to CPU + SHA-1 per tensor ({what})"
        figures.append(Figure(f"fingerprint_vs_sha1{tag}", label, speedup, target=10, op=">="))
        # The most any fingerprint that reads its data once could gain over SHA-1 here.
        label = f"SHA-1 per tensor / one read pass ({what}): the bound on that speed-up"
        figures.append(Figure(f"sha1_vs_read{tag}", label, paired_ratio(times, "sha1", "read")))
    return figures


def run(rounds: int = 15, quick: bool = False) -> list[Figure]:
    """Figures 1-3. `quick`: tiny sizes, one code path each, no meaningful numbers."""
    torch.set_num_threads(1)
    big = BUCKET_BYTES // 4 if not quick else 2**16
    bf16 = BUCKET_BYTES // 2 if not quick else 2**16
    tiny = params_of(gpt())
    size = f"{big * 4 / 2**20:.3g} MiB"

    def bucket_figures(check: str, key: str, label: str, target: float) -> list[Figure]:
        """The check on a float32 bucket (against its target), a bfloat16 one and the tiny
        model's gradient (for information)."""
        return [
            Figure(key, f"{label}, {size} float32 bucket",
                   bucket_ratio(check, big, torch.float32, rounds), target=target),
            Figure(f"{key}_bf16", f"{label}, {size} bfloat16 bucket",
                   bucket_ratio(check, bf16, torch.bfloat16, rounds)),
            Figure(f"{key}_tiny", f"{label}, gpt workload gradient ({tiny})",
                   bucket_ratio(check, tiny, torch.float32, rounds)),
        ]  # fmt: skip

    figures = bucket_figures("nan_inf", "nan_inf_vs_sum", "nan_inf / torch.sum", 1.25)
    model = gpt(**BIG_MODEL) if not quick else gpt()
    figures += fingerprint_figures(model, rounds, "", targets=True)
    figures += fingerprint_figures(model.to(torch.bfloat16), rounds, "_bf16", targets=False)
    if not quick:
        figures += fingerprint_figures(gpt(), rounds, "_tiny", targets=False)
    del model
    label = "allreduce_sketch rider + check / torch.sum"
    figures += bucket_figures("allreduce_sketch", "sketch_vs_read", label, 2.0)
    # The same check by torch's operations alone (its fallback where no C compiler is found).
    figures += [
        Figure(f"sketch_vs_read_eager{tag}", f"{label}, eager, {size} {name} bucket",
               bucket_ratio("allreduce_sketch", numel, dtype, rounds, kernels="eager"))
        for numel, dtype, name, tag in ((big, torch.float32, "float32", ""),
                                        (bf16, torch.bfloat16, "bfloat16", "_bf16"))
    ]  # fmt: skip
    for dtype, tag in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
        # Not compiled in a quick run: tests/unit/test_checksum_kernels.py compiles the same.
        figures += checksum_figures(dtype, tag, rounds, compiled=not quick)
    return figures


def checksum_figures(dtype: torch.dtype, tag: str, rounds: int, compiled: bool) -> list[Figure]:
    """matmul_checksum's forward check of one Linear of `gpt`'s MLP, through its hooks: its
    arithmetic in C (the default, detectors/native_checksum.py), eager (the reference) and, with
    `compiled`, compiled by Inductor (detectors/checksum_kernels.py), the compiled one's first
    call (its compile, or a load from Inductor's cache) apart."""
    kinds = ("native", "eager", "compiled") if compiled else ("native", "eager")
    checks = {k: detector("matmul_checksum", kernels=k) for k in kinds}
    x, weight, bias = torch.randn(16, 64, 128), torch.randn(512, 128), torch.randn(512)
    x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
    output = F.linear(x, weight, bias)

    def checked(kernels: str) -> None:
        check = checks[kernels]
        call = MatmulCall(F.linear, [x, weight, bias], {}, ("blocks.0.fc",))
        check.on_matmul_operands(STEP, call)
        check.on_matmul_output(STEP, call, output)
        check.found.clear()

    calls = {
        "check": lambda: checked("native"),
        "eager": lambda: checked("eager"),
        "product": lambda: F.linear(x, weight, bias),
        "read": lambda: read_pass([x, weight, output]),
    }
    if compiled:
        started = time.perf_counter()
        checked("compiled")
        first = time.perf_counter() - started
        calls["compiled"] = lambda: checked("compiled")
    times = interleaved(calls, rounds)
    name = "bfloat16" if tag else "float32"
    figures = [
        Figure(f"checksum_vs_product{tag}", f"matmul_checksum forward / the product ({name})",
               paired_ratio(times, "check", "product")),
        Figure(f"checksum_vs_read{tag}",
               f"matmul_checksum forward / one read of operands and output ({name})",
               paired_ratio(times, "check", "read")),
        Figure(f"checksum_eager_vs_read{tag}",
               f"matmul_checksum forward, eager / one read of operands and output ({name})",
               paired_ratio(times, "eager", "read")),
    ]  # fmt: skip
    if compiled:
        figures += [
            Figure(f"checksum_compiled_vs_read{tag}",
                   f"matmul_checksum forward, compiled / one read of operands and output ({name})",
                   paired_ratio(times, "compiled", "read")),
            Figure(f"checksum_compile_s{tag}",
                   f"matmul_checksum forward, compiled: its first call ({name})", first, unit="s"),
        ]  # fmt: skip
    return figures


def profile(out: Path, quick: bool = False) -> None:
    """Where the time of the fingerprint and the sketch goes: torch.profiler tables of one
    fingerprint table over the reference model and of the sketch's per-bucket work (float32
    and bfloat16 each), written to `out/profile_*.txt`."""
    torch.set_num_threads(1)
    model = gpt(**BIG_MODEL) if not quick else gpt()
    for dtype in (torch.float32, torch.bfloat16):
        params = [p.detach() for p in model.to(dtype).parameters()]
        name = str(dtype).removeprefix("torch.")
        _profile(out / f"profile_fingerprint_{name}.txt", fingerprint_table, params)
        numel = BUCKET_BYTES // dtype.itemsize if not quick else 2**16
        sketch, b = detector("allreduce_sketch", dtype), bucket(numel, dtype)
        _profile(out / f"profile_sketch_{name}.txt", sketch_work, sketch, b)


def size_sweep(out: Path, quick: bool = False, rounds: int = 9) -> None:
    """Each check over one read pass, by tensor size and dtype (cold data): where a check's
    fixed costs stop mattering. Written to `out/profile_sizes.csv`."""
    torch.set_num_threads(1)
    sizes = [4**k for k in (range(6, 13) if not quick else (6, 7))]  # 4 Ki .. 16 Mi elements
    rows = [size_row(d, n, rounds) for d in (torch.float32, torch.bfloat16) for n in sizes]
    with open(out / "profile_sizes.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def size_row(dtype: torch.dtype, numel: int, rounds: int) -> dict:
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    tensors = Rotation(lambda: bucket(numel, dtype, tensors=1), nbytes)
    nan_inf, sketch = detector("nan_inf", dtype), detector("allreduce_sketch", dtype)
    fns = {
        "read": lambda: tensors.next().buffer.sum(),
        "nan_inf": lambda: nan_inf.on_local_grad(STEP, tensors.next()),
        "fingerprint": lambda: bits_fingerprint(tensors.next().buffer),
        "sketch": lambda: sketch_work(sketch, tensors.next()),
    }
    times = interleaved(fns, rounds)
    row = {"dtype": str(dtype).removeprefix("torch."), "numel": numel,
           "read_us": round(1e6 * statistics.median(times["read"]), 2)}  # fmt: skip
    checks = [name for name in fns if name != "read"]
    return row | {f"{name}_x": round(paired_ratio(times, name, "read"), 2) for name in checks}


def _profile(path: Path, fn: Callable[..., object], *args: object, calls: int = 3) -> None:
    fn(*args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn(*args)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    path.write_text(f"{calls} calls\n{table}\n")
