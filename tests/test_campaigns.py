"""The standard campaigns (experiments/campaign/): each composes and validates as `sdc-bench
campaign=NAME` would run it, holds the structure its study needs, and smoke runs end to end."""

from __future__ import annotations

import csv
import itertools
import re
import shlex
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

import injectors
from harness.analysis.sweep import planned_jobs
from harness.analysis.tables import blind_spot
from harness.cli import CONFIG_DIR, implied_campaign
from harness.config.schema import RunConfig
from harness.runtime import checkpoint
from tests.conftest import compose_run, events, rows, run_here, without_timing

CAMPAIGNS = sorted(p.stem for p in Path(CONFIG_DIR, "campaign").glob("*.yaml"))
# The peers' methods run in `peers` (and megatron_hash in `blind_spots`); the other
# standard campaigns, all replicated, run every detector of ours that applies to DDP.
PEERS = {"megatron_hash", "titan_replay", "spiky_loss"}
# Ours that apply to DDP, as the campaign files name them: a check added beside these (a file in
# detectors/, an installed package) joins a standard campaign when that campaign's file names it.
EVERY_DETECTOR = {"nan_inf", "replay", "weight_consensus", "allreduce_sketch", "grad_stats",
                  "matmul_checksum"}  # fmt: skip
REPLICATED = EVERY_DETECTOR | PEERS
PUBLISHED = {"nan_inf", "replay", "weight_consensus"}
INTERVALS = (1, 2, 5, 10, 20, 50)
BASELINE = Path(CONFIG_DIR).parent / "results" / "baseline"


def keys(run: RunConfig) -> set[tuple]:
    """(site, scope, model, persistence) of every fault scenario."""
    return {(f.site, f.scope, f.model, f.persistence) for f in run.scenarios if not f.clean}


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_every_campaign_composes_and_validates(name):
    run = compose_run(f"campaign={name}")
    assert run.campaign == name
    assert run.trials and len(run.trials) == len(run.scenarios) * run.seeds
    # The harm threshold is the workload's, the same in every standard campaign: smoke, CI's
    # own, alone reads fewer reference runs.
    assert run.noise_seeds == 5 or name == "smoke"
    assert len({t.trial_id for t in run.trials}) == len(run.trials)


def commented_commands() -> list[tuple[str, list[str]]]:
    """Each `sdc-bench` command a file under experiments/ shows in its comments (continuations
    joined), as its file and overrides: the words up to the first that is no override."""
    found = []
    for path in sorted(Path(CONFIG_DIR).rglob("*.yaml")):
        text = re.sub(r"\\\n#", " ", path.read_text())
        for line in re.findall(r"^#\s+sdc-bench(\s.*)?$", text, flags=re.M):
            words = list(itertools.takewhile(lambda w: "=" in w or w == "-m", shlex.split(line)))
            found.append((str(path.relative_to(CONFIG_DIR)), words))
    return found


@pytest.mark.parametrize(
    "where, words", commented_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_every_command_a_config_file_shows_composes_and_validates(where, words):
    # A sweep's every job, as Hydra's sweeper splits it; the launcher's hydra.* keys set no run.
    task = [w for w in implied_campaign(words) if w != "-m" and not w.startswith("hydra")]
    jobs = planned_jobs(task) if "-m" in words else [task]
    assert jobs, (where, words)
    for job in jobs:
        assert compose_run(*job).trials, (where, job)


def test_smoke_is_small_and_exercises_every_detector():
    run = compose_run("campaign=smoke")
    assert set(run.detectors) == EVERY_DETECTOR
    assert len(run.trials) + max(run.seeds, run.noise_seeds) <= 8
    assert run.workload.steps <= 12
    assert any(f.clean for f in run.scenarios)


@pytest.mark.parametrize("name, nodes", [("aws_reference", 4), ("aws_reference_3node", 3)])
def test_aws_reference_is_the_published_setup(name, nodes):
    run = compose_run(f"campaign={name}")
    assert run.topology.nodes == nodes and run.topology.ranks_per_node == 1
    assert set(run.detectors) == PUBLISHED
    # The published intervals: consensus at the checkpoint interval, replay twice within it.
    assert run.detectors["replay"].interval == 5
    assert run.detectors["weight_consensus"].interval == run.checkpoint.interval == 10
    faults = [f for f in run.scenarios if not f.clean]
    assert {f.site for f in faults} == {"grad", "weight", "allreduce"}
    assert {f.value for f in faults if f.model == "value"} == {"nan", "inf"}
    assert all(f.factor is not None and f.factor > 1 for f in faults if f.model == "scale")
    assert {f.scope for f in faults if f.site == "allreduce"} == {"rank", "reduction"}
    # On an audit step of replay and between its audits.
    assert {f.steps for f in faults} == {(10,), (12,)}
    assert keys(run) == keys(compose_run("campaign=aws_reference"))


@pytest.mark.parametrize(
    "name, world, groups", [("fsdp_reference", 4, 1), ("hsdp_reference", 8, 4)]
)
def test_the_sharded_references_are_the_published_faults_and_the_gather_site(name, world, groups):
    """The published mix, scenario for scenario, plus the gather site's, on gpt sharded; every
    check derived for the sharded step, consensus where replica groups give it a majority."""
    run = compose_run(f"campaign={name}")
    topology = run.topology
    assert (topology.parallel, topology.world_size) == (name.split("_")[0], world)
    assert topology.world_size // (topology.shard_size or world) == groups
    assert run.workload.name == "gpt" and run.seeds == 3
    derived = {"nan_inf", "allreduce_sketch", "gather_consensus"}
    assert set(run.detectors) == (derived | {"weight_consensus"} if groups >= 3 else derived)
    published = keys(compose_run("campaign=aws_reference"))
    gathered = {("gather", None, m, "transient") for m in ("scale", "value")}
    assert keys(run) == published | gathered
    steps = {f.steps for f in run.scenarios if f.site == "gather"}
    assert steps == {(10,), (12,)}


def test_command_line_detectors_win_over_a_campaigns_choice():
    run = compose_run("campaign=aws_reference", "detectors=[nan_inf]")
    assert set(run.detectors) == {"nan_inf"}


def test_blind_spots_cover_site_model_persistence_and_scope_against_every_detector():
    run = compose_run("campaign=blind_spots")
    assert set(run.detectors) == EVERY_DETECTOR | {"megatron_hash"}
    # Each cell holds one scenario's seeds: a cell none of them caught must be able to be a
    # blind spot (at 3 seeds, 0/3's upper bound is 56%, and the table could never say yes).
    assert blind_spot((0, run.seeds))
    # The models it names (a model joins once the file names it), each at every place and
    # persistence: element and grouped models everywhere, contribution models only in a
    # reduction (and a one-element loss has nothing to swap or burst); `crash`, which takes a
    # process down instead of a value, is not among them.
    named = {f.model for f in run.scenarios if not f.clean}
    contribution = {m for m in named if injectors.model_class(m).contribution}
    models = named - contribution
    grouped = {m for m in models if injectors.model_class(m).grouped}
    assert named >= {"bitflip", "scale", "value", "stuck", "swap", "burst", *contribution}
    assert {"drop", "duplicate", "stale"} <= contribution and "crash" not in named
    assert grouped and models - grouped
    persistence = ("transient", "intermittent", "permanent")
    places = [(s, None) for s in injectors.SITES if s != "allreduce"]
    places += [("allreduce", "rank"), ("allreduce", "reduction")]
    expected = {
        (site, scope, model, p)
        for (site, scope), model, p in itertools.product(places, models, persistence)
        if (site, model) not in {("loss", "swap"), ("loss", "burst")}
    }
    expected |= set(itertools.product(["allreduce"], ["reduction"], contribution, persistence))
    assert keys(run) == expected


def test_peers_runs_ours_and_theirs_on_the_published_faults_and_the_new_models():
    run = compose_run("campaign=peers")
    assert set(run.detectors) == REPLICATED
    assert {f.model for f in run.scenarios} >= {"swap", "burst", "drop", "duplicate", "stale"}
    assert {f.site for f in run.scenarios} >= {"grad", "weight", "allreduce", "matmul"}
    assert keys(run) >= keys(compose_run("campaign=aws_reference"))


@pytest.mark.parametrize("dtype, width", [("float32", 32), ("bfloat16", 16)])
def test_bit_sensitivity_flips_every_bit_of_the_dtype_at_each_site(dtype, width):
    """Every bit of what each site holds: the workload's dtype, but the loss, which is float32
    from 16-bit scores (its bits 16-31 were left out under bfloat16)."""
    run = compose_run("campaign=bit_sensitivity", f"workload.dtype={dtype}")
    assert run.workload.dtype == dtype
    flips = {(f.site, f.bit) for f in run.scenarios if f.model == "bitflip"}
    widths = {site: 32 if site == "loss" else width for site in injectors.SITES}
    assert flips == {(site, bit) for site, width in widths.items() for bit in range(width)}


def test_bit_sensitivity_under_a_mixed_precision_flips_the_bits_of_the_dtype_struck():
    """Llama's bf16-mixed: the parameters, gradients, moments and the loss are float32, a
    module's outputs and products bfloat16 (a fault drawing among products strikes a 16-bit
    one too). `bit: all` took the workload's float32 for every site, bit 16 and up of a
    bfloat16 output could never strike, and the campaign was refused."""
    run = compose_run("campaign=bit_sensitivity", "workload=llama")
    assert run.workload.precision == "bf16-mixed"
    flips = {(f.site, f.bit) for f in run.scenarios if f.model == "bitflip"}
    widths = {site: 16 if site in ("activation", "matmul") else 32 for site in injectors.SITES}
    assert flips == {(site, bit) for site, width in widths.items() for bit in range(width)}


def test_audit_frequency_runs_every_scenario_at_every_interval():
    run = compose_run("campaign=audit_frequency")
    per_interval = Counter(
        (t.checks["replay"].interval, t.checks["weight_consensus"].interval) for t in run.trials
    )
    assert per_interval == {(k, k): len(run.trials) // len(INTERVALS) for k in INTERVALS}
    # The only checkpoint comes after the last step, so consensus runs at its own interval.
    assert run.checkpoint.interval == run.workload.steps >= max(INTERVALS)


def test_audit_frequency_mixes_persistence_over_consecutive_steps():
    run = compose_run("campaign=audit_frequency")
    assert set(run.detectors) == PUBLISHED | {"allreduce_sketch", "matmul_checksum"}
    assert {p for _, _, _, p in keys(run)} == {"transient", "intermittent", "permanent"}
    for site in ("grad", "weight", "matmul"):
        steps = sorted(
            {f.steps[0] for f in run.scenarios if f.site == site and f.persistence == "transient"}
        )
        assert steps == list(range(steps[0], steps[0] + 10))


def test_nightly_is_a_fixed_mix_against_every_detector():
    run = compose_run("campaign=nightly")
    assert set(run.detectors) == EVERY_DETECTOR
    assert any(f.clean for f in run.scenarios)
    assert {f.site for f in run.scenarios if not f.clean} == set(injectors.SITES)
    # From 4 seeds on, n/n and 0/n have disjoint Wilson intervals: a lost catch shows.
    assert run.seeds >= 4


@pytest.mark.parametrize("name", CAMPAIGNS)
def test_scenarios_that_differ_beyond_their_bit_and_ranks_never_share_a_cell(name):
    """A scenario cell (harness/analysis/tables.py) merges the trials of one site, model, bit
    class and settings, across the bits of a class and the ranks struck: two scenarios that
    differ in anything else (blind_spots' x1000 on a reduction's gradients and on its riders,
    field_mix's defective unit at 1% and 10%) hold some column apart."""
    run = compose_run(f"campaign={name}")
    scenarios: dict[tuple, set] = {}
    for trial in run.trials:
        fault = trial.fault
        if fault.clean:
            continue
        row = (fault.site, fault.model, fault.scope, fault.persistence, fault.factor,
               fault.value, fault.steps, fault.phase, trial.mix and trial.mix.name,
               fault.settings_text())  # fmt: skip
        scenarios.setdefault(row, set()).add(replace(fault, bit=None, ranks=()))
    merged = {row: found for row, found in scenarios.items() if len(found) > 1}
    assert not merged


def test_committed_baseline_is_a_run_of_nightly_as_it_stands():
    """sdc-regress compares cell by cell: the baseline must hold exactly nightly's trials."""
    with open(BASELINE / "trials.csv", newline="") as f:
        table = list(csv.DictReader(f))
    run = compose_run("campaign=nightly")
    assert [r["trial_id"] for r in table] == [t.trial_id for t in run.trials]
    assert {r["campaign"] for r in table} == {"nightly"}
    assert {r["detectors"] for r in table} == {";".join(sorted(run.detectors))}
    # Its cells are nightly's: each trial's settings as the campaign sets them now.
    assert [r["fault_settings"] for r in table] == [t.fault.settings_text() for t in run.trials]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, str]:
    """The smoke campaign as a user runs it (fast-forwarded), its golden snapshots kept; and
    what it printed."""
    cwd = tmp_path_factory.mktemp("smoke")
    out = cwd / "smoke"
    proc = run_here("campaign=smoke", "checkpoint.keep=true", f"out={out}", cwd=cwd)
    return out, proc.stdout


def test_smoke_runs_end_to_end_and_each_check_catches_its_fault(smoke):
    out, printed = smoke
    assert f"report: {out / 'report.md'}" in printed
    table = {r["trial_id"].split("-", 1)[1].rsplit("-s", 1)[0]: r for r in rows(out)}
    assert table["clean"]["alerts"] == "0"
    expected = {
        "grad-value-nan": "nan_inf",
        "grad-scale-x1000": "replay",
        "allreduce-scale-x1000-reduction": "allreduce_sketch",
        "weight-bitflip-exponent_msb": "weight_consensus",
    }
    for label, detector in expected.items():
        assert table[label]["fired"] == "True"
        assert detector in table[label]["detected_by"].split(";"), table[label]


def test_the_sketch_names_the_rank_whose_contribution_was_not_finite(smoke):
    """A NaN in one rank's gradient reaches every rank through the reduction, which summed it
    right: every receiver's projection of the sum was NaN, and each named itself, every rank a
    suspect. The sender's own slot holds its projection, not finite: the sketch names it."""
    out, _ = smoke
    (row,) = [r for r in rows(out) if "-grad-value-nan-" in r["trial_id"]]
    alerts = [
        e for e in events(out)
        if e["kind"] == "alert" and e["trial_id"] == row["trial_id"]
        and e["detector"] == "allreduce_sketch" and e["step"] == int(row["inject_step"])
    ]  # fmt: skip
    assert {a["rank"] for a in alerts} == set(range(int(row["nodes"]))), alerts
    for alert in alerts:
        assert alert["suspect_ranks"] == [int(row["fault_ranks"])], alert
        assert alert["evidence"]["reason"] == "contribution not finite", alert


def test_fast_forwarded_trials_give_the_rows_of_trials_trained_from_step_0(smoke, tmp_path, run_ok):
    """The smoke mix (every detector, grad_stats' running loss maximum included) once from the
    golden snapshots and once from step 0: the same rows, timing and start step aside."""
    forward, full = smoke[0], tmp_path / "full"
    run_ok("campaign=smoke", "campaign.fast_forward=false", f"out={full}", cwd=tmp_path)
    fast, slow = rows(forward), rows(full)
    assert [r["start_step"] for r in fast] == ["0", "5", "5", "5", "5", "3"]
    assert {r["start_step"] for r in slow} == {"0"}

    def same(table):
        return [{k: v for k, v in r.items() if k != "start_step"} for r in without_timing(table)]

    assert same(fast) == same(slow)
    # What grad_stats carried into the trials: the golden run's running maximum of the loss.
    state = checkpoint.load(forward / "store" / "golden-s0" / "ff_000004.rank1.pt")
    assert set(state) == EVERY_DETECTOR
    assert state["grad_stats"]["running_max"] > 0
