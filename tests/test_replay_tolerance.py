"""Replay's tolerance in 16-bit dtypes is derived (detectors/replay.py, derived_rtol): clean
recomputations on 1 and 2 threads stay inside it, and the smallest scaled gradient element it
catches, per dtype, is where the derivation says."""

from __future__ import annotations

import pytest
import torch

from detectors.replay import agree, derived_rtol, triple
from harness.runtime.workloads import Workload, WorkloadConfig

FACTORS = (1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
RTOL = {"float32": 1e-5, "bfloat16": derived_rtol(torch.bfloat16),
        "float16": derived_rtol(torch.float16)}  # fmt: skip


def _gradient(dtype: str, threads: int) -> tuple[float, list[tuple[str, torch.Tensor]]]:
    cfg = WorkloadConfig(
        name="mlp", dtype=dtype, steps=4, seed=0, micro_batches=1, micro_batch_size=32, lr=3e-3
    )
    workload = Workload(cfg)
    model = workload.build_model()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loss = workload.loss(model, workload.batch(2, 1, 0))
        grads = torch.autograd.grad(loss, list(model.parameters()))
    finally:
        torch.set_num_threads(before)
    names = [n for n, _ in model.named_parameters()]
    return loss.item(), list(zip(names, grads, strict=True))


@pytest.mark.parametrize("dtype", list(RTOL))
def test_smallest_scaled_gradient_caught_per_dtype(dtype):
    rtol = RTOL[dtype]
    loss, grads = _gradient(dtype, 1)
    clean = triple(loss, grads)
    # Clean: the same gradient on 2 threads agrees (the derivation's rounding, measured).
    assert agree(clean, triple(*_gradient(dtype, 2)), rtol)
    # The largest element of the gradient, scaled: caught from the factor the derivation gives.
    flat = torch.cat([g.reshape(-1).double() for _, g in grads])
    largest = float(flat.abs().max())
    predicted = 1 + rtol * float(flat.norm()) / largest
    caught = []
    for factor in FACTORS:
        scaled = [(n, g.clone()) for n, g in grads]
        for _, g in scaled:
            view = g.view(-1)
            hit = (view.double().abs() == largest).nonzero()
            if len(hit):
                view[hit[0]] *= factor
                break
        if not agree(clean, triple(loss, scaled), rtol):
            caught.append(factor)
    smallest = min(caught)
    assert caught == [f for f in FACTORS if f >= smallest], "every larger factor is caught too"
    # The first listed factor above the prediction (rounding of the scaled value aside).
    assert smallest == min(f for f in FACTORS if f > predicted * 1.001), (smallest, predicted)
    print(f"{dtype}: rtol {rtol:.2g}, smallest caught factor of the largest element {smallest}")
