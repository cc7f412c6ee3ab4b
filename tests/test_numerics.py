"""`topology.cpu_numerics=emulated` (harness/runtime/numerics.py): a 16-bit product is the
float32 product of its 16-bit operands rounded once, forward and both gradients, under autocast
too; the same bits every time; float32 untouched; on by default in a CPU rank, and recorded."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from harness.campaign.fastforward import golden_specs
from harness.config.schema import WorkloadConfig
from harness.errors import ConfigError
from harness.launch.world import World
from harness.runtime import numerics
from harness.runtime.workloads import Workload
from tests.conftest import compose_run, rows

SIXTEEN = [torch.bfloat16, torch.float16]


def operands(dtype: torch.dtype, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in shapes]


def emulated(fn, *tensors: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """fn's output under the mode, then the gradients backward computes for `tensors`."""
    with numerics.installed("emulated", "cpu"):
        out = fn(*tensors)
    out.backward(grad)
    found = [out.detach(), *(t.grad for t in tensors)]
    for t in tensors:
        t.grad = None
    return found


def bits(tensors: list[torch.Tensor]) -> list[bytes]:
    return [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_linear_is_the_float32_product_rounded_forward_and_both_gradients(dtype):
    x, w = operands(dtype, (24, 40), (16, 40))
    (g,) = operands(dtype, (24, 16))
    out, gx, gw = emulated(F.linear, x, w, grad=g)
    wide = [t.detach().float() for t in (x, w, g)]
    assert out.dtype == gx.dtype == gw.dtype == dtype
    assert torch.equal(out, (wide[0] @ wide[1].T).to(dtype))
    assert torch.equal(gx, (wide[2] @ wide[1]).to(dtype))  # the input gradient
    assert torch.equal(gw, (wide[2].T @ wide[0]).to(dtype))  # the weight gradient


def test_matmul_operator_and_bmm_are_emulated_too():
    a, b = operands(torch.bfloat16, (3, 8, 32), (3, 32, 8))
    (g,) = operands(torch.bfloat16, (3, 8, 8))
    wide = [t.detach().float() for t in (a, b, g)]
    for product in (torch.bmm, torch.matmul, lambda p, q: p @ q):
        out, ga, gb = emulated(product, a, b, grad=g)
        assert torch.equal(out, torch.bmm(wide[0], wide[1]).bfloat16())
        assert torch.equal(ga, torch.bmm(wide[2], wide[1].transpose(1, 2)).bfloat16())
        assert torch.equal(gb, torch.bmm(wide[0].transpose(1, 2), wide[2]).bfloat16())


def test_attention_runs_in_float32_and_rounds_its_output():
    q, k, v = operands(torch.bfloat16, (2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8))
    (g,) = operands(torch.bfloat16, (2, 4, 16, 8))
    out, *_ = emulated(
        lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q, k, v, grad=g
    )
    wide = [t.detach().float() for t in (q, k, v)]
    assert torch.equal(out, F.scaled_dot_product_attention(*wide, is_causal=True).bfloat16())


def test_under_autocast_the_mode_gets_autocasts_16_bit_operands():
    # Autocast casts below the torch-function layer: the mode sees float32 weights and must
    # cast them itself; the float32 weight's gradient is the rounded 16-bit product, widened.
    x, w = operands(torch.float32, (24, 40), (16, 40))
    (g,) = operands(torch.bfloat16, (24, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, gx, gw = emulated(F.linear, x, w, grad=g)
    low = [t.detach().bfloat16().float() for t in (x, w, g)]
    assert out.dtype == torch.bfloat16 and gw.dtype == torch.float32
    assert torch.equal(out, (low[0] @ low[1].T).bfloat16())
    assert torch.equal(gw, (low[2].T @ low[0]).bfloat16().float())
    assert torch.equal(gx, (low[2] @ low[1]).bfloat16().float())


def test_the_same_inputs_give_the_same_bits():
    x, w = operands(torch.bfloat16, (64, 96), (80, 96))
    (g,) = operands(torch.bfloat16, (64, 80))
    assert bits(emulated(F.linear, x, w, grad=g)) == bits(emulated(F.linear, x, w, grad=g))


def gpt_step(dtype: str, cpu_numerics: str) -> list[torch.Tensor]:
    # Large enough that the CPU's native bfloat16 products round otherwise than one rounding of
    # the float32 product (at d_model 32 they agree; attention is float32 on both).
    cfg = WorkloadConfig("gpt", 1, dtype, 0, 1, 4, 3e-3, d_model=64, context=32)
    workload = Workload(cfg)
    model = workload.build_model()
    with numerics.installed(cpu_numerics, "cpu"):
        loss = workload.loss(model, workload.batch(0, 0, 0))
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


def test_a_float32_workload_computes_the_same_bits_with_the_mode_on_and_off():
    assert bits(gpt_step("float32", "emulated")) == bits(gpt_step("float32", "native"))
    assert bits(gpt_step("bfloat16", "emulated")) != bits(gpt_step("bfloat16", "native"))


def test_the_unset_key_resolves_per_device_and_emulated_on_cuda_is_refused():
    assert numerics.resolve(None, "cpu") == "emulated"
    assert numerics.resolve(None, "cuda") == "native"
    assert numerics.resolve("native", "cpu") == "native"
    assert numerics.resolve(None, None) is None  # torchrun: each machine resolves it
    with pytest.raises(ConfigError, match=r"topology.cpu_numerics: 'emulated' .* on cuda"):
        numerics.resolve("emulated", "cuda")


def test_a_bfloat16_rank_runs_emulated_by_default(tmp_path):
    small = ["campaign=single", "fault=none", "campaign.seeds=1", "detectors=[]"]
    tiny = ["workload=gpt", "workload.d_model=32", "workload.context=16"]
    base = compose_run(
        *small, "topology.nodes=1", *tiny, "workload.steps=2", "workload.dtype=bfloat16"
    )
    assert base.topology.cpu_numerics is None  # unset: resolved by the device
    native = replace(base, topology=replace(base.topology, cpu_numerics="native"))
    world = World(base.topology, tmp_path, tmp_path / "store")
    try:
        outcomes = [world.run(run, golden_specs(run)[0]) for run in (base, native)]
    finally:
        world.close()
    assert all(o.parts is not None for o in outcomes), [o.crash for o in outcomes]
    # The rank trained under the mode: its weights differ from the native kernels' (which add
    # in another order, and whose attention rounds inside).
    emulated, native = (o.parts[0].weights_digest for o in outcomes)
    assert emulated != native


def test_a_bfloat16_campaign_records_its_numerics_in_campaign_json_and_the_report(run_ok, tmp_path):
    out = tmp_path / "out"
    run_ok(
        "campaign=single", "fault=none", "campaign.seeds=1", "detectors=[]", "topology.nodes=1",
        "workload=mlp", "workload.dtype=bfloat16", "workload.steps=2", f"out={out}",
        cwd=tmp_path,
    )  # fmt: skip
    assert [r["effect"] for r in rows(out)] == ["none"]
    held = json.loads((out / "campaign.json").read_text())
    assert held["environment"]["cpu_numerics"] == "emulated"
    header = (out / "report.md").read_text().split("## Definitions")[0]
    assert "Numerics: 16-bit matrix products emulated (topology.cpu_numerics=emulated)" in header
