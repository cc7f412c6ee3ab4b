"""Norms as `matmul_checksum`'s bounds read them (detectors/product_bounds.py): a product's own
rows, whatever the kind of product (plain, grouped, convolution).

Entry contract: any floating tensor; a float32 tensor back, finite wherever the rows are.
"""

from __future__ import annotations

import torch

F32_MAX = torch.finfo(torch.float32).max


def row_norms(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Each row's norm along `dim`, summed in float64: a 16-bit fault's square overflows float32
    from 2^64 (1.8e19) on, and an infinite norm would widen its row's bound to infinity and hide
    it; as float32, at most float32's largest."""
    return torch.linalg.vector_norm(t, dim=dim, dtype=torch.float64).clamp_(max=F32_MAX).float()
