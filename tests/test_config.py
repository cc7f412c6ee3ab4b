"""Config composition with Hydra's compose API, and what validation builds from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.campaign.fastforward import golden_specs
from harness.cli import CONFIG_DIR
from harness.config.load import run_config
from harness.errors import ConfigError
from tests.conftest import compose_run

ROOT = Path(__file__).resolve().parents[1]


def test_default_campaign_expands_scenarios_times_seeds():
    run = compose_run()
    assert (run.topology.nodes, run.topology.ranks_per_node, run.topology.backend) == (4, 1, "gloo")
    assert list(run.detectors) == ["nan_inf"]
    sites = {t.fault.site for t in run.trials}
    models = {t.fault.model for t in run.trials if not t.fault.clean}
    assert "none" in sites and {"bitflip", "scale", "value"} <= models
    assert len(run.trials) == len(run.scenarios) * run.seeds
    assert len({t.trial_id for t in run.trials}) == len(run.trials)
    assert [g.seed for g in golden_specs(run)] == list(range(max(run.seeds, run.noise_seeds)))


def test_single_campaign_runs_the_fault_keys_seeds_times():
    run = compose_run("campaign=single", "fault=grad_scale", "campaign.seeds=3", "workload.seed=7")
    assert [t.seed for t in run.trials] == [7, 8, 9]
    assert {t.fault.factor for t in run.trials} == {1000.0}


def test_golden_runs_snapshot_the_step_before_each_fault_first_strikes():
    run = compose_run("campaign=smoke")
    assert {t.fault.first_step for t in run.trials} == {0, 3, 5}
    assert [g.snapshots for g in golden_specs(run)] == [(2, 4), ()]
    off = compose_run("campaign=smoke", "campaign.fast_forward=false")
    assert [g.snapshots for g in golden_specs(off)] == [(), ()]


def test_detectors_can_be_empty():
    assert compose_run("detectors=[]").detectors == {}


def test_allreduce_scope_defaults_to_rank_and_accepts_reduction():
    base = ["campaign=single", "fault=grad_scale", "fault.site=allreduce"]
    assert compose_run(*base).trials[0].fault.scope == "rank"
    assert compose_run(*base, "fault.scope=reduction").trials[0].fault.scope == "reduction"
    with pytest.raises(ConfigError, match="fault.scope"):
        compose_run(*base, "fault.scope=everyone")


def test_hydra_reads_nan_as_a_float_and_the_fault_keeps_its_name():
    run = compose_run("campaign=single", "fault=grad_nan", "fault.value=inf")
    assert run.trials[0].fault.value == "inf" and "value-inf" in run.trials[0].trial_id


def test_every_fault_preset_composes_and_validates():
    presets = sorted(p.stem for p in (Path(CONFIG_DIR) / "fault").glob("*.yaml"))
    assert len(presets) >= 10
    sites = set()
    for name in presets:
        (trial,) = compose_run("campaign=single", f"fault={name}").trials
        sites.add(trial.fault.site)
    assert sites == {"none", "grad", "allreduce", "weight", "optimizer", "activation", "loss"}


def test_ranges_expand():
    run = compose_run(
        "campaign=single", "fault=grad_scale", "fault.steps=[2:5,9]", "fault.ranks=[1:4]"
    )
    assert run.trials[0].fault.steps == (2, 3, 4, 9) and run.trials[0].fault.ranks == (1, 2, 3)


def test_fault_targets_are_checked_on_a_model_that_is_never_allocated():
    """A gpt of 1.6e9 parameters (6.4 GB in float32): its names and sizes come from a `meta`
    model, so checking a fault against it takes no more memory than a tiny one."""
    script = (
        "import resource, sys\n"
        "sys.path.insert(0, '.')\n"
        "from tests.conftest import compose_run\n"
        "run = compose_run('campaign=single', 'workload=gpt', 'workload.d_model=4096',\n"
        "                  'workload.layers=8', 'fault.site=weight', 'fault.model=bitflip',\n"
        "                  'fault.tensor=blocks.7.*')\n"
        "assert run.scenarios[0].tensor == 'blocks.7.*'\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) < 1500  # MiB: torch and Hydra loaded, no model


def test_the_parent_validates_a_command_once(tmp_path, monkeypatch, run_ok):
    """preflight validates before Hydra writes anything; the run Hydra then starts composes the
    same config (its `out` timestamp aside) and takes that validation instead of a second one."""
    calls = []

    def counted(raw):
        calls.append(raw)
        return run_config(raw)

    monkeypatch.setattr(cli, "run_config", counted)
    monkeypatch.setattr(cli._Validated, "runs", [])  # no earlier command's, in this worker
    run_ok("workload=gpt", "launcher=torchrun", f"out={tmp_path / 'plan'}", cwd=tmp_path)
    assert len(calls) == 1


def test_a_bit_index_is_checked_in_the_dtype_its_target_computes_in():
    """Under bf16-mixed the weights are float32, and a module's output is what autocast made:
    a Linear's bfloat16 (bits 0..15), a LayerNorm's float32 (0..31)."""
    fault = ["fault=activation_nan", "fault.model=bitflip", "fault.value=null", "fault.bit=20"]
    mixed = ["campaign=single", "workload=gpt", "workload.precision=bf16-mixed", *fault]
    assert compose_run(*mixed, "fault.tensor=ln_f").scenarios[0].bit == 20
    with pytest.raises(
        ConfigError, match="20 is outside bfloat16, the dtype of the output of 'head'"
    ):
        compose_run(*mixed, "fault.tensor=head")


def test_a_scale_factor_is_checked_in_the_widest_dtype_its_targets_compute_in():
    """x1.001 changes a float32 value and rounds back to every bfloat16 one: under bf16-mixed
    a LayerNorm's float32 output takes it, a Linear's bfloat16 output or products never could
    (it struck 'head' with fired False)."""
    fault = ["fault=activation_nan", "fault.model=scale", "fault.value=null", "fault.factor=1.001"]
    mixed = ["campaign=single", "workload=gpt", "workload.precision=bf16-mixed", *fault]
    assert compose_run(*mixed, "fault.tensor=ln_f").scenarios[0].factor == 1.001
    assert compose_run(*mixed, "fault.tensor=blocks.0.*").scenarios[0].factor == 1.001
    for site in ("activation", "matmul"):
        with pytest.raises(ConfigError, match="1.001 rounds back to every element in bfloat16"):
            compose_run(*mixed, f"fault.site={site}", "fault.tensor=head")
    assert compose_run(*mixed, "fault.tensor=head", "fault.factor=1.01").scenarios[0].factor == 1.01


@pytest.mark.parametrize(
    "preset", sorted(p.stem for p in (Path(CONFIG_DIR) / "fault").glob("*.yaml"))
)
def test_every_fault_preset_composes_in_bfloat16(preset):
    """A preset names what it strikes, not a float32 bit index: grad_bitflip's exponent-MSB
    flip was bit 30, refused under bfloat16 (allowed 0..15)."""
    run = compose_run("campaign=single", f"fault={preset}", "workload.dtype=bfloat16")
    assert run.workload.dtype == "bfloat16" and len(run.scenarios) == 1


# The config keys the contract names (docs/design.md section 4), each with a command that sets
# it as the contract says: sweeps and acceptance checks use these names and values.
CONTRACT_KEYS = {
    "out": ["out=results/runs/x"],
    "workload": ["workload=gpt"],
    "workload.steps": ["workload.steps=12"],
    "workload.dtype": ["workload.dtype=bfloat16"],
    "workload.seed": ["workload.seed=3"],
    "workload.precision": ["workload.precision=bf16-mixed"],
    "workload.clip_grad_norm": ["workload.clip_grad_norm=1.0"],
    "workload.micro_batches": ["workload.micro_batches=2"],
    "topology.nodes": ["topology.nodes=5"],
    "topology.ranks_per_node": ["topology.ranks_per_node=2"],
    "topology.spares": ["topology.spares=1", "recovery.enabled=true"],
    "topology.backend": ["topology.backend=gloo"],
    "topology.device": ["topology.device=cpu"],
    "topology.parallel": ["topology.parallel=hsdp", "topology.shard_size=2"],
    "topology.shard_size": ["topology.parallel=hsdp", "topology.shard_size=2"],
    "fault": ["fault=grad_nan"],
    "fault.site": ["fault.site=weight", "fault.model=scale", "fault.factor=2.0"],
    "fault.model": ["fault.site=grad", "fault.model=swap"],
    "fault.phase": ["fault.site=matmul", "fault.model=scale", "fault.factor=2.0",
                    "fault.phase=backward"],
    "fault.bit": ["fault=grad_bitflip", "fault.bit=3"],
    "fault.factor": ["fault=grad_scale", "fault.factor=10.0"],
    "fault.value": ["fault=grad_nan", "fault.value=-inf"],
    "fault.scope": ["fault=allreduce_rank", "fault.scope=reduction"],
    "fault.ranks": ["fault=grad_nan", "fault.ranks=[0,2]"],
    "fault.steps": ["fault=grad_nan", "fault.steps=[3,5]"],
    "fault.persistence": ["fault=grad_scale", "fault.persistence=permanent"],
    "detectors": ["detectors=[nan_inf,replay,weight_consensus]"],
    "detectors.replay.interval": ["detectors=[replay]", "detectors.replay.interval=2"],
    "detectors.weight_consensus.interval": ["detectors=[weight_consensus]",
                                            "detectors.weight_consensus.interval=5",
                                            "checkpoint.interval=5"],
    "campaign": ["campaign=smoke"],
    "campaign.seeds": ["campaign.seeds=2"],
    "campaign.golden_cache": ["campaign.golden_cache=false"],
    "recovery.enabled": ["recovery.enabled=true"],
}  # fmt: skip


@pytest.mark.parametrize("key", CONTRACT_KEYS)
def test_every_contract_key_is_in_the_design_document_and_accepted(key):
    """docs/design.md is the design the code and README cite: its contract section names every
    key sweeps and acceptance checks rely on (it left out campaign.golden_cache, which the
    brief's contract lists), and each is accepted as the contract means it."""
    design = (ROOT / "docs" / "design.md").read_text()
    contract = design.split("## 4. Contract", 1)[1].split("\n## 5.", 1)[0]
    assert f"`{key}" in contract, key
    compose_run(*cli.implied_campaign(CONTRACT_KEYS[key]))
