"""Verdicts that hold at any model size and any campaign size (docs/design.md, section 5).

Each test would have failed before the mechanism it names was fixed: fast-forward on a model
whose gradients span more than DDP's 1 MiB first bucket (the fixed reduction layout), a harm
threshold that moved with campaign.seeds (the fixed reference seeds), a diverged replica read as
benign (the `latent` effect), and an act-mode trial judged on a run that stopped early (the
observe twin). Verdicts are checked on the small mlp, on `gpt` (1.7 MB of float32 gradients,
two chunks), in bfloat16, and (slow) on a 57 MB model.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.examples import WideMLP
from harness.runtime.comm import fixed_layout
from tests.conftest import rows, without_timing

# A loss-value fault is always masked (backward never reads the loss value); a gradient bit
# flip may be; the largest gradient element scaled is not (a random element of a wide model's
# gradient may be an exact zero). All strike at step 3, where fast-forward starts.
SCENARIOS = (
    "{site:loss,model:scale,factor:10.0,ranks:[1],steps:[3]},"
    "{site:grad,model:bitflip,bit:mantissa,ranks:[2],steps:[3]},"
    "{site:grad,model:scale,factor:1.0e4,select:largest,ranks:[1],steps:[3]}"
)
FAST = ["workload.steps=6", "campaign.seeds=1", "campaign.noise_seeds=2", "detectors=[nan_inf]"]
# gpt with its 1.7 MB of float32 gradients (two chunks) but a quarter of the tokens per step.
GPT = ["workload=gpt", "workload.micro_batch_size=8", "workload.context=32"]


def _both_ways(tmp_path, run_ok, *args: str) -> tuple[list[dict], list[dict]]:
    """The same campaign fast-forwarded and trained from step 0."""
    tables = []
    for ff in ("true", "false"):
        out = tmp_path / f"ff-{ff}"
        run_ok(*FAST, *args, f"campaign.scenarios=[{SCENARIOS}]", f"campaign.fast_forward={ff}",
               f"out={out}", cwd=tmp_path)  # fmt: skip
        tables.append(rows(out))
    return tables[0], tables[1]


def _assert_same_rows(fast: list[dict], full: list[dict]) -> None:
    assert [r["start_step"] for r in fast] == ["3"] * 3
    assert [r["start_step"] for r in full] == ["0"] * 3
    strip = [{k: v for k, v in r.items() if k != "start_step"} for r in without_timing(fast)]
    assert strip == [
        {k: v for k, v in r.items() if k != "start_step"} for r in without_timing(full)
    ]
    assert fast[0]["effect"] == "masked" and fast[0]["golden_match"] == "True"
    assert fast[2]["effect"] != "masked"


def test_fast_forward_is_bit_identical_on_a_model_over_one_mib(tmp_path, run_ok):
    _assert_same_rows(*_both_ways(tmp_path, run_ok, *GPT))


@pytest.mark.slow
def test_fast_forward_is_bit_identical_in_bfloat16(tmp_path, run_ok):
    _assert_same_rows(*_both_ways(tmp_path, run_ok, *GPT, "workload.dtype=bfloat16"))


@pytest.mark.slow
def test_fast_forward_is_bit_identical_on_a_57_mb_model_in_three_chunks(tmp_path, run_ok):
    _assert_same_rows(
        *_both_ways(
            tmp_path, run_ok, "workload=custom", "workload.model._target_=harness.examples.WideMLP"
        )
    )


def test_the_same_trial_gets_the_same_effect_whatever_the_campaign_size(tmp_path, run_ok):
    """A range over more golden runs only widens: the threshold comes from the fixed reference
    seeds, so 2 and 4 seeds agree on the seeds they share."""
    tables = {}
    for seeds in (2, 4):
        out = tmp_path / f"seeds-{seeds}"
        run_ok("workload.steps=6", "detectors=[]", "campaign=single", "fault=grad_scale",
               "fault.steps=[3]", "fault.factor=30.0", f"campaign.seeds={seeds}",
               "campaign.noise_seeds=2", f"out={out}", cwd=tmp_path)  # fmt: skip
        tables[seeds] = without_timing(rows(out))
    assert tables[4][:2] == tables[2]
    assert len({r["noise_band"] for r in tables[4]}) == 1


@pytest.mark.parametrize(
    ("workload", "factor"),
    [
        pytest.param(["workload=mlp"], 1.001, marks=pytest.mark.slow),  # gpt: default-run twin
        (GPT, 1.001),
        # bfloat16 keeps 8 significant bits: x1.001 rounds back to the same weight (the fault
        # would not fire); x1.01 moves every weight it hits by more than half a bfloat16 step.
        pytest.param([*GPT, "workload.dtype=bfloat16"], 1.01, marks=pytest.mark.slow),
    ],
    ids=["mlp", "gpt", "gpt-bfloat16"],
)
def test_a_diverged_replica_is_never_benign(tmp_path, run_ok, workload, factor):
    """A small change to one replica's weights, and no check: the loss stays in the band, but
    the data-parallel invariant is broken for good (gradients are averaged, weights are not)."""
    out = tmp_path / "run"
    run_ok(*workload, "workload.steps=6", "detectors=[]", "campaign=single", "fault.site=weight",
           "fault.model=scale", f"fault.factor={factor}", "fault.ranks=[2]", "fault.steps=[3]",
           "campaign.noise_seeds=2", f"out={out}", cwd=tmp_path)  # fmt: skip
    (row,) = rows(out)
    assert row["fired"] == "True" and row["replicas_agree"] == "False"
    assert row["divergent_ranks"] == "2"
    assert row["effect"] in ("latent", "harmful")
    assert "replicas diverged" in row["damage"]


def test_a_trial_stopped_in_act_mode_takes_the_effect_of_its_observe_run(tmp_path, run_ok):
    """Replay in act mode stops the scaled gradient at its audit step; judged on the stopped
    run it would compare a 5-step model with an 8-step golden run."""
    tables = {}
    for mode in ("act", "observe"):
        out = tmp_path / mode
        run_ok("workload.steps=8", "detectors=[replay]", f"detectors.replay.mode={mode}",
               "campaign=single", "fault=grad_scale", "fault.factor=1000.0", "fault.steps=[5]",
               "campaign.seeds=1", "campaign.noise_seeds=2", f"out={out}",
               cwd=tmp_path)  # fmt: skip
        tables[mode] = rows(out)
    for act, observe in zip(tables["act"], tables["observe"], strict=True):
        assert act["stopped_step"] == "5" and act["first_detector"] == "replay"
        assert act["effect_from"] == "observe twin" and observe["effect_from"] == "run"
        assert act["effect"] == observe["effect"] != "masked"
        assert act["contained"] == "True"


def test_the_reduction_layout_is_a_function_of_the_model_alone():
    """Chunks close at 1 MiB (the first of a dtype) and 25 MiB, in reverse definition order,
    never splitting a parameter: what DDP's rebuilt buckets look like, fixed from step 0."""
    wide = WideMLP()  # 2048-wide: 16 MiB per hidden weight
    assert fixed_layout(wide) == [
        ("head.bias", "head.weight", "hidden.3.bias", "hidden.3.weight"),
        ("hidden.2.bias", "hidden.2.weight", "hidden.1.bias", "hidden.1.weight"),
        ("hidden.0.bias", "hidden.0.weight"),
    ]
    mixed = nn.ModuleDict({"a": nn.Linear(600, 600), "b": nn.Linear(600, 600).to(torch.bfloat16)})
    # float32 "a" (1.4 MB) and bfloat16 "b" (0.7 MB, under 1 MiB) reduce apart.
    assert fixed_layout(mixed) == [("a.bias", "a.weight"), ("b.bias", "b.weight")]
