"""matmul_checksum's figures for a grouped product (`torch._grouped_mm`, a mixture-of-experts
layer's experts): P = L R_g row by row, L [S, q] the tokens sorted by expert, R [E, q, p] one
matrix per expert, `offs` [E] the cumulative count of rows per expert, so that row i belongs to
expert g(i) = the first e with i < offs[e]. Rows from offs[E-1] on belong to no expert (the
kernel leaves them unwritten) and are not checked.

The same identities and bound as a dense product (detectors/matmul_checksum.py), per row against
its own expert's matrix: row i's checksum is L_i . (R_g(i) e), its bound takes ||R_g(i)||_F and
||R_g(i) e||, which each row reads from a table of E figures, so the check stays O(operands).
Backward, dL = dP R_g^T row by row (each row against (R_g^T e)), and dR_e = L_e^T dP_e per
expert, whose row sums are the index-add over the expert's rows of L_i (dP_i e); an expert's
bound is the dense one with that expert's rows, its inner length (its row count) taken at the
largest expert's, which widens it for the smaller ones.

Every function returns the figures `bounded_ratio` takes, shaped so that each row (forward, dL)
or each expert (dR) is a batch of its own.
"""

from __future__ import annotations

import torch

from detectors.norms import row_norms

F32 = torch.float32


def experts(offs: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's expert, and whether it has one (rows past the last offset have none; their
    expert index is clamped to the last, for gathers)."""
    index = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    expert = torch.searchsorted(offs, index, right=True)
    valid = expert < offs.numel()
    return expert.clamp_(max=offs.numel() - 1).long(), valid


def counts(offs: torch.Tensor) -> torch.Tensor:
    """Rows per expert."""
    return torch.diff(offs.long(), prepend=offs.new_zeros(1).long())


def forward(
    left: torch.Tensor, right: torch.Tensor, offs: torch.Tensor, out: torch.Tensor, rows: bool
) -> dict[str, torch.Tensor]:
    """P e against L_i (R_g e), per row: actual, expected (NaN on rows of no expert), ||L_i||,
    ||R_g||_F and ||R_g e|| per row, shaped (S, 1) or (S,); with `rows` (a 16-bit product,
    whose bound reads them), ||P_i||."""
    expert, valid = experts(offs, left.shape[0])
    sums = right.sum(-1, dtype=F32)  # [E, q]
    expected = (left.to(F32) * sums[expert]).sum(-1)
    expected = torch.where(valid, expected, torch.nan)
    figures = {
        "actual": out.sum(-1, dtype=F32).unsqueeze(-1),
        "expected": expected.unsqueeze(-1),
        "left_norm": torch.linalg.vector_norm(left, dim=-1, dtype=F32).unsqueeze(-1),
        "right_fro": torch.linalg.vector_norm(right, dim=(-2, -1), dtype=F32)[expert],
        "right_sums_norm": torch.linalg.vector_norm(sums, dim=-1)[expert],
    }
    if rows:
        figures["row_norm"] = row_norms(out).unsqueeze(-1)
    return figures


def output_grad(
    right: torch.Tensor, offs: torch.Tensor, grad: torch.Tensor
) -> dict[str, torch.Tensor]:
    """From dP when it arrives: dP_i (R_g^T e) (NaN on rows of no expert), dP_i e, ||dP_i||,
    and ||R_g^T e|| per row."""
    expert, valid = experts(offs, grad.shape[0])
    columns = right.sum(-2, dtype=F32)  # [E, p]: R^T e per expert
    wide = grad.to(F32)
    projected = torch.where(valid, (wide * columns[expert]).sum(-1), torch.nan)
    return {
        "projected": projected,
        "row_sums": grad.sum(-1, dtype=F32),
        "grad_norms": torch.linalg.vector_norm(grad, dim=-1, dtype=F32),
        "sums_norm": torch.linalg.vector_norm(columns, dim=-1)[expert],
    }


def left_grad(
    grad: torch.Tensor, dp: dict[str, torch.Tensor], right_fro: torch.Tensor, rows: bool
) -> dict[str, torch.Tensor]:
    """dL = dP R_g^T, per row: dL e against dP_i (R_g^T e); with `rows`, ||dL_i||."""
    figures = {
        "actual": grad.sum(-1, dtype=F32).unsqueeze(-1),
        "expected": dp["projected"].unsqueeze(-1),
        "left_norm": dp["grad_norms"].unsqueeze(-1),
        "right_fro": right_fro,
        "right_sums_norm": dp["sums_norm"],
    }
    if rows:
        figures["row_norm"] = row_norms(grad).unsqueeze(-1)
    return figures


def right_grad(
    left: torch.Tensor,
    offs: torch.Tensor,
    grad: torch.Tensor,
    dp: dict[str, torch.Tensor],
    rows: bool,
) -> tuple[dict[str, torch.Tensor], int]:
    """dR_e = L_e^T dP_e, per expert: dR_e e against the sum over its rows of L_i (dP_i e);
    ||L_e||_F, ||dP_e||_F and ||dP_e e|| per expert (with `rows`, ||dR_e's rows||); and the
    largest expert's row count (the product's inner length)."""
    expert, valid = experts(offs, left.shape[0])
    experts_n = grad.shape[0]
    weight = torch.where(valid, dp["row_sums"], 0.0).unsqueeze(-1)
    expected = left.new_zeros(experts_n, left.shape[-1], dtype=F32)
    expected.index_add_(0, expert, left.to(F32) * weight)

    def per_expert(squares: torch.Tensor) -> torch.Tensor:
        total = squares.new_zeros(experts_n).index_add_(0, expert, torch.where(valid, squares, 0))
        return total.sqrt()

    left_rows = torch.linalg.vector_norm(left, dim=-1, dtype=F32)
    figures = {
        "actual": grad.sum(-1, dtype=F32),
        "expected": expected,
        "left_norm": per_expert(left_rows * left_rows).unsqueeze(-1),
        "right_fro": per_expert(dp["grad_norms"] * dp["grad_norms"]),
        "right_sums_norm": per_expert(dp["row_sums"] * dp["row_sums"]),
    }
    if rows:
        figures["row_norm"] = row_norms(grad)
    return figures, int(counts(offs).max())
