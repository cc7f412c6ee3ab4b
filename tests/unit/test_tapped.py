"""harness/core/matmuls.tapped: a product's operands' gradients handed over together, once
backward has made them all."""

from __future__ import annotations

import torch

from harness.core.matmuls import tapped


def test_tapped_hands_each_backward_s_gradients_over_together() -> None:
    """Both operands' gradients of `a @ b` in one call per backward, equal to autograd's own
    (the leaves' .grad), also on a second backward of a kept graph; None for an operand whose
    product gives it no gradient."""
    a, b = torch.randn(5, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    handed: list[tuple[torch.Tensor | None, ...]] = []

    def seen(grads: tuple[torch.Tensor | None, ...]) -> None:
        # As they arrive: a leaf's .grad may be the same tensor, added to in place later.
        handed.append(tuple(None if g is None else g.clone() for g in grads))

    left, right = tapped([a, b], seen)
    loss = (left @ right).square().sum()
    loss.backward(retain_graph=True)
    first = (a.grad.clone(), b.grad.clone())
    loss.backward()
    assert len(handed) == 2
    for grads in handed:
        assert all(torch.equal(g, want) for g, want in zip(grads, first, strict=True))

    class LeftOnly(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x * 2 + y.sum() * 0

        @staticmethod
        def backward(ctx, grad):
            return grad * 2, None

    handed.clear()
    x, y = tapped([torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)], seen)
    LeftOnly.apply(x, y).sum().backward()
    assert len(handed) == 1 and handed[0][1] is None
    assert torch.equal(handed[0][0], torch.full((3,), 2.0))
