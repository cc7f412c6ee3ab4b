"""defective_unit (injectors/defective_unit.py): one rank's broken matrix-engine lane. From its
step on, each product of the forward is struck with probability `rate`, drawn from the seed, the
step and the product's place; a struck product's outputs in the lane (columns j % lanes == lane)
have the unit's bit flipped, and nothing else changes. matmul_checksum catches a struck product
in its step on gpt (1.7 MB of gradients) in float32 and bfloat16, on the transformers Llama with
the LLM recipe, on a transformers GPT-2 with dropout, autocast and clipping, and on a mixture of
experts. One rank in this process, with the real injector,
bus and check (tests/test_matmul_checksum.py's `Rank`)."""

from __future__ import annotations

import random

import pytest
import torch

from harness.config.schema import FaultConfig
from harness.core.events import LaneInject
from harness.errors import ConfigError
from injectors import bits
from injectors.defective_unit import DefectiveUnit
from tests.conftest import compose_run, events
from tests.test_matmul_checksum import Rank


def _unit(**settings) -> DefectiveUnit:
    fault = FaultConfig(site="matmul", model="defective_unit", persistence="permanent",
                        bit="exponent", settings=DefectiveUnit.Config(**settings))  # fmt: skip
    return DefectiveUnit(fault, random.Random(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_struck_product_has_one_bit_flipped_in_every_output_of_its_lane(dtype):
    output = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = output.clone()
    unit = _unit(lane=2, lanes=4)
    bit, elements = unit.corrupt_lane(output)
    assert elements == 3 * 5 * 3
    assert bit in bits.class_bits(dtype, "exponent")
    int_type = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    changed = (output.view(int_type) ^ before.view(int_type)) != 0
    lane = torch.zeros(12, dtype=torch.bool)
    lane[2::4] = True
    assert torch.equal(changed, lane.expand(3, 5, 12))
    flipped = output.view(int_type)[..., 2::4] ^ before.view(int_type)[..., 2::4]
    assert (flipped == torch.tensor(1 << bit).to(int_type)).all()
    # The broken bit is the unit's: the next product of the same dtype has the same one.
    assert unit.corrupt_lane(torch.ones(2, 8, dtype=dtype))[0] == bit


def test_a_convolutions_lane_is_its_output_channels():
    output = torch.randn(2, 8, 5, 5)
    before = output.clone()
    _unit(lane=1, lanes=4).corrupt_lane(output, dim=1)
    changed = (output != before).any(dim=(0, 2, 3))
    assert changed.tolist() == [c % 4 == 1 for c in range(8)]
    assert (output != before)[:, 1].all() and (output != before)[:, 5].all()


def _run(workload: list[str], rate: float, seed: int, steps: int, first: int) -> Rank:
    run = compose_run(
        "campaign=single", *workload, "topology.nodes=1", "fault.site=matmul",
        "fault.model=defective_unit", "fault.persistence=permanent", f"fault.steps=[{first}]",
        "fault.ranks=[0]", "fault.bit=exponent", f"++fault.rate={rate}", "++fault.lanes=8",
        "++fault.lane=3",
    )  # fmt: skip
    rank = Rank(run, run.scenarios[0], seed)
    for step in range(steps):
        rank.train(step)
    return rank


def _struck(rank: Rank) -> list[LaneInject]:
    return [e for e in rank.log.events if isinstance(e, LaneInject)]


def test_products_are_struck_from_the_first_step_at_the_rate_and_again_in_a_rerun():
    first, steps = 1, 3
    struck = _struck(_run(["workload=gpt"], 0.25, seed=0, steps=steps, first=first))
    # At rate 1 every product of the step is struck: how many one step makes.
    per_step = len(_struck(_run(["workload=gpt"], 1.0, seed=0, steps=first + 1, first=first)))
    assert min(e.step for e in struck) >= first
    # 2 steps of products, each struck with probability 1/4: well inside 3 sigma of the mean.
    n = per_step * (steps - first)
    assert abs(len(struck) - n / 4) <= 3 * (n * 0.25 * 0.75) ** 0.5, (len(struck), n)
    assert all(e.lane == 3 and e.lanes == 8 and e.fired and e.elements > 0 for e in struck)
    assert len({e.bit for e in struck}) == 1  # one broken bit, in every struck product
    places = {(e.step, e.tensor, e.product) for e in struck}
    again = _struck(_run(["workload=gpt"], 0.25, seed=0, steps=steps, first=first))
    assert {(e.step, e.tensor, e.product) for e in again} == places
    other = _struck(_run(["workload=gpt"], 0.25, seed=1, steps=steps, first=first))
    assert {(e.step, e.tensor, e.product) for e in other} != places


WORKLOADS = {
    "gpt (1.7 MB of gradients)": ["workload=gpt"],
    "gpt bfloat16": ["workload=gpt", "workload.dtype=bfloat16"],
    "llama, LLM recipe": ["workload=llama"],
    "mixtral (grouped experts) bf16-mixed": ["workload=mixtral", "workload.precision=bf16-mixed"],
    "gpt2, dropout on, bf16-mixed, clipping": [
        "workload=gpt2",
        "workload.precision=bf16-mixed",
        "workload.clip_grad_norm=1.0",
    ],
}


@pytest.mark.parametrize("workload", WORKLOADS.values(), ids=WORKLOADS.keys())
def test_every_struck_product_is_caught_in_its_step_naming_the_rank(workload):
    rank = _run(workload, 0.2, seed=0, steps=4, first=2)
    struck = _struck(rank)
    assert struck and min(e.step for e in struck) == 2
    alerts = rank.alerts()
    assert {a.step for a in alerts} == {e.step for e in struck}
    assert all(a.suspect_ranks == [0] for a in alerts)
    # The failing products each step's alert lists are the struck ones, by module and place.
    for step in {e.step for e in struck}:
        named = {p.split(" ")[0] for a in alerts if a.step == step
                 for p in a.evidence["products"]}  # fmt: skip
        assert named == {f"{e.tensor}#{e.product}" for e in struck if e.step == step}, step


@pytest.mark.parametrize(
    ("keys", "key", "allowed"),
    [
        ({"persistence": "transient"}, "persistence", "allowed: permanent"),
        ({"site": "grad"}, "site", "allowed: matmul"),
        ({"index": 3}, "index", "picks its own"),
        ({"lane": 8}, "lane", "allowed: 0..7"),
        ({"rate": 0}, "rate", "(0, 1]"),
        ({"phase": "backward"}, "phase", "allowed: forward"),
        ({"bit": 20}, "bit", "a unit's bit is a class"),
        ({"ranks": "[0,1]"}, "ranks", "allowed: one rank"),
        ({"probability": 0.1}, "probability", "leave it unset"),
        ({"follows": "data"}, "follows", "leave it unset"),
    ],
)  # fmt: skip
def test_a_unit_that_could_not_strike_as_asked_is_refused(keys, key, allowed):
    fault = {"site": "matmul", "model": "defective_unit", "persistence": "permanent",
             "ranks": "[1]", "steps": "[3]", "lanes": 8, **keys}  # fmt: skip
    listed = "{" + ",".join(f"{k}:{v}" for k, v in fault.items()) + "}"
    with pytest.raises(ConfigError) as error:
        compose_run(f"campaign.scenarios=[{listed}]")
    assert error.value.key == f"campaign.scenarios[0].{key}" and allowed in str(error.value)


def test_the_label_names_the_units_settings():
    run = compose_run(
        "campaign.scenarios=[{site:matmul,model:defective_unit,persistence:permanent,"
        "ranks:[1],steps:[3],rate:0.1,lane:2}]"
    )
    trial = next(t for t in run.trials if not t.fault.clean)
    assert trial.trial_id == f"000-matmul-defective_unit-permanent-lane2-rate0.1-s{trial.seed}"
    assert trial.fault.settings == DefectiveUnit.Config(lane=2, rate=0.1)


@pytest.mark.parametrize(
    ("workload", "head"),
    [
        # gpt's 1.7 MB of gradients, its products bfloat16 under autocast
        (("workload=gpt", "workload.precision=bf16-mixed"), "head"),
        # the transformers Llama with the LLM recipe (clipping, warmup and cosine: a warmup of 2
        # of the 3 steps); in the slow set (8 s): the default run keeps gpt's, and the Llama's
        # products in the checks' tests
        pytest.param(
            ("workload=llama", "workload.warmup_steps=2"), "lm_head", marks=pytest.mark.slow
        ),
    ],
    ids=["gpt-bf16", "llama"],
)
def test_a_unit_strikes_the_training_forwards_and_not_the_final_evaluation(
    tmp_path, run_ok, workload, head
):
    """A unit broken from the last step on strikes that step's forward on its rank, once per
    product: its output head once. The final evaluation, which measures the weights the trial
    left, ran with the unit still due and was struck too (the head twice), its loss judging the
    trial."""
    out = tmp_path / "run"
    run_ok(*workload, "campaign=single", "workload.steps=3", "detectors=[]", "fault.site=matmul",
           "fault.model=defective_unit", "fault.persistence=permanent", "fault.steps=[2]",
           "fault.ranks=[1]", "fault.bit=exponent", "++fault.rate=1.0", "++fault.lanes=8",
           f"out={out}", cwd=tmp_path)  # fmt: skip
    struck = [e for e in events(out) if e["kind"] == "inject"]
    assert struck and {(e["step"], e["rank"]) for e in struck} == {(2, 1)}
    assert [e["tensor"] for e in struck].count(head) == 1, [e["tensor"] for e in struck]
