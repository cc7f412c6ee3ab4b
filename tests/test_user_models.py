"""Models as users have them: a plain Hugging Face GPT-2 (ModelOutput, dropout 0.1) trains in
campaigns with every check; replay recomputes a peer's micro-batch under the peer's random state;
a forward that does not reproduce is told apart from a faulty rank; a model that fails is
refused before any rank starts."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.modeling_outputs import CausalLMOutput

from harness import losses
from harness.config.schema import WorkloadConfig
from harness.runtime.workloads import Workload
from tests.conftest import rows
from tests.test_config_errors import refused_in_process

# GPT-2 as experiments/workload/gpt2.yaml has it, narrower and on shorter sequences.
GPT2 = ["workload=gpt2", "workload.steps=5", "campaign.noise_seeds=2",
        "workload.micro_batch_size=4", "workload.data.context=16",
        "workload.model.config.n_embd=64"]  # fmt: skip
# Consensus every 5 steps: it looks once in the 5-step run (at its default 10 it never would).
EVERY_CHECK = (
    "detectors=[nan_inf,replay,allreduce_sketch,weight_consensus,grad_stats]",
    "detectors.weight_consensus.interval=5",
)
EXACT_EVERY_STEP = ["detectors.replay.interval=1", "detectors.replay.compare=exact"]
CLEAN_AND_X4 = (
    "campaign.scenarios=[{site:none},"
    "{site:grad,model:scale,factor:4.0,select:largest,ranks:[1],steps:[3]}]"
)


def _gpt2(dropout: float) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        bos_token_id=0, eos_token_id=0, use_cache=False)  # fmt: skip
    return GPT2LMHeadModel(config)


def test_the_builtin_loss_takes_the_logits_from_any_output():
    scores, targets = torch.randn(2, 5, 7), torch.randint(7, (2, 5))
    expected = torch.nn.functional.cross_entropy(scores.reshape(-1, 7), targets.reshape(-1))
    for output in (scores, (scores, None), [scores], {"logits": scores},
                   CausalLMOutput(logits=scores)):  # fmt: skip
        assert torch.equal(losses.cross_entropy(output, targets), expected)
    assert losses.cross_entropy(scores.bfloat16(), targets).dtype == torch.float32
    with pytest.raises(TypeError, match="cannot find logits"):
        losses.logits({"hidden": scores})


def test_a_micro_batch_draws_the_same_dropout_masks_wherever_it_is_computed():
    """Dropout is live (two micro-batches' keys give different outputs), yet the same key gives
    the same bits, and the caller's generator does not move."""
    model = _gpt2(dropout=0.1)
    workload = Workload(WorkloadConfig("gpt", 4, "float32", 0, 1, 4, 1e-3))
    tokens = torch.randint(128, (2, 16))

    def logits(step: int, rank: int) -> torch.Tensor:
        with workload.forward_rng(step, rank, 0):
            return model(tokens).logits

    before = torch.get_rng_state()
    assert torch.equal(logits(3, 1), logits(3, 1))
    assert not torch.equal(logits(3, 1), logits(3, 2))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_plain_gpt2_with_dropout_trains_with_every_check_and_exact_replay_names_the_rank(
    tmp_path, run_ok
):
    """GPT2LMHeadModel with dropout 0.1, no wrapper (experiments/workload/gpt2.yaml): clean
    trials raise no alert from any check, replay at every step included (without the
    micro-batch's own random state, a peer's replay masks other elements and alarms on every
    clean step); a x4 on one gradient element is caught at its step, naming its rank. Two
    micro-batches per step: accumulation under no_sync, which replay recomputes whole (the slow
    set runs one micro-batch too, and ten clean trials each way)."""
    out = tmp_path / "run"
    run_ok(*GPT2, "workload.micro_batches=2", "campaign.seeds=2", CLEAN_AND_X4,
           *EVERY_CHECK, *EXACT_EVERY_STEP, f"out={out}", cwd=tmp_path)  # fmt: skip
    table = rows(out)
    clean, scaled = table[:2], table[2:]
    assert all(r["alerts"] == "0" and r["warnings"] == "" for r in clean), clean
    assert all(r["golden_match"] == "True" for r in clean)
    for row in scaled:
        assert row["fired"] == "True" and "replay" in row["detected_by"], row
        assert row["detect_steps"].split(";").count("replay=3") == 1, row
        assert row["suspect_ranks"] == "1" and row["attribution_correct"] == "True", row


@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_ten_clean_gpt2_trials_with_dropout_raise_no_alert_and_x4_is_named(
    tmp_path, run_ok, micro_batches
):
    """The default run's test at the acceptance count: ten clean trials, each accumulation."""
    out = tmp_path / "run"
    run_ok(*GPT2, f"workload.micro_batches={micro_batches}", "campaign.seeds=10", CLEAN_AND_X4,
           *EVERY_CHECK, *EXACT_EVERY_STEP, f"out={out}", cwd=tmp_path)  # fmt: skip
    table = rows(out)
    clean, scaled = table[:10], table[10:]
    assert len(clean) == 10 and all(r["alerts"] == "0" for r in clean)
    assert all(r["suspect_ranks"] == "1" and "replay=3" in r["detect_steps"] for r in scaled)


def test_a_forward_that_does_not_reproduce_is_a_warning_not_a_suspect(tmp_path, run_ok):
    """Every computation of a micro-batch differs: replay says so and accuses no rank."""
    out = tmp_path / "run"
    run_ok("workload=custom", "workload.model._target_=tests.fixtures_custom.IrreproducibleNet",
           "workload.steps=3", "campaign.noise_seeds=2", "campaign=single", "fault=none",
           "detectors=[replay]", "detectors.replay.interval=1", f"out={out}",
           cwd=tmp_path)  # fmt: skip
    (row,) = rows(out)
    assert row["alerts"] == "0" and row["warnings"] == "replay: not deterministic", row


def test_a_nan_state_is_corruption_for_replay_not_a_forward_that_does_not_reproduce(
    tmp_path, run_ok
):
    """A NaN weight on one replica spreads to every replica through the next allreduce; from
    then on every computation of a micro-batch is NaN, and NaN equals nothing. Replay alerts on
    that at its next audit, as on any corruption, and warns of no non-determinism."""
    out = tmp_path / "run"
    run_ok("campaign=single", "workload.steps=6", "campaign.noise_seeds=2",
           "fault.site=weight", "fault.model=value", "fault.value=nan", "fault.ranks=[3]",
           "fault.steps=[1]", "detectors=[replay]", "detectors.replay.interval=2", f"out={out}",
           cwd=tmp_path)  # fmt: skip
    (row,) = rows(out)
    assert row["effect"] == "harmful" and "replay=2" in row["detect_steps"].split(";"), row
    assert row["warnings"] == "", row


@pytest.mark.slow
def test_a_nan_state_is_corruption_for_replay_on_gpt_in_bfloat16(tmp_path, run_ok):
    """The twin of the mlp test above on gpt (1.7 MB of float32 gradients) in bfloat16."""
    out = tmp_path / "run"
    run_ok("campaign=single", "workload=gpt", "workload.dtype=bfloat16", "workload.steps=6",
           "campaign.noise_seeds=2", "fault.site=weight", "fault.model=value", "fault.value=nan",
           "fault.ranks=[3]", "fault.steps=[1]", "detectors=[replay]",
           "detectors.replay.interval=2", f"out={out}", cwd=tmp_path)  # fmt: skip
    (row,) = rows(out)
    assert row["effect"] == "harmful" and "replay=2" in row["detect_steps"].split(";"), row
    assert row["warnings"] == "" and row["dtype"] == "bfloat16", row


@pytest.mark.parametrize(
    ("target", "key", "error"),
    [
        ("workload.model._target_=tests.fixtures_custom.RaisingNet", "workload.model",
         "RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
        ("workload.loss._target_=torch.nn.functional.mse_loss", "workload.loss",
         "failed in a dry step"),
    ],
)  # fmt: skip
@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_model_or_loss_that_raises_is_refused_before_any_rank_starts(
    tmp_path, monkeypatch, capsys, target, key, error
):
    line = refused_in_process(monkeypatch, capsys, tmp_path / "out", ["workload=custom", target])
    assert key in line and error in line and "dry step" in line, line
