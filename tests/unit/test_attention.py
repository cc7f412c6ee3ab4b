"""Attention as two products (harness/core/attention.py): bit for bit what the math backend of
F.scaled_dot_product_attention computes, forward and every input's gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from harness.core import attention

CASES = {
    "causal": {"is_causal": True},
    "float mask": {"attn_mask": "float"},
    "bool mask": {"attn_mask": "bool"},
    "no mask, scale": {"scale": 0.3},
    "negative scale": {"scale": -0.2},
    "grouped query": {"enable_gqa": True, "is_causal": True},
}


def _inputs(case: dict, dtype: torch.dtype) -> tuple[list[torch.Tensor], dict]:
    gen = torch.Generator().manual_seed(0)
    heads_kv = 2 if case.get("enable_gqa") else 4
    shapes = [(2, 4, 24, 8), (2, heads_kv, 24, 8), (2, heads_kv, 24, 8)]
    tensors = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]
    kwargs = dict(case)
    if kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = torch.randn(2, 1, 24, 24, generator=gen).to(dtype)
    elif kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = torch.rand(2, 1, 24, 24, generator=gen) > 0.3
    return tensors, kwargs


def _run(fn, tensors: list[torch.Tensor], grad_seed: int = 1):
    out = fn()
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed))
    grads = torch.autograd.grad(out, tensors, grad.to(out.dtype))
    return out, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CASES))
def test_decomposed_is_the_math_backend(name: str, dtype: torch.dtype) -> None:
    tensors, kwargs = _inputs(CASES[name], dtype)
    products = []

    def multiply(left, right, role):
        products.append((role, left.shape, right.shape))
        return torch.matmul(left, right)

    with sdpa_kernel(SDPBackend.MATH):
        assert attention.runs_math(tensors, kwargs)
        expected = _run(lambda: F.scaled_dot_product_attention(*tensors, **kwargs), tensors)
    got = _run(lambda: attention.decomposed(tensors, kwargs, multiply), tensors)
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))
    # The score product (rows of queries against every key), then the value product.
    assert products == [
        ("attention scores", (2, 4, 24, 8), (2, 4, 8, 24)),
        ("attention values", (2, 4, 24, 24), (2, 4, 24, 8)),
    ]


def test_decomposed_under_autocast_and_dropout() -> None:
    """Autocast hands the kernel bfloat16 operands; dropout draws from the same generator."""
    tensors, kwargs = _inputs({"is_causal": True}, torch.float32)
    kwargs["dropout_p"] = 0.25
    results = []
    for fn in (
        lambda: F.scaled_dot_product_attention(*tensors, **kwargs),
        lambda: attention.decomposed(tensors, kwargs, lambda a, b, _role: a @ b),
    ):
        torch.manual_seed(3)
        with sdpa_kernel(SDPBackend.MATH), torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_run(fn, tensors))
    (out, grads), (want, want_grads) = results
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))


def test_runs_math_follows_the_backend_choice() -> None:
    """The CPU picks its flash kernel by default: that call's products are never formed."""
    tensors, kwargs = _inputs({"is_causal": True}, torch.float32)
    assert not attention.runs_math(tensors, kwargs)
    with sdpa_kernel(SDPBackend.MATH):
        assert attention.runs_math(tensors, kwargs)
