"""The training recipe real LLM jobs use: Lightning's precision names, clipping by global norm, a
warmup + cosine schedule, AdamW's betas and weight decay, and `workload=llama` trained with all
of them. Each piece is shown changing a verdict on `gpt` (1.7 MB of float32 gradients)."""

from __future__ import annotations

import math

import pytest

from harness.runtime.workloads import Workload
from tests.conftest import compose_run, rows

# gpt with its 1.7 MB of float32 gradients but a quarter of the tokens per step.
GPT = ["workload=gpt", "workload.micro_batch_size=8", "workload.context=32", "workload.steps=12",
       "campaign.noise_seeds=3", "campaign.seeds=1"]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "dtype", "precision", "autocast"),
    [
        ([], "float32", "32-true", None),
        (["workload.dtype=bfloat16"], "bfloat16", "bf16-true", None),
        (["workload.precision=16-true"], "float16", "16-true", None),
        (["workload.precision=bf16-mixed"], "float32", "bf16-mixed", "bfloat16"),
        (["workload=llama"], "float32", "bf16-mixed", "bfloat16"),
    ],
)
def test_precision_names_the_weights_dtype_and_autocast(overrides, dtype, precision, autocast):
    workload = compose_run(*overrides).workload
    assert (workload.dtype, workload.precision, workload.autocast) == (dtype, precision, autocast)


def test_warmup_then_cosine_down_to_the_floor():
    schedule = ["workload.lr_schedule=warmup_cosine", "workload.warmup_steps=4"]
    workload = compose_run("workload.steps=12", *schedule, "workload.min_lr_ratio=0.1").workload
    factors = [workload.lr_factor(s) for s in range(12)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a > b for a, b in zip(factors[3:], factors[4:], strict=False))
    assert math.isclose(factors[-1], 0.1)
    assert compose_run().workload.lr_factor(7) == 1.0


def test_the_llama_workload_trains_with_the_llm_recipe():
    workload = compose_run("workload=llama").workload
    assert workload.clip_grad_norm == 1.0 and workload.lr_schedule == "warmup_cosine"
    assert workload.betas == (0.9, 0.95) and workload.weight_decay == 0.1


# What each recipe piece changes in a verdict: one fault, the toy recipe against the piece.
# Clipping: a permanent x10^4 on one gradient element (per reduction chunk: the elements that
# were the largest at its first strike, struck again at every step, a broken unit) is benign
# under plain AdamW (Adam divides each element by its own second moment) and harmful under
# clipping by global norm (the huge element sets the norm, and every other element's update
# shrinks by the clip factor, every step). At x1000 the element, no longer the largest of each
# step, moved the clipped loss by less than the noise band.
CLIPPED = (
    "{site:grad,model:scale,factor:10000.0,select:largest,ranks:[1],steps:[3],persistence:permanent}",
    ["workload.clip_grad_norm=1.0"], "benign", "harmful",
)  # fmt: skip
# The schedule: a x1000 optimizer-state element late in training is harmful at a constant rate
# and only latent near the cosine's end, where the rate that applies it has decayed.
SCHEDULED = ("{site:optimizer,model:scale,factor:1000.0,select:largest,ranks:[1],steps:[9]}",
             ["workload.lr_schedule=warmup_cosine", "workload.warmup_steps=4"], "harmful",
             "latent")  # fmt: skip


def _effect(tmp_path, run_ok, scenario: str, overrides: list[str]) -> dict[str, str]:
    out = tmp_path / ("recipe" if overrides else "toy")
    run_ok(*GPT, f"campaign.scenarios=[{scenario}]", "detectors=[nan_inf]", *overrides,
           f"out={out}", cwd=tmp_path)  # fmt: skip
    (row,) = rows(out)
    return row


def _both_recipes(tmp_path, run_ok, piece) -> tuple[dict[str, str], dict[str, str]]:
    """The fault's row under the toy recipe and under the piece."""
    scenario, overrides, _, _ = piece
    before, after = (_effect(tmp_path, run_ok, scenario, o) for o in ([], overrides))
    assert before["fired"] == after["fired"] == "True"
    return before, after


def test_clipping_makes_a_permanent_gradient_fault_harmful(tmp_path, run_ok):
    before, after = _both_recipes(tmp_path, run_ok, CLIPPED)
    assert (before["effect"], after["effect"]) == CLIPPED[2:], (before, after)


@pytest.mark.slow
def test_the_schedule_makes_a_late_optimizer_fault_latent(tmp_path, run_ok):
    before, after = _both_recipes(tmp_path, run_ok, SCHEDULED)
    assert (before["effect"], after["effect"]) == SCHEDULED[2:], (before, after)


@pytest.mark.slow
def test_autocast_widens_tolerant_replay_past_a_one_percent_change(tmp_path, run_ok):
    """bf16-mixed: every product rounds to 8 bits, so tolerant replay's tolerance is derived for
    bfloat16 (detectors/replay.py) and a x1.01 on the largest gradient element, caught in
    32-true, passes; exact replay still sees it."""
    scenario = "{site:grad,model:scale,factor:1.01,select:largest,ranks:[1],steps:[3]}"
    caught = {}
    for precision, compare in (("32-true", "tolerant"), ("bf16-mixed", "tolerant"),
                               ("bf16-mixed", "exact")):  # fmt: skip
        out = tmp_path / f"{precision}-{compare}"
        run_ok(*GPT, f"campaign.scenarios=[{scenario}]", "detectors=[replay]",
               "detectors.replay.interval=1", f"detectors.replay.compare={compare}",
               f"workload.precision={precision}", f"out={out}", cwd=tmp_path)  # fmt: skip
        caught[precision, compare] = rows(out)[0]["detected"]
    assert caught == {("32-true", "tolerant"): "True", ("bf16-mixed", "tolerant"): "False",
                      ("bf16-mixed", "exact"): "True"}  # fmt: skip


# AdamW's betas and weight decay: the LLM recipe's (0.9, 0.95) and 0.1 change neither fault's
# effect in a run this short. Adam's bias correction makes its second moment the mean of the
# squares seen so far while the run is much shorter than its horizon 1/(1-beta2) (20 steps at
# 0.95, 1000 at 0.999), whatever beta2 is; decoupled weight decay at lr 3e-3 shrinks a weight by
# 3e-4 a step. The betas' horizon matters in runs of thousands of steps, which no CPU campaign
# reaches (docs/design.md section 9).
ADAMW_LLM = ["workload.betas=[0.9,0.95]", "workload.weight_decay=0.1"]


@pytest.mark.slow
@pytest.mark.parametrize("piece", [CLIPPED, SCHEDULED], ids=["gradient", "optimizer"])
def test_llm_betas_and_weight_decay_change_no_effect_in_a_short_run(tmp_path, run_ok, piece):
    scenario, _, toy_effect, _ = piece
    before, after = _both_recipes(tmp_path, run_ok, (scenario, ADAMW_LLM, None, None))
    assert before["effect"] == after["effect"] == toy_effect, (before, after)
    assert before["loss_delta"] != after["loss_delta"], "the betas and decay did not apply"


def test_betas_and_weight_decay_reach_the_optimizer():
    workload = compose_run("workload=gpt", *ADAMW_LLM).workload
    runtime = Workload(workload, device="meta")
    (group,) = runtime.build_optimizer(runtime.build_model()).param_groups
    assert (group["betas"], group["weight_decay"]) == ((0.9, 0.95), 0.1)


# workload=llama, shortened: its warmup (3 steps) and cosine still fit.
LLAMA = ["workload=llama", "workload.steps=6", "campaign.noise_seeds=2"]
X4 = ("campaign.scenarios=[{site:none},"
      "{site:grad,model:scale,factor:4.0,select:largest,ranks:[1],steps:[3]}]")  # fmt: skip


def test_llama_under_bf16_mixed_exact_replay_catches_x4_on_one_gradient_element(tmp_path, run_ok):
    """The transformers Llama with the LLM recipe (autocast to bfloat16, clipping, warmup +
    cosine, AdamW (0.9, 0.95), weight decay 0.1): a clean trial raises no alert; a x4 on one
    gradient element is caught by exact replay at its step, naming its rank."""
    out = tmp_path / "run"
    run_ok(*LLAMA, "campaign.seeds=1", X4, "detectors=[nan_inf,replay,allreduce_sketch]",
           "detectors.replay.interval=1", "detectors.replay.compare=exact", f"out={out}",
           cwd=tmp_path)  # fmt: skip
    clean, scaled = rows(out)
    assert clean["alerts"] == "0" and clean["golden_match"] == "True", clean
    assert scaled["fired"] == "True" and "replay=3" in scaled["detect_steps"].split(";"), scaled
    assert scaled["suspect_ranks"] == "1" and scaled["attribution_correct"] == "True", scaled
    assert scaled["dtype"] == "float32"


@pytest.mark.slow
def test_twenty_clean_llama_trials_raise_no_alert_from_any_detector(tmp_path, run_ok):
    out = tmp_path / "run"
    run_ok(*LLAMA, "campaign=single", "fault=none", "campaign.seeds=20",
           "detectors=[nan_inf,replay,allreduce_sketch,weight_consensus,grad_stats,spiky_loss,"
           "megatron_hash,titan_replay]", "detectors.replay.interval=1", f"out={out}",
           cwd=tmp_path)  # fmt: skip
    table = rows(out)
    assert len(table) == 20 and all(r["alerts"] == "0" for r in table), table
