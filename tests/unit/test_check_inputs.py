"""What the default checks are handed beside plain float gradients and Adam: an empty chunk and
complex values (nan_inf), another optimizer's state (weight_consensus)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from benchmarks.common import detector
from detectors.nan_inf import non_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64])
def test_an_empty_chunk_is_finite_and_a_complex_ones_parts_are_read(dtype):
    """A dtype that only zero-element parameters hold gets an empty chunk: finite, not an
    error at every step. A complex chunk is judged by its real and imaginary parts."""
    assert not bool(non_finite(torch.empty(0, dtype=dtype)))
    values = torch.ones(5, dtype=dtype)
    assert not bool(non_finite(values))
    for bad in (math.nan, math.inf):
        spoiled = values.clone()
        spoiled[3] = complex(1.0, bad) if dtype.is_complex else bad
        assert bool(non_finite(spoiled)), (dtype, bad)


@pytest.mark.parametrize(
    ("make", "kept"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {"momentum_buffer"}),
        (lambda ps: torch.optim.Adam(ps, lr=0.1), {"exp_avg", "exp_avg_sq"}),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1), {"sum"}),
    ],
    ids=["sgd", "adam", "adagrad"],
)
def test_consensus_over_optimizer_state_reads_what_any_optimizer_keeps(make, kept):
    """`optimizer_state`: each parameter's per-element state, whichever optimizer keeps it (an
    SGD run stopped at its first consensus step with a KeyError for Adam's moments), and not
    its counters (Adam's step: on the host where the parameters are on a GPU)."""
    model = nn.Linear(3, 2)
    optimizer = make(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    check = detector("weight_consensus", model=model, world=3, optimizer_state=True)
    check.on_optimizer_state(0, optimizer)
    names = [name for name, _ in check._tensors(model)]
    expected = {f"{p}.{k}" for p in ("weight", "bias") for k in kept}
    assert names[:2] == ["weight", "bias"] and set(names[2:]) == expected, names
