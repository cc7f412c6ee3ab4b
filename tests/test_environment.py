"""Rows that reproduce wherever the pinned kernels exist: the pin, not the environment the
campaign was started from, decides which kernels a rank runs (harness.runtime.environment)."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch

from harness.campaign.fastforward import golden_specs
from harness.campaign.golden_store import code_version
from harness.campaign.run import bind, check_out
from harness.errors import ConfigError
from harness.launch.world import World
from harness.runtime import environment
from tests.conftest import BIN, compose_run, rows, sdc_bench, without_timing

ROOT = str(Path(__file__).parents[1])

# What a user may have in their shell when they start a campaign: nothing, or either pin.
PARENT_CAPABILITY = (None, "avx2", "default")
# The cheapest golden run whose weights show a change of kernels: 1 rank, 2 steps.
SMALL = ["campaign=single", "fault=none", "campaign.seeds=1", "detectors=[]", "topology.nodes=1"]


def golden(monkeypatch, tmp_path, parent: str | None, *overrides: str) -> tuple[float, str, dict]:
    """Seed 0's golden run in a fresh world started from a parent whose ATEN_CPU_CAPABILITY is
    `parent`: its final loss and weights digest, and the environment its ranks reported."""
    if parent is None:
        monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    else:
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", parent)
    run = compose_run(*SMALL, "workload.steps=2", *overrides)
    world = World(run.topology, tmp_path, tmp_path / "store")
    try:
        outcome = world.run(run, golden_specs(run)[0])
    finally:
        world.close()
    assert outcome.parts is not None, outcome.crash
    reported = environment.record(world.environments)
    return outcome.parts[0].final_loss, outcome.parts[0].weights_digest, reported


def test_the_pin_gives_the_same_weights_whatever_the_parent_has_and_native_does_not(
    monkeypatch, tmp_path
):
    pinned = {
        parent: golden(monkeypatch, tmp_path / f"p-{parent}", parent)
        for parent in PARENT_CAPABILITY
    }
    assert len({(loss, digest) for loss, digest, _ in pinned.values()}) == 1, pinned
    # Each rank reports the pins it runs, whatever the parent had.
    for _, _, reported in pinned.values():
        assert reported["cpu_capability"] == "AVX2"
        assert set(environment.pins("avx2").items()) <= set(_settings(reported))
    # Unpinned, the ranks take the machine's own kernels and MKL path: other last bits, and a
    # record that names none of the pins (under torchrun, below, a rank's own choice).
    native = golden(monkeypatch, tmp_path / "native", None, "topology.cpu_kernels=native")
    assert native[1] != pinned[None][1]
    assert "ATEN_CPU_CAPABILITY" not in dict(_settings(native[2]))


def _settings(env: dict[str, str]) -> list[tuple[str, str]]:
    """math_settings as (variable, value) pairs."""
    words = env["math_settings"].split()
    return [] if words == ["none"] else [tuple(w.split("=", 1)) for w in words]


def test_a_rank_that_lacks_a_pin_is_refused_naming_the_variables():
    # This process's own report: whatever it loaded torch with, a pin it does not run is
    # refused with the variables it lacks and those to start it with.
    mine = environment.report("avx2", "cpu", "gloo", None)
    for kernels in ("avx2", "default"):
        wanted = environment.pins(kernels)
        refused = environment.refusal(kernels, [mine])
        lacking = [k for k, v in wanted.items() if mine.variables.get(k) != v]
        if not lacking and mine.cpu_capability == wanted["ATEN_CPU_CAPABILITY"].upper():
            assert refused is None
        else:
            assert refused is not None and "\n" not in str(refused)
            assert all(name in str(refused) for name in lacking)
            assert str(refused).endswith(" ".join(f"{k}={v}" for k, v in wanted.items()))
    assert environment.refusal("native", [mine]) is None


def test_the_pins_are_in_a_rank_environment_only_while_it_starts(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.delenv("MKL_CBWR", raising=False)
    with environment.pinned("avx2"):
        inside = {k: os.environ.get(k) for k in environment.pins("avx2")}
    assert inside == environment.pins("avx2")
    assert os.environ["ATEN_CPU_CAPABILITY"] == "default"
    assert "MKL_CBWR" not in os.environ
    with environment.pinned("native"):
        assert os.environ["ATEN_CPU_CAPABILITY"] == "default"


def test_a_resume_in_another_numeric_environment_is_refused_and_a_new_commit_is_not(tmp_path):
    run = compose_run(*SMALL)
    out = tmp_path / "run"
    ranks = [environment.report(run.topology.cpu_kernels, "cpu", "gloo", run.topology.cpu_numerics)]
    bind(out, run, ranks)
    held = json.loads((out / "campaign.json").read_text())
    env = held["environment"]
    assert env == environment.record(ranks)
    assert set(env) >= {"commit", "torch", "python", "cpu", "cpu_capability", "math_library",
                        "math_settings", "threads", "device", "backend"}  # fmt: skip
    bind(out, run, ranks)  # the same campaign, the same environment: it resumes

    def record(**changes: str) -> None:
        (out / "campaign.json").write_text(json.dumps({**held, "environment": {**env, **changes}}))

    record(commit="0" * 40)
    bind(out, run, ranks)
    record(cpu_capability="SVE256", math_settings="none")
    with pytest.raises(ConfigError, match=r"another environment \(cpu_capability .* -> "):
        bind(out, run, ranks)
    # A folder from before environments were recorded: its numbers' origin is unknown.
    without = {k: v for k, v in held.items() if k != "environment"}
    (out / "campaign.json").write_text(json.dumps(without, sort_keys=True, indent=1))
    with pytest.raises(ConfigError, match="another environment"):
        bind(out, run, ranks)
    check_out(out, run)  # before any rank reports, only the campaign's identity is checked


def test_a_resume_by_other_code_is_refused_before_any_process_starts(tmp_path):
    """The folder's goldens, snapshots and rows were computed by the code that started it: a
    resume by other code mixed two versions' rows, the new judged against the old goldens,
    under the first commit's name. campaign.json records the sources' digests; other digests,
    or none recorded, are refused."""
    run = compose_run(*SMALL)
    out = tmp_path / "run"
    ranks = [environment.report(run.topology.cpu_kernels, "cpu", "gloo", run.topology.cpu_numerics)]
    bind(out, run, ranks)
    held = json.loads((out / "campaign.json").read_text())
    assert held["code"] == code_version(run.workload)
    check_out(out, run)  # the same code resumes

    def record(content: dict) -> None:
        (out / "campaign.json").write_text(json.dumps(content, sort_keys=True, indent=1))

    record({**held, "code": {**held["code"], "detectors": "0" * 16}})
    with pytest.raises(ConfigError, match=r"by other code \(detectors changed\)"):
        check_out(out, run)
    record({k: v for k, v in held.items() if k != "code"})
    with pytest.raises(ConfigError, match=r"by other code \(not recorded\)"):
        check_out(out, run)


@pytest.mark.parametrize("left", ["golden.jsonl", "events.jsonl", "store", "trials.csv"])
@pytest.mark.parametrize("campaign", ["missing", "empty"])
def test_a_campaigns_records_without_a_readable_campaign_json_are_refused(tmp_path, left, campaign):
    """Goldens, events or snapshots in a folder whose campaign.json is gone or unreadable were
    adopted by whatever campaign ran there next (its clean trials judged against another
    workload's goldens): trials of unknown origin, refused as their rows are."""
    run = compose_run(*SMALL)
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("a user's own file")
    (out / "store").mkdir()
    (out / "store" / ".shared-0-1").write_text("a torchrun host's probe")
    check_out(out, run)  # a folder of the user's own, a store a torchrun world probed: no record
    if left == "store":
        (out / "store" / "golden-s0").mkdir()
    else:
        (out / left).write_text("{}\n")
    if campaign == "empty":
        (out / "campaign.json").write_text("")
    with pytest.raises(ConfigError, match=f"unknown origin \\({left}"):
        check_out(out, run)


# A torchrun world of 2 ranks on this host: what a user starts from the printed command.
TORCHRUN = ["torchrun", "--standalone", "--nproc-per-node=2", "-m", "harness.torchrun_worker"]
RECORDED = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OPENBLAS_CORETYPE",
            "MKL_NUM_THREADS", "OMP_NUM_THREADS")  # fmt: skip


def planned(run_ok, tmp_path, kernels: str, *workload: str) -> Path:
    """SMALL (on `workload`'s overrides) planned for torchrun on 2 ranks with `kernels`."""
    plan = tmp_path / "plan"
    args = [*SMALL, "workload.steps=2", "campaign.noise_seeds=2", "topology.ranks_per_node=2"]
    run_ok(*args, *workload, f"topology.cpu_kernels={kernels}", "launcher=torchrun",
           f"out={plan}", cwd=tmp_path)  # fmt: skip
    return plan


def torchrun(
    run_ok, tmp_path, kernels: str, *workload: str, **variables: str
) -> subprocess.CompletedProcess:
    """Plan SMALL (on `workload`'s overrides) on 2 ranks with `kernels`, then run the worker
    under torchrun in an environment with only `variables` of the recorded ones."""
    plan = planned(run_ok, tmp_path, kernels, *workload)
    env = {k: v for k, v in os.environ.items() if k not in RECORDED}
    env = dict(env, PATH=f"{BIN}:{env['PATH']}", **variables)
    trust = ["--trust-plan"] if workload else []
    return subprocess.run(
        [*TORCHRUN, str(plan), *trust], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip


def test_a_torchrun_worker_without_the_printed_variables_exits_2_in_one_line(tmp_path, run_ok):
    # torch's capability here is the pin's (ATEN_CPU_CAPABILITY is set, and this CPU has AVX2),
    # but MKL and oneDNN loaded without theirs: every rank would compute otherwise.
    done = torchrun(run_ok, tmp_path, "avx2", ATEN_CPU_CAPABILITY="avx2")
    lines = done.stderr.splitlines()
    errors = [line for line in lines if "harness.torchrun_worker: error:" in line]
    assert errors == [
        "harness.torchrun_worker: error: topology.cpu_kernels: 'avx2' but rank 0 on "
        f"{platform.node()} runs with MKL_CBWR=(unset), ONEDNN_MAX_CPU_ISA=(unset); start every "
        "rank with ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=AVX2"
    ], done.stderr[-3000:]
    # torchrun's summary of its workers' exit codes: every rank left with 2.
    assert re.findall(r"^\s+exitcode\s*: (\d+)", done.stderr, re.M) == ["2", "2"], done.stderr[
        -3000:
    ]
    assert not (tmp_path / "plan" / "campaign.json").exists()


@pytest.mark.parametrize(
    "args, environ, error",
    [
        ([], {}, "arguments: OUT [--trust-plan] are allowed (the command sdc-bench printed); "
                 "got none"),
        (["plan", "d"], {}, "arguments: OUT [--trust-plan] are allowed (the command sdc-bench "
                            "printed); got plan d"),
        (["plan"], {}, "RANK, WORLD_SIZE, LOCAL_WORLD_SIZE unset: run it under torchrun, as "
                       "sdc-bench printed it"),
    ],
    ids=["no-out", "a-path-split-at-its-space", "not-under-torchrun"],
)  # fmt: skip
def test_the_torchrun_worker_refuses_what_it_was_not_started_with_in_one_line(
    tmp_path, args, environ, error
):
    """An IndexError or a KeyError traceback; a stray argument (an unquoted path's second
    word, a misspelled --trust-plan) was ignored."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [str(BIN / "python"), "-m", "harness.torchrun_worker", *args], cwd=tmp_path,
        env={**env, **environ}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == f"harness.torchrun_worker: error: {error}\n"


def test_campaign_json_records_what_the_torchrun_ranks_ran_and_rank_0_alone_validated(
    tmp_path, run_ok
):
    """The ranks' environment, not the plan's, goes into campaign.json; and the ranks take rank
    0's validated plan: rank 0 builds the user's model once more than the other rank (its
    validation's), the other as often as its trials need."""
    # Unpinned (`native`), the ranks run what their own environment chose: here torch's portable
    # kernels and MKL's AVX2 branch, where this test's process and the planning one run AVX2.
    builds = tmp_path / "builds"
    custom = ("workload=custom", "workload.model._target_=tests.fixtures_custom.CountedConvNet")
    done = torchrun(run_ok, tmp_path, "native", *custom, ATEN_CPU_CAPABILITY="default",
                    MKL_CBWR="AVX2", PYTHONPATH=ROOT, SDC_COUNT_BUILDS=str(builds))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(rows(tmp_path / "plan")) == 1
    per_rank = sorted(Counter(builds.read_text().split()).values())
    assert len(per_rank) == 2 and per_rank[1] == per_rank[0] + 1 and per_rank[0] > 0, per_rank
    env = json.loads((tmp_path / "plan" / "campaign.json").read_text())["environment"]
    # Every rank reported the same (one value per field); torchrun sets OMP_NUM_THREADS=1.
    assert env["cpu_capability"] == "DEFAULT"
    assert env["math_settings"] == "ATEN_CPU_CAPABILITY=default MKL_CBWR=AVX2 OMP_NUM_THREADS=1"
    assert (env["threads"], env["device"], env["backend"]) == ("1", "cpu", "gloo")
    assert torch.backends.cpu.get_cpu_capability() != "DEFAULT"
    # The plan written again, as a job script does before each resubmission: the same campaign
    # (its device left to the ranks, campaign.json holds theirs), not "a different campaign's".
    planned(run_ok, tmp_path, "native", *custom)


@pytest.mark.slow
def test_rows_are_identical_whatever_the_parent_has_and_differ_with_native(tmp_path):
    """The acceptance run (about 4 minutes on 2 cores): the default campaign of one golden
    loss per seed, 4 ranks and 30 steps, where native and pinned kernels end at other losses."""
    plan = ["campaign=single", "fault=none", "campaign.seeds=1", "detectors=[]"]
    tables = {}
    for name, kernels, parent in (
        ("unset", "avx2", None),
        ("avx2", "avx2", "avx2"),
        ("default", "avx2", "default"),
        ("native", "native", None),
    ):
        env = dict(os.environ)
        env.pop("ATEN_CPU_CAPABILITY", None)
        if parent:
            env["ATEN_CPU_CAPABILITY"] = parent
        out = tmp_path / name
        proc = sdc_bench(
            *plan, f"topology.cpu_kernels={kernels}", f"out={out}", cwd=tmp_path, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        tables[name] = without_timing(rows(out))
    assert tables["unset"] == tables["avx2"] == tables["default"]
    assert tables["native"][0]["golden_final_loss"] != tables["unset"][0]["golden_final_loss"]
