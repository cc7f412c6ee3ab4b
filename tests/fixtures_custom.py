"""Targets for the bring-your-own-model tests that must not ship in the package."""

from __future__ import annotations

import torch


def unseeded_digits(seed: int, step: int, rank: int, micro: int, size: int):
    """Ignores its arguments: a data function replay and golden runs cannot use."""
    return torch.randn(size, 1, 28, 28), torch.randint(10, (size,))
