"""`product_coverage` in campaign.json: how much of the arithmetic of a training step
`matmul_checksum` verifies, so that a compute-fault row's catch rate reads against the share of
the products a fault could strike unseen.

    flops    the product FLOPs of one training step of one rank (every micro-batch, forward and
             backward), as torch's FLOP counter (torch.utils.flop_counter) counts the products
             the kernels compute: mm, bmm, addmm, baddbmm, convolutions, the math backend's
             attention products, and what it does not know, counted here: grouped products
             (2 x rows x inner x columns) and the CPU's flash attention (as the counter counts
             the GPU's)
    checked  the share of `flops` that matmul_checksum verifies at its settings (its products,
             `checked_flops`, times `fraction`, over `interval`); 0 without the check

Measured on the CPU in the process that validated the config, on micro-batch 0 of step 0 under
the ranks' numerics (attention on the math backend, harness/runtime/numerics.py): the products a
step computes depend on shapes, not on values or the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from detectors.product_bounds import checked_flops
from harness.config.schema import RunConfig
from harness.config.workload import probe
from harness.core.matmuls import MatmulCall, Watch, watching
from harness.runtime import numerics
from harness.runtime.workloads import Workload


@dataclass(frozen=True)
class ProductCoverage:
    flops: int  # one step of one rank
    checked: float  # the share matmul_checksum verifies, in [0, 1]

    def record(self) -> dict[str, Any]:
        return {"flops": self.flops, "checked": round(self.checked, 4)}


def _grouped_flops(left_shape, right_shape, *_args, out_shape=None, **_kwargs) -> int:
    """torch._grouped_mm: each row of the left operand meets one group's matrix (or, for a
    weight gradient, each group's rows one slice of the right): 2 x left's size x columns."""
    size = 1
    for n in left_shape:
        size *= n
    return 2 * size * right_shape[-1]


def _flash_flops(query, key, value, *_args, out_shape=None, **_kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _flash_backward_flops(grad, query, key, value, *_args, out_shape=None, **_kwargs) -> int:
    return sdpa_backward_flop_count(grad, query, key, value)


UNCOUNTED = {
    torch.ops.aten._grouped_mm: _grouped_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _flash_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_backward_flops,
}


def product_coverage(run: RunConfig) -> ProductCoverage:
    """One micro-batch's forward and backward under the FLOP counter and the products' watch."""
    workload = Workload(run.workload)
    model = probe(run.workload).model
    batch = workload.batch(0, 0, 0)
    check = run.detectors.get("matmul_checksum")
    checked = 0

    def count(call: MatmulCall) -> torch.Tensor:
        nonlocal checked
        output = call.func(*call.args, **call.kwargs)
        if check is not None:
            checked += checked_flops(call, output, check.backward)
        return output

    counter = FlopCounterMode(display=False, custom_mapping=UNCOUNTED)
    with (
        watching(model, Watch(count)),
        numerics.installed(run.topology.cpu_numerics, "cpu"),
        counter,
        workload.forward_rng(0, 0, 0),
    ):
        workload.loss(model, batch).backward()
    total = counter.get_total_flops()
    share = 0.0
    if check is not None and total:
        share = checked / total * check.fraction / check.interval
    return ProductCoverage(total * run.workload.micro_batches, share)
