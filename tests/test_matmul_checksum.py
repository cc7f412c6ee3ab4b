"""matmul_checksum: a wrong product is caught in the step that computes it, naming the rank and the
module, whenever the change exceeds the bound detectors/product_bounds.py states; clean runs
stay far inside that bound in float32, bfloat16 and under autocast, on the toy models, on one
with over 1 MiB of gradients and on the transformers Llama with the LLM recipe.

One rank in this process (the check is rank-local: it uses no collective), with the real
injector and bus; the bound is recomputed here from the docstring's formula, independently of
the detector's code. The campaign tests at the end run the real DDP world."""

from __future__ import annotations

import contextlib
import gc
import json
import math
from dataclasses import replace

import pytest
import torch

from detectors.matmul_checksum import MatmulChecksum
from detectors.product_bounds import operand_rounding
from harness.campaign.coverage import product_coverage
from harness.config.schema import FaultConfig, RunConfig
from harness.core.bus import PluginBus
from harness.core.events import Alert, ElementInject
from harness.core.matmuls import traced
from harness.core.plugins import DetectorContext, EventLog, Plugin, RankInfo
from harness.runtime import numerics
from harness.runtime.workloads import Workload
from injectors import injector
from tests.conftest import compose_run, events, rows

CLEAN = {
    "mlp": ["workload=mlp"],
    "gpt (1.7 MB of gradients)": ["workload=gpt"],
    "gpt bfloat16": ["workload=gpt", "workload.dtype=bfloat16"],
    "gpt autocast": ["workload=gpt", "workload.precision=bf16-mixed"],
    "llama, LLM recipe": ["workload=llama"],
    "mixtral (grouped experts) bf16-mixed": ["workload=mixtral", "workload.precision=bf16-mixed"],
}


class Rank:
    """One rank's model, optimizer, injector (optional) and matmul_checksum on one bus."""

    def __init__(
        self,
        run: RunConfig,
        fault: FaultConfig | None,
        seed: int,
        config: MatmulChecksum.Config | None = None,
    ):
        self.workload = Workload(replace(run.workload, seed=seed))
        self.cpu_numerics = run.topology.cpu_numerics
        self.model = self.workload.build_model()
        info = RankInfo(0, 1, 1)
        self.log = EventLog(0, 0)
        ctx = DetectorContext(info, self.model, self.workload, run.workload.steps, ((0,),))
        plugins = []
        if fault is not None:
            plugins = injector.build(
                fault, seed, info, self.log, self.model, None, ctx.data, run.forward
            )
        self.check = MatmulChecksum(config or MatmulChecksum.Config(), ctx, self.log)
        self.bus = PluginBus([*plugins, self.check], self.log.verdicts)
        self.step = 0
        self.bus.install_forward_hooks(self.model, lambda: self.step)
        self.optimizer = self.workload.build_optimizer(self.model)
        self.worst = 0.0  # the largest ratio of a checksum error to its bound
        self.checked: list[list[str]] = []  # per step, the products whose checks were deferred

    def train(self, step: int) -> None:
        self.step = step
        self.optimizer.zero_grad(set_to_none=True)
        # 16-bit products as a CPU rank computes them (`topology.cpu_numerics`, emulated unless
        # set): the numerics every campaign's check sees.
        with numerics.installed(self.cpu_numerics, "cpu"):
            with self.workload.forward_rng(step, 0, 0):
                loss = self.workload.loss(self.model, self.workload.batch(step, 0, 0))
            loss.backward()
        self.checked.append([key for _, _, key, _ in self.check.found])
        self.bus.audit(step)
        ratios = [p.detail for p in self.log.verdicts.pending]
        self.worst = max([self.worst, *(float(r.max()) for r in ratios)])
        self.bus.resolve()
        self.workload.prepare_update(self.model, self.optimizer, step)
        self.optimizer.step()
        self.bus.update(step, self.model)

    def alerts(self) -> list[Alert]:
        return [e for e in self.log.events if isinstance(e, Alert)]


@pytest.mark.parametrize("overrides", CLEAN.values(), ids=CLEAN.keys())
def test_clean_runs_stay_far_inside_the_bound(overrides):
    rank = Rank(compose_run(*overrides), None, seed=0)
    for step in range(3):
        rank.train(step)
    assert rank.alerts() == []
    assert 0 < rank.worst < 0.5, rank.worst


@pytest.mark.parametrize(
    "overrides",
    [["workload=gpt", "workload.dtype=bfloat16"], ["workload=llama"], ["workload=mixtral"]],
    ids=["gpt bfloat16", "llama, LLM recipe", "mixtral"],
)
def test_the_check_changes_no_bit_of_training(overrides):
    """With the check on, the watch computes each 16-bit product itself (to keep its float32
    value) and attention as its two products: the weights after 3 steps are bit-identical to
    those of the same steps with no watch at all."""
    run = compose_run(*overrides)
    checked = Rank(run, None, seed=0)
    workload = Workload(run.workload)
    model = workload.build_model()
    optimizer = workload.build_optimizer(model)
    for step in range(3):
        checked.train(step)
        optimizer.zero_grad(set_to_none=True)
        with numerics.installed(run.topology.cpu_numerics, "cpu"):
            with workload.forward_rng(step, 0, 0):
                loss = workload.loss(model, workload.batch(step, 0, 0))
            loss.backward()
        workload.prepare_update(model, optimizer, step)
        optimizer.step()
    assert len(checked.checked[0]) > 0 and checked.alerts() == []
    pairs = zip(checked.model.state_dict().values(), model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_interval_and_fraction_check_a_seeded_share_of_the_products():
    run = compose_run("workload=gpt")
    every = Rank(run, None, 0)
    config = MatmulChecksum.Config(interval=2, fraction=0.5)
    sampled, again = Rank(run, None, 0, config), Rank(run, None, 0, config)
    for step in range(4):
        for rank in (every, sampled, again):
            rank.train(step)
    # 9 Linears and 2 blocks' attention (2 products each): outputs, both operands' gradients.
    full = len(every.checked[0])
    assert full == 3 * (9 + 2 * 2) and all(len(keys) == full for keys in every.checked)
    assert sampled.checked[1] == sampled.checked[3] == []
    for step in (0, 2):
        assert 0.2 * full < len(sampled.checked[step]) < 0.8 * full
        assert set(sampled.checked[step]) < set(every.checked[step])
    assert sampled.checked[0] != sampled.checked[2]  # drawn per step
    assert sampled.checked == again.checked  # and seeded


@pytest.mark.slow
@pytest.mark.parametrize("overrides", CLEAN.values(), ids=CLEAN.keys())
def test_twenty_clean_seeds_never_alarm(overrides):
    run = compose_run(*overrides)
    for seed in range(20):
        rank = Rank(run, None, seed)
        for step in range(8):
            rank.train(step)
        assert rank.alerts() == [], seed
        assert rank.worst < 0.7, (seed, rank.worst)


def roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def row_bound(row, left, right_fro, right_sums, inner, u_out, sigmas=8.0) -> float:
    """The docstring's bound for one row of a product P = L R (float32 accumulation, no operand
    rounding): s [(u_o + sqrt(p) u_a) ||P_i|| + u_a (sqrt(q) + sqrt(p)) ||L_i|| ||R||_F
    + sqrt(q) u_a ||L_i|| ||R e||] + p tiny, where a 32-bit product reads ||L_i|| ||R||_F for
    ||P_i||; `left` is ||L_i|| (or what the docstring reads in its place)."""
    u_acc, p, q = roundoff(torch.float32), row.numel(), inner
    norm = float(row.double().norm()) if u_out > 1e-6 else left * right_fro
    terms = (u_out + math.sqrt(p) * u_acc) * norm
    terms += u_acc * (math.sqrt(q) + math.sqrt(p)) * left * right_fro
    terms += math.sqrt(q) * u_acc * left * right_sums
    return sigmas * terms + p * torch.finfo(torch.float32).tiny


class Products:
    """What each Linear computed in the step: input, (corrupted) output, output gradient."""

    def __init__(self, model: torch.nn.Module):
        self.seen: dict[str, dict[str, torch.Tensor]] = {}
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str):
        def hook(module, inputs, output):
            record = self.seen[name] = {"x": inputs[0].detach(), "out": output.detach()}
            output.register_hook(lambda grad: record.__setitem__("dout", grad))

        return hook


def change_and_bound(rank: Rank, products: Products, event: ElementInject, phase: str):
    """The injected change and the bound of the row it lands in, as the check saw the row."""
    module = rank.model.get_submodule(event.tensor)
    seen = products.seen[event.tensor]
    kernel = seen["out"].dtype
    x = seen["x"].to(kernel).reshape(-1, module.in_features)
    weight = module.weight.detach().to(kernel)
    change = abs(float(event.new) - float(event.old))
    if phase == "forward":
        row = seen["out"].reshape(-1, module.out_features)[event.index // module.out_features]
        left = float(x[event.index // module.out_features].double().norm())
        right_fro = float(weight.double().norm())
        right_sums = float(weight.double().sum(0).norm())
        bound = row_bound(row, left, right_fro, right_sums, module.in_features,
                          roundoff(kernel))  # fmt: skip
    else:
        # A row of dW: one output feature, a column of dR = x^T dout, a row of dR^T = dout^T x.
        row = module.weight.grad[event.index // module.in_features]
        dout = seen["dout"].to(kernel).reshape(-1, module.out_features)
        u_out = max(roundoff(kernel), roundoff(module.weight.grad.dtype))
        # ||dout||_F stands for the norm of dout's column (the docstring's weight gradient).
        bound = row_bound(row, float(dout.double().norm()), float(x.double().norm()),
                          float(x.double().sum(-1).norm()), x.shape[0], u_out)  # fmt: skip
    return change, bound


FAULTS = {
    "x2": ["fault.model=scale", "fault.factor=2"],
    "sign": ["fault.model=bitflip", "fault.bit=sign"],
    "exponent": ["fault.model=bitflip", "fault.bit=exponent"],
    "random": ["fault.model=value", "fault.value=random"],
}


# 3 seeds of each fault in bfloat16 in the default run (float32's products are caught off the
# audit steps below), 6 of each dtype in the slow set (docs/detectors.md's figures).
@pytest.mark.parametrize(
    ("dtype", "seeds"),
    [pytest.param("float32", 3, marks=pytest.mark.slow), ("bfloat16", 3),
     pytest.param("float32", 6, marks=pytest.mark.slow),
     pytest.param("bfloat16", 6, marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_wrong_product_above_the_bound_is_caught_in_its_step_naming_rank_and_module(dtype, seeds):
    """Scale x2, a flipped sign or exponent bit, a random value; forward (a Linear's output)
    and backward (its weight gradient); one element on a Linear of gpt, `seeds` seeds each.
    In float32 a change above the row's bound is caught. In bfloat16, through the emulated
    tensor-core numerics, the check holds the float32 product before its rounding and checks
    the rounding exactly: every change is caught, however small beside the 16-bit bound."""
    caught, above, total, blind = 0, 0, 0, []
    for phase in ("forward", "backward"):
        for name, model in FAULTS.items():
            run = compose_run(
                "campaign=single", "workload=gpt", f"workload.dtype={dtype}", "topology.nodes=1",
                "fault.site=matmul", f"fault.phase={phase}", "fault.tensor=blocks.*.*",
                "fault.ranks=[0]", "fault.steps=[1]", *model,
            )  # fmt: skip
            for seed in range(seeds):
                rank = Rank(run, run.scenarios[0], seed)
                products = Products(rank.model)
                rank.train(0)
                rank.train(1)
                (event,) = [e for e in rank.log.events if isinstance(e, ElementInject)]
                change, bound = change_and_bound(rank, products, event, phase)
                product = "output" if phase == "forward" else "weight gradient"
                named = [
                    a for a in rank.alerts()
                    if a.step == 1 and a.suspect_ranks == [0]
                    and a.evidence["module"] == event.tensor
                    and a.evidence["product"].startswith(product)
                ]  # fmt: skip
                total += 1
                # A non-finite change is above every bound.
                if not change <= (bound if dtype == "float32" else 0.0):
                    above += 1
                    caught += bool(named)
                else:
                    blind.append((name, phase, change / bound))
                assert all(a.step == 1 for a in rank.alerts())
    assert caught >= 0.95 * above, (caught, above, blind)
    if dtype == "bfloat16":
        assert caught == above == total, (caught, above, blind)
    else:  # the bound leaves all but a few tiny elements above it
        assert above >= 0.9 * total, (above, total, blind)


def test_x3_on_a_random_forward_element_of_gpt_in_bfloat16_is_caught_in_every_seed():
    """Below the 16-bit bound in 2 of 3 seeds when the check read only the rounded product; the
    rounding checked exactly, caught in each of 6."""
    run = compose_run(
        "campaign=single", "workload=gpt", "workload.dtype=bfloat16", "topology.nodes=1",
        "fault.site=matmul", "fault.tensor=blocks.*.*", "fault.model=scale", "fault.factor=3",
        "fault.ranks=[0]", "fault.steps=[1]",
    )  # fmt: skip
    for seed in range(6):
        rank = Rank(run, run.scenarios[0], seed)
        rank.train(0)
        rank.train(1)
        (event,) = [e for e in rank.log.events if isinstance(e, ElementInject)]
        assert event.fired and event.old != event.new, seed
        alerts = rank.alerts()
        assert alerts and all(a.step == 1 and a.suspect_ranks == [0] for a in alerts), seed
        assert any(a.evidence == {**a.evidence, "module": event.tensor,
                                  "product": "output rounding"} for a in alerts), seed  # fmt: skip


def test_the_largest_element_of_a_product_fires_in_every_seed_and_is_caught_in_its_step():
    """select=largest at site matmul: x3 on the largest element of a forward product of gpt in
    bfloat16 strikes in each of 6 seeds (it once never armed: no position was drawn for it), the
    element it changed was the largest of its product, and the checksum names the module."""
    run = compose_run(
        "campaign=single", "workload=gpt", "workload.dtype=bfloat16", "topology.nodes=1",
        "fault.site=matmul", "fault.tensor=blocks.*.*", "fault.model=scale", "fault.factor=3",
        "fault.select=largest", "fault.ranks=[0]", "fault.steps=[1]",
    )  # fmt: skip
    for seed in range(6):
        rank = Rank(run, run.scenarios[0], seed)
        products = Products(rank.model)
        rank.train(0)
        rank.train(1)
        (event,) = [e for e in rank.log.events if isinstance(e, ElementInject)]
        assert event.fired and event.step == 1, seed
        output = products.seen[event.tensor]["out"].reshape(-1).float().abs()
        others = torch.cat([output[: event.index], output[event.index + 1 :]])
        assert abs(float(event.old)) >= float(others.max()), seed
        caught = [a for a in rank.alerts() if a.evidence["module"] == event.tensor]
        assert caught and all(a.step == 1 and a.suspect_ranks == [0] for a in caught), seed


# Compiling a whole step's checks takes about a minute per workload in a fresh Inductor cache:
# the compiled cases are in the slow set; the native ones build in a fraction of a second (the
# native kernels read bf16-mixed's native numerics as they read bfloat16: not repeated there).
SLOW = pytest.mark.slow
NATIVE_NUMERICS = ["workload=gpt", "workload.precision=bf16-mixed", "topology.cpu_numerics=native"]


@pytest.mark.parametrize(
    ("kind", "overrides", "phase"),
    [pytest.param(kind, overrides, phase, marks=() if kind == "native" else SLOW)
     for kind in ("native", "compiled")
     for overrides in (["workload=gpt"], ["workload=gpt", "workload.dtype=bfloat16"],
                       ["workload=gpt", "workload.precision=bf16-mixed"], NATIVE_NUMERICS,
                       ["workload=llama"])
     if kind == "compiled" or overrides is not NATIVE_NUMERICS
     for phase in ("forward", "backward")],
    ids=lambda v: v if isinstance(v, str) else " ".join(o.split("=")[1] for o in v),
)  # fmt: skip
def test_fused_kernels_raise_the_alerts_eager_raises(kind, overrides, phase):
    """`kernels: native` (the C kernels) and `compiled` on whole training steps: clean steps stay
    inside the bound, and a wrong product (x8 on one element of a Linear, in its forward or its
    weight gradient) raises the same alerts, step, rank and module, as the eager arithmetic;
    bf16-mixed under emulated numerics through the exact rounding checks too."""
    run = compose_run(
        "campaign=single", "topology.nodes=1", *overrides, "fault.site=matmul",
        f"fault.phase={phase}", "fault.tensor=*", "fault.model=scale", "fault.factor=8",
        "fault.ranks=[0]", "fault.steps=[1]",
    )  # fmt: skip
    seen = {}
    for kernels in ("eager", kind):
        rank = Rank(run, run.scenarios[0], 0, MatmulChecksum.Config(kernels=kernels))
        for step in range(3):
            rank.train(step)
        seen[kernels] = [(a.step, a.suspect_ranks, a.evidence["module"]) for a in rank.alerts()]
        assert rank.check.kernels.compiled == (kernels == "compiled")  # it never fell back
    assert seen["eager"] and {step for step, _, _ in seen["eager"]} == {1}
    assert seen[kind] == seen["eager"]


# A Mixtral's products, each as (target, product, fault, what the checksum names): x8 on the
# experts' first grouped product (forward), a flipped sign in the gradient its backward computes
# for the experts' weights; x8 on attention's score product, the 4th product of self_attn (after
# q, k and v: fault.product picks it), and a flipped sign in the gradient of its value product's
# second operand (the values), the 5th.
EXPERTS, ATTENTION = "model.layers.0.mlp.experts", "model.layers.0.self_attn"
MOE_FAULTS = {
    "experts forward x8": (EXPERTS, 1, ["fault.model=scale", "fault.factor=8"], "output"),
    "experts backward sign": (
        EXPERTS, 1, ["fault.phase=backward", "fault.model=bitflip", "fault.bit=sign"],
        "weight gradient",
    ),
    "attention scores x8": (
        ATTENTION, 4, ["fault.model=scale", "fault.factor=8"], "attention scores output"
    ),
    "attention values backward sign": (
        ATTENTION, 5, ["fault.phase=backward", "fault.model=bitflip", "fault.bit=sign"],
        "attention values weight gradient",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", MOE_FAULTS.values(), ids=MOE_FAULTS.keys())
def test_a_wrong_moe_product_is_caught_in_its_step_naming_it(case):
    """A Mixtral's experts compute with torch._grouped_mm, one matrix per expert over the tokens
    routed to it, and its attention with F.scaled_dot_product_attention: neither was a fault
    target nor checked before. A fault on either is struck where `fault.product` points and
    caught in its step, the product named."""
    target, product, fault, named = case
    run = compose_run(
        "campaign=single", "workload=mixtral", "topology.nodes=1", "fault.site=matmul",
        f"fault.tensor={target}", f"fault.product={product}", "fault.ranks=[0]",
        "fault.steps=[3]", *fault,
    )  # fmt: skip
    assert run.forward.products[ATTENTION] == 6  # q, k, v, scores, values, o
    rank = Rank(run, run.scenarios[0], seed=0)
    for step in range(4):
        rank.train(step)
    (event,) = [e for e in rank.log.events if isinstance(e, ElementInject)]
    assert event.fired and event.step == 3 and event.tensor == target
    alerts = rank.alerts()
    assert alerts and all(a.step == 3 and a.suspect_ranks == [0] for a in alerts)
    named_there = [a for a in alerts if a.evidence["module"] == target]
    assert any(a.evidence["product"] == named for a in named_there), [a.evidence for a in alerts]


class Vectors(torch.nn.Module):
    """torch.matmul with 1-D operands: a vector on the right, on the left, and on both sides."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(16, 8, generator=gen))
        self.v = torch.nn.Parameter(torch.randn(8, generator=gen))
        self.u = torch.nn.Parameter(torch.randn(16, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (x @ self.w) @ self.v  # [4, 6, 8] @ [8] -> [4, 6]
        row = self.u @ self.w  # [16] @ [16, 8] -> [8]
        return scores.square().mean() + self.v @ row  # [8] @ [8] -> a scalar


class Scaled(Plugin):
    """A wrong product: x8 on the first element of the `which`-th product of the forward."""

    def __init__(self, which: int):
        self.which, self.seen = which, 0

    def watches_matmuls(self) -> bool:
        return True

    def on_matmul_output(self, step, call, output):
        self.seen += 1
        if self.seen != self.which:
            return None
        wrong = output.clone()
        wrong.view(-1)[0] *= 8
        return wrong


def _watched(
    model: torch.nn.Module, plugins: tuple[Plugin, ...] = (), step_of=lambda: 0, **config
) -> MatmulChecksum:
    """The check on rank 0 of a world of one, watching `model`'s products after `plugins`."""
    log = EventLog(0, 0)
    ctx = DetectorContext(RankInfo(0, 1, 1), model, None, 1, ((0,),))
    check = MatmulChecksum(MatmulChecksum.Config(**config), ctx, log)
    PluginBus([*plugins, check], log.verdicts).install_forward_hooks(model, step_of)
    return check


@pytest.mark.parametrize("wrong", [None, 2, 3, 4], ids=["clean", "right", "left", "both"])
def test_products_of_1d_operands_are_checked(wrong):
    """Each product with a vector operand is checked forward and for both operands' gradients;
    x8 on one element of its output is caught, naming that product."""
    model = Vectors()
    check = _watched(model, () if wrong is None else (Scaled(wrong),))
    model(torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))).backward()
    found = {key: float(ratio) for _, _, key, ratio in check.found}
    # Each product: its output and both operands' gradients, but the input x's (no gradient).
    assert len(found) == 4 * 3 - 1, found
    broken = {key for key, ratio in found.items() if not ratio <= 1.0}
    if wrong is None:
        assert broken == set() and max(found.values()) < 0.5, found
    else:
        assert f"model#{wrong} output" in broken, found


class Methods(torch.nn.Module):
    """Each product in its tensor-method form: `x.mm(w)`, `x.bmm(w)`, `b.addmm(x, w)` and
    `b.baddbmm(x, w)`, as a model may write them instead of torch's functions."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(16, 8, generator=gen))
        self.batched = torch.nn.Parameter(torch.randn(4, 8, 12, generator=gen))
        self.bias = torch.nn.Parameter(torch.randn(8, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, 16).mm(self.w)  # [24, 16] mm [16, 8]
        grouped = flat.reshape(4, 6, 8).bmm(self.batched)  # [4, 6, 8] bmm [4, 8, 12]
        added = self.bias.addmm(x.reshape(-1, 16), self.w)
        batched = self.bias.expand(4, 6, 8).baddbmm(grouped, self.batched.transpose(1, 2))
        return flat.square().mean() + added.square().mean() + batched.square().mean()


@pytest.mark.parametrize(
    "wrong", [None, 1, 2, 3, 4], ids=["clean", "mm", "bmm", "addmm", "baddbmm"]
)
def test_products_in_tensor_method_form_are_checked(wrong):
    """A product written as a tensor's method is watched as its function is: checked forward and
    for its operands' gradients, a clean step inside the bound, and x8 on one element of its
    output caught, naming that product."""
    model = Methods()
    check = _watched(model, () if wrong is None else (Scaled(wrong),))
    model(torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))).backward()
    found = {key: float(ratio) for _, _, key, ratio in check.found}
    outputs = {f"model#{k} output" for k in range(1, 5)}
    assert outputs <= found.keys(), found
    assert {"model#1 weight gradient", "model#2 input gradient", "model#4 input gradient"} <= (
        found.keys()
    ), found
    broken = {key for key, ratio in found.items() if not ratio <= 1.0}
    if wrong is None:
        assert broken == set() and max(found.values()) < 0.5, found
    else:
        assert f"model#{wrong} output" in broken, found


def _checked(model: torch.nn.Module, kernels: str, *inputs: torch.Tensor) -> dict[str, float]:
    """One clean forward and backward of `model` under the check; its ratios by entry."""
    check = _watched(model, kernels=kernels)
    model(*inputs).backward()
    return {key: float(ratio) for _, _, key, ratio in check.found}


class Broadcasts(torch.nn.Module):
    """torch.matmul with an operand broadcast over the other's batch: a matrix on the left of a
    batch of three, then that batch of three on the right of a [2, 3] batch."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(40, 24, generator=gen))
        self.b = torch.nn.Parameter(torch.randn(3, 24, 56, generator=gen))
        self.c = torch.nn.Parameter(torch.randn(2, 3, 40, 24, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a * x @ self.b).square().mean() + (self.c * x @ self.b).square().mean()


@pytest.mark.parametrize("kernels", ["native", "eager"])
def test_a_broadcast_operands_gradient_is_left_out_and_the_rest_checked_clean(kernels):
    """The gradient of an operand broadcast over the product's batch is summed over that batch,
    not one product: left out. The outputs and the other operands' gradients are checked, and
    a clean step stays inside the bound."""
    found = _checked(Broadcasts(), kernels, torch.tensor(1.0))
    checked = {"model#1 output", "model#1 weight gradient", "model#2 output",
               "model#2 input gradient"}  # fmt: skip
    assert set(found) == checked and max(found.values()) < 0.5, found


class Empties(torch.nn.Module):
    """Products with nothing to check beside one with: a Linear with a bias on no rows (an
    expert no token reached), baddbmm over an empty batch and over matrices of no rows, and
    baddbmm whose inner dimension is empty (its output is the addend alone)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.line = torch.nn.Linear(16, 12)
        self.bias = torch.nn.Parameter(torch.randn(12, generator=gen))
        self.right = torch.nn.Parameter(torch.randn(3, 16, 12, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        no_rows = self.line(x[:0])
        no_batch = torch.baddbmm(self.bias, x.new_zeros(0, 8, 16), self.right[:0])
        no_matrix_rows = torch.baddbmm(self.bias, x.new_zeros(3, 0, 16), self.right)
        no_inner = torch.baddbmm(self.bias, x.new_zeros(3, 8, 0), self.right[:, :0])
        empty = no_rows.sum() + no_batch.sum() + no_matrix_rows.sum()
        return empty + no_inner.square().mean() + self.line(x).square().mean()


@pytest.mark.parametrize("kernels", ["native", "eager"])
def test_empty_products_are_left_out_and_the_step_goes_on(kernels):
    """An output with no element has nothing to check: left out, forward and backward, and the
    step goes on (the C kernel once read an empty addend through a null pointer and took the
    process down). A product of an empty inner dimension is its addend, checked clean."""
    found = _checked(Empties(), kernels, torch.randn(5, 16, generator=torch.Generator()))
    checked = {"model#3 output", "model#3 weight gradient", "line#2 output",
               "line#2 weight gradient"}  # fmt: skip
    assert set(found) == checked and max(found.values()) < 0.5, found


@pytest.mark.parametrize("kernels", ["native", "eager"])
def test_a_product_changed_in_place_keeps_its_backward_checks(kernels):
    """A Linear on data that needs no gradient returns a view of its 2-D product where the data
    has more than two dimensions; an in-place activation on that view (ReLU(inplace=True))
    takes the view's own node out of the graph. The output gradient is taken where the product
    was made: each product's checks are there, as for 2-D data, and clean."""
    found = {}
    for shape in ((3, 5, 16), (15, 16)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 4)
        )
        data = torch.randn(*shape)
        found[shape] = _checked(torch.nn.Sequential(model, _Squares()), kernels, data)
    checked = {f"0.{m}#1 {entry}" for m in (0, 2) for entry in ("output", "weight gradient")}
    checked.add("0.2#1 input gradient")
    for shape, ratios in found.items():
        assert set(ratios) == checked and max(ratios.values()) < 0.5, (shape, ratios)


class _Squares(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.square().sum()


def test_a_backward_that_reaches_one_operand_leaves_nothing_for_the_next():
    """A backward that reaches one operand of a product (`inputs=[weight]`) gathers half of its
    gradients; the next backwards gather their own, never pairing that gradient with their
    output gradient: three backwards of one graph, clean."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    check = _watched(model)
    y = model(torch.randn(4, 16))
    y.square().sum().backward(inputs=[model[2].weight], retain_graph=True)
    (y * 3).sum().backward(retain_graph=True)
    (y**3).sum().backward()
    gradients = [(key, float(r)) for _, phase, key, r in check.found if phase != "forward"]
    assert ("2#1 input gradient" in dict(gradients)) and max(r for _, r in gradients) < 0.5


class Doubles(torch.nn.Module):
    """A float64 Linear with a bias and a float64 convolution (a Lightning "64-true" model),
    beside a float32 Linear."""

    def __init__(self):
        super().__init__()
        self.wide = torch.nn.Linear(16, 8).double()
        self.conv = torch.nn.Conv1d(2, 4, 3).double()
        self.line = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = self.wide(x.double()).square().sum() + self.conv(x.double().view(4, 2, 8)).sum()
        return wide.float() + self.line(x).square().sum()


@pytest.mark.parametrize("kernels", ["native", "eager"])
def test_float64_products_are_left_out_and_the_step_goes_on(kernels):
    """The checks' figures are float32: a float64 product is left out (its Linear with a bias
    once raised in the bias's norm and stopped the step), and the float32 one is checked."""
    found = _checked(Doubles(), kernels, torch.randn(4, 16, generator=torch.Generator()))
    assert set(found) == {"line#1 output", "line#1 weight gradient"}, found
    assert max(found.values()) < 0.5, found


class Tries(torch.nn.Module):
    """A forward that tries a product of shapes that do not fit, catches torch's error and goes
    on through fifty small Linears (freed calls' addresses taken again)."""

    def __init__(self):
        super().__init__()
        self.line = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, tries: bool) -> torch.Tensor:
        if tries:
            with contextlib.suppress(RuntimeError):
                torch.matmul(x, torch.ones(3, 3))
            gc.collect()
        for _ in range(50):
            x = torch.tanh(self.line(x))
        return x.square().sum()


def test_a_product_that_raised_leaves_nothing_a_later_product_is_checked_against():
    """A product that raises between its operands' hook and its output's leaves the check's
    entry for it: cleared with the step, never taken for a later call's (which got the freed
    call's address, checked against the other product's operands: an error or a false
    alarm). Every other step checked, as `interval` 2 does, the rest clean."""
    torch.manual_seed(0)
    model, step = Tries(), [0]
    check = _watched(model, step_of=lambda: step[0], interval=2)
    for step[0] in range(6):
        model(torch.randn(4, 16), step[0] == 0).backward()
        check.on_audit(step[0])
        assert not check.open
    assert len(check._log.verdicts.pending) == 3 * 2  # forward and backward of steps 0, 2 and 4
    assert not any(bool(p.flag) for p in check._log.verdicts.pending)


class Patches(torch.nn.Module):
    """A vision transformer's patch embedding (a strided Conv2d), padded 3x3 and 1-D convolutions,
    and a head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Conv2d(3, 32, kernel_size=4, stride=4)
        self.mix = torch.nn.Conv2d(32, 16, kernel_size=3, padding=1)
        self.line = torch.nn.Conv1d(16, 8, kernel_size=3, padding="same")
        self.head = torch.nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(torch.nn.functional.gelu(self.embed(x)))  # [2, 16, 4, 4]
        return self.head(self.line(h.flatten(2)).mean(-1)).square().mean()


@pytest.mark.parametrize("wrong", [None, 1, 2, 3], ids=["clean", "embed", "mix", "line"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_convolutions_are_checked_forward(wrong, dtype):
    """Each ungrouped convolution's output is checked at every output position against a
    convolution with its summed filters; x8 on one element is caught, naming that module."""
    torch.manual_seed(0)
    model = Patches().to(dtype)
    check = _watched(model, () if wrong is None else (Scaled(wrong),))
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    model(x)
    found = {key: float(ratio) for _, phase, key, ratio in check.found if phase == "forward"}
    # Fault targets at site matmul, one product each.
    plain = Patches()
    assert traced(plain, lambda: plain(x.float())).products["embed"] == 1
    assert {"embed#1 output", "mix#1 output", "line#1 output", "head#1 output"} == set(found)
    broken = {key for key, ratio in found.items() if not ratio <= 1.0}
    if wrong is None:
        assert broken == set() and max(found.values()) < 0.5, found
    else:
        assert broken == {["embed", "mix", "line"][wrong - 1] + "#1 output"}, found


@pytest.fixture
def precisions():
    """torch.backends, its float32 precision settings put back as they were after the test: the
    generic one first, which each backend's inherits where it says "none"."""
    b = torch.backends
    settings = (b, b.cuda.matmul, b.cudnn.conv, b.mkldnn.matmul, b.mkldnn.conv)
    saved = [setting.fp32_precision for setting in settings]
    yield b
    for setting, value in zip(settings, saved, strict=True):
        setting.fp32_precision = value


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to TF32's 10 bits of mantissa (to nearest, ties to even), as float32."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF).view(torch.float32)


class Tf32(Plugin):
    """Each float32 product as a kernel allowed TF32 computes it (cuDNN's convolutions on a GPU
    by default, cuBLAS's matmuls where a job asks): the two operands rounded to TF32, the bias
    not, the rest in float32."""

    def watches_matmuls(self) -> bool:
        return True

    def on_matmul_output(self, step, call, output):
        args = [_tf32(a) if i < 2 else a for i, a in enumerate(call.args)]
        return call.func(*args, **call.kwargs)


class Tensorcores(torch.nn.Module):
    """A Linear and a convolution in float32, each with a bias."""

    def __init__(self):
        super().__init__()
        self.line = torch.nn.Linear(256, 128)
        self.conv = torch.nn.Conv2d(16, 32, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        return self.line(x).sum() + self.conv(image).sum()


@pytest.mark.parametrize("setting", ["ieee", "tf32"])
def test_the_bound_follows_the_float32_precision_torch_allows_each_backend(precisions, setting):
    """A float32 kernel allowed TF32 rounds its operands to 10 bits of mantissa: its clean
    products, computed here as such a kernel computes them, are beyond the float32 bound and
    inside it where torch's setting for that backend allows TF32; x8 on one element of either
    is still caught. The settings are PyTorch 2.9's per backend, as a GPU job sets them: torch's
    legacy `get_float32_matmul_precision` raises once one is used, which stopped the check as
    it was built."""
    precisions.cuda.matmul.fp32_precision = "tf32"
    precisions.mkldnn.matmul.fp32_precision = setting
    precisions.mkldnn.conv.fp32_precision = setting
    torch.manual_seed(0)
    model, gen = Tensorcores(), torch.Generator().manual_seed(1)
    x, image = torch.randn(64, 256, generator=gen), torch.randn(2, 16, 12, 12, generator=gen)
    for wrong in (None, 1, 2):
        check = _watched(model, (Tf32(),) if wrong is None else (Tf32(), Scaled(wrong)))
        with torch.no_grad():
            model(x, image)
        found = {key: float(ratio) for _, _, key, ratio in check.found}
        assert set(found) == {"line#1 output", "conv#1 output"}
        if wrong is not None:
            assert not found[["line#1 output", "conv#1 output"][wrong - 1]] <= 1.0, found
        elif setting == "tf32":
            assert max(found.values()) < 0.5, found
        else:
            assert min(found.values()) > 1.0, found


def test_a_gpus_float32_convolutions_are_bounded_as_tf32_by_default(precisions):
    """cuDNN's float32 convolutions are TF32 unless a job says otherwise, cuBLAS's matmuls are
    not: the operands' rounding the bounds take for each, from torch's settings (no GPU needed
    to read them), and the generic setting that each backend's inherits."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert operand_rounding(cuda, convolution=True) == 2.0**-11
    assert operand_rounding(cuda, convolution=False) == 0.0
    assert operand_rounding(cpu, convolution=True) == operand_rounding(cpu, False) == 0.0
    precisions.fp32_precision = "tf32"
    assert operand_rounding(cuda, False) == operand_rounding(cpu, False) == 2.0**-11
    precisions.cudnn.conv.fp32_precision = "ieee"
    precisions.mkldnn.matmul.fp32_precision = "bf16"
    assert operand_rounding(cuda, True) == 0.0 and operand_rounding(cpu, False) == 2.0**-8


def test_only_modules_that_run_are_targets():
    run = compose_run("workload=gpt")
    workload = Workload(run.workload)
    model = workload.build_model()
    forward = traced(model, lambda: workload.loss(model, workload.batch(0, 0, 0)))
    assert "blocks" not in forward.ran and "blocks.0" in forward.ran
    assert {"blocks.0", "blocks.0.qkv", "head"} <= set(forward.multiplying)
    assert "blocks.0.ln1" in forward.ran and "blocks.0.ln1" not in forward.multiplying
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears <= set(forward.multiplying)


# In bfloat16 an x2 of a typical element is as often below the bound as above it (the blind
# band, docs/detectors.md); x16 is above it.
@pytest.mark.parametrize(("dtype", "factor"), [("float32", 2), ("bfloat16", 16)])
def test_a_campaign_catches_a_wrong_product_off_the_audit_steps(run_ok, tmp_path, dtype, factor):
    """Real DDP, 3 ranks, the fewest replay runs on (bfloat16 through the emulated tensor-core
    numerics): a wrong product of rank 1 at step 3 (replay audits 0 and 5) is caught at step 3
    by matmul_checksum alone, naming rank 1 and a module inside the target."""
    out = tmp_path / "out"
    run_ok(
        "campaign=single", "workload=gpt", "workload.micro_batch_size=4",
        f"workload.dtype={dtype}", "workload.steps=6", "campaign.noise_seeds=2", "topology.nodes=3",
        "fault.site=matmul", "fault.model=scale", f"fault.factor={factor}", "fault.ranks=[1]",
        "fault.steps=[3]", "detectors=[nan_inf,replay,matmul_checksum]", "campaign.seeds=1",
        f"out={out}", cwd=tmp_path,
    )  # fmt: skip
    table = rows(out)
    assert len(table) == 1
    for row in table:
        assert row["fired"] == "True" and row["effect"] != "masked"
        assert (row["first_detector"], row["detect_step"]) == ("matmul_checksum", "3")
        assert row["suspect_ranks"] == "1" and row["contained"] == "True"
    injected = {(e["trial_id"], e["tensor"]) for e in events(out) if e["kind"] == "inject"}
    for e in events(out):
        if e["kind"] == "alert":
            assert e["detector"] == "matmul_checksum" and e["step"] == 3
            target = next(t for trial, t in injected if trial == e["trial_id"])
            assert e["evidence"]["module"].startswith(target)
    # The share of the step's products the check verified, recorded and reported.
    coverage = json.loads((out / "campaign.json").read_text())["product_coverage"]
    assert coverage["checked"] == 1.0 and coverage["flops"] > 0
    assert "Product coverage: matmul_checksum checks 100.0% of" in (out / "report.md").read_text()


@pytest.mark.parametrize("workload", ["gpt", "llama", "gpt2", "mixtral"])
def test_the_check_covers_the_product_flops_of_a_step(workload):
    """Every product FLOP torch's counter sees in a step (attention's and the experts' too) is
    one the check verifies; its interval and fraction scale the share; without it, none."""
    checked = (f"workload={workload}", "detectors=[matmul_checksum]")
    coverage = product_coverage(compose_run(*checked))
    assert coverage.flops > 0 and coverage.checked >= 0.99, coverage
    thinned = compose_run(
        *checked, "detectors.matmul_checksum.interval=2", "detectors.matmul_checksum.fraction=0.5"
    )
    assert product_coverage(thinned).checked == pytest.approx(coverage.checked / 4)
    unchecked = product_coverage(compose_run(f"workload={workload}", "detectors=[nan_inf]"))
    assert unchecked == replace(coverage, checked=0.0)


@pytest.mark.slow
@pytest.mark.parametrize(("target", "product"), [(EXPERTS, 1), (ATTENTION, 4)],
                         ids=["experts", "attention scores"])  # fmt: skip
def test_a_campaign_catches_a_wrong_moe_product_on_its_rank(run_ok, tmp_path, target, product):
    """Default-run twin: the in-process MoE faults above. Real DDP, 3 ranks: x8 on the experts'
    first grouped product, or on attention's score product, of rank 1 at step 3 is caught
    there, naming rank 1."""
    out = tmp_path / "out"
    run_ok(
        "campaign=single", "workload=mixtral", "workload.steps=5", "topology.nodes=3",
        "fault.site=matmul", f"fault.tensor={target}", f"fault.product={product}",
        "fault.model=scale", "fault.factor=8", "fault.ranks=[1]", "fault.steps=[3]",
        "detectors=[nan_inf,matmul_checksum]", "campaign.seeds=1", f"out={out}", cwd=tmp_path,
    )  # fmt: skip
    (row,) = rows(out)
    assert row["fired"] == "True" and row["contained"] == "True"
    assert (row["first_detector"], row["detect_step"], row["suspect_ranks"]) == (
        "matmul_checksum",
        "3",
        "1",
    )


@pytest.mark.parametrize("kernels", ["native", "eager"])
def test_a_weight_an_earlier_update_left_wrong_is_no_fault_of_the_products_using_it(kernels):
    """campaign=smoke's exponent flip on rank 2's fc2.weight[44852] after step 5's update: each
    product of that weight is right as computed, and each passes. The check alarmed at step 6
    on the input gradient, its ratio NaN: a row of dP whose float32 norm was 0 met the weight's
    1e37 terms in a bound of 0 x inf. An alarm of the check at step 6 suspects the updates
    before it, not its own step (recovery restored step 5's checkpoint, the flip in it)."""
    workload = Workload(compose_run("workload=mlp").workload)
    model = workload.build_model()
    with torch.no_grad():
        model.fc2.weight.view(-1)[44852] = 1.143688188917451e37  # bit 30 of 0.0336 flipped
    check = _watched(model, step_of=lambda: 6, kernels=kernels)
    workload.loss(model, workload.batch(6, 2, 0)).backward()
    ratios = {key: float(ratio) for _, _, key, ratio in check.found}
    assert len(ratios) == 8 and max(ratios.values()) <= 1.0, ratios
    assert MatmulChecksum.first_suspect_step(check.config, 6, lambda _: True) <= 4


class TinyRows(torch.nn.Module):
    """Two products whose rows include one of about 1e-23 each way: an input row (the first
    product's left operand) and an output gradient's row (the loss weighs one row by 1e-23, as
    a sharp softmax leaves attention's score gradients). Their squares, below float32's
    smallest normal, sum to 0."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(32, 48, generator=gen))
        self.w2 = torch.nn.Parameter(torch.randn(48, 40, generator=gen))

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return (x @ self.w1 @ self.w2 * weights).sum()


@pytest.mark.parametrize("kernels", ["native", "eager"])
def test_rows_whose_squares_underflow_are_inside_their_bound(kernels):
    """Clean float16 gpt alarmed at its 6th step: an attention score gradient's row of about
    1e-23, its float32 norm 0 and its bound with it, against float32's own rounding of its sum
    (ratios 5e5 to 8e7). Every norm the bound reads is rounded up for the squares that fell
    below float32's smallest normal."""
    gen = torch.Generator().manual_seed(1)
    x, weights = torch.randn(16, 32, generator=gen), torch.rand(16, 40, generator=gen) + 0.5
    x[3] *= 1e-23
    weights[5] *= 1e-23
    found = _checked(TinyRows(), kernels, x, weights)
    assert len(found) == 5 and max(found.values()) < 0.5, found


@pytest.mark.parametrize(
    ("module", "product", "named"),
    [
        ("blocks.0", 2, "blocks.0#2 attention scores output"),  # after its child qkv's product
        ("blocks.1", 3, "blocks.1#3 attention values output"),
        ("blocks.0.qkv", 1, "blocks.0.qkv#1 output"),
    ],
)
def test_an_alert_names_the_product_as_fault_product_counts_it(module, product, named):
    """gpt's attention runs in its block's own forward, after the child `qkv`: a fault at
    `fault.tensor=blocks.0 fault.product=2` (the score product) was named `blocks.0#1`, the
    block's own products counted without its children's."""
    run = compose_run(
        "campaign=single", "workload=gpt", "topology.nodes=1", "fault.site=matmul",
        "fault.model=scale", "fault.factor=8.0", f"fault.tensor={module}",
        f"fault.product={product}", "fault.steps=[1]",
    )  # fmt: skip
    rank = Rank(run, run.scenarios[0], seed=0)
    for step in range(2):
        rank.train(step)
    (alert,) = rank.alerts()
    assert alert.step == 1 and alert.evidence["products"] == [named], alert.evidence
