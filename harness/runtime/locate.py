"""Which node breaks the reduction: sub-group reductions of a step's kept contributions
(docs/design.md, section 9).

A wrong reduction names no node: every rank receives the same wrong sum and every rank's check
alarms on it. When the step's reduction, re-run from the local contributions kept before the
collective (harness/runtime/comm.py, `retry_reduction`), is wrong again, the fault repeats on
hardware that takes part in every reduction. Reducing the kept contributions once more in
sub-groups, one per node that leaves out only that node, finds it: with one faulty node, the group
without it is the only one whose sum comes out right.

Each group's sum is checked against the exact (float64) sum of its members' contributions as
they reached every rank by another route: an all_gather, which copies and adds nothing, so a
broken summation cannot forge it. The check is per element and allows what rounding a sum of
k terms in the reduction's dtype can do, |fl(sum) - sum| <= (k - 1) u sum|g_i| with u the
unit roundoff (doubled for margin), plus one smallest subnormal per term. A change smaller than
that moves no weight by more than the rounding of a sum already does.

The costs are paid only when a reduction fault repeats: one all_gather of the kept chunks
(world size times the gradients), one group per node and its reduction of every chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.core import inflight
from harness.core.events import Locate
from harness.core.plugins import EventLog, RankInfo
from harness.runtime.comm import HookState, reduce_in_group


def faulty_node_ranks(state: HookState, step: int, info: RankInfo, log: EventLog) -> list[int]:
    """The world ranks of the one node whose absence makes the step's reduction right, or []
    when no single node explains it (every rank then stays a suspect). Every rank calls this
    together and gets the same answer."""
    per_node, world = info.ranks_per_node, info.world_size
    nodes = world // per_node
    if nodes < 2 or not state.kept:
        return []
    gathered = [[_gather(part, world) for part in kept.parts()] for kept in state.kept]
    device = state.kept[0].payload.device  # where the backend gathers
    wrong = torch.zeros(nodes, device=device)
    for left_out in range(nodes):
        members = tuple(r for r in range(world) if r // per_node != left_out)
        # Every rank creates every group, member or not (torch.distributed's rule).
        group = dist.new_group(list(members))
        if info.rank not in members:
            continue
        for kept, copies in zip(state.kept, gathered, strict=True):
            parts = reduce_in_group(state, step, kept, group, members)
            terms = [[copies[i][r] for r in members] for i in range(len(parts))]
            if not all(map(_within_rounding, parts, terms)):
                wrong[left_out] = 1
    # What each group's members found reaches everyone by a gather as well.
    found = [torch.zeros(nodes, device=device) for _ in range(world)]
    dist.all_gather(found, wrong)
    inflight.hold(wrong, *found)
    wrong = torch.stack(found).amax(0)
    right = [n for n in range(nodes) if wrong[n] == 0]
    node = right[0] if len(right) == 1 else None
    ranks = [r for r in range(world) if r // per_node == node]
    log.emit(
        Locate(
            step=step,
            wrong_without=[n for n in range(nodes) if wrong[n]],
            suspect_ranks=ranks,
            suspect_nodes=[] if node is None else [node],
        )
    )
    return ranks


def _gather(part: torch.Tensor, world: int) -> list[torch.Tensor]:
    copies = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(copies, part)
    inflight.hold(part, *copies)
    return copies


def _within_rounding(got: torch.Tensor, terms: list[torch.Tensor]) -> bool:
    """`got` is the sum of `terms` up to the rounding of a sum in its dtype (module doc)."""
    stacked = torch.stack([t.double() for t in terms])
    info = torch.finfo(got.dtype)
    k = len(terms)
    tiny = info.smallest_normal * info.eps
    bound = (k - 1) * info.eps * stacked.abs().sum(0) + k * tiny
    return bool(((got.double() - stacked.sum(0)).abs() <= bound).all())
