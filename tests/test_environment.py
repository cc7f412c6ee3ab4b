"""Rows that reproduce wherever the pinned kernels exist: the pin, not the environment the
campaign was started from, decides which kernels a rank runs (harness.runtime.environment)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from harness.campaign.fastforward import golden_specs
from harness.campaign.run import check_out, claim
from harness.errors import ConfigError
from harness.launch.world import World
from harness.runtime import environment
from tests.conftest import compose_run, rows, sdc_bench, without_timing

# What a user may have in their shell when they start a campaign: nothing, or either pin.
PARENT_CAPABILITY = (None, "avx2", "default")
# The cheapest golden run whose weights show a change of kernels: 1 rank, 2 steps.
SMALL = ["campaign=single", "fault=none", "campaign.seeds=1", "detectors=[]", "topology.nodes=1"]


def golden(monkeypatch, tmp_path, parent: str | None, *overrides: str) -> tuple[float, str]:
    """Seed 0's golden run in a fresh world started from a parent whose ATEN_CPU_CAPABILITY is
    `parent`: its final loss and weights digest."""
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
    return outcome.parts[0].final_loss, outcome.parts[0].weights_digest


def test_the_pin_gives_the_same_weights_whatever_the_parent_has_and_native_does_not(
    monkeypatch, tmp_path
):
    pinned = {
        parent: golden(monkeypatch, tmp_path / f"p-{parent}", parent)
        for parent in PARENT_CAPABILITY
    }
    assert len(set(pinned.values())) == 1, pinned
    # Unpinned, the ranks take the machine's own kernels and MKL path: other last bits.
    native = golden(monkeypatch, tmp_path / "native", None, "topology.cpu_kernels=native")
    assert native[1] != pinned[None][1]


def test_a_rank_whose_torch_loaded_before_the_pin_is_refused():
    # This process loaded torch with whatever its environment said; a pin it does not run is
    # refused with the variables to start it with.
    for kernels in ("avx2", "default"):
        want = environment.pins(kernels).get("ATEN_CPU_CAPABILITY")
        runs = torch.backends.cpu.get_cpu_capability()
        if want is None or runs == want.upper():
            environment.check_rank(kernels)
        else:
            with pytest.raises(ConfigError, match=f"ATEN_CPU_CAPABILITY={want}"):
                environment.check_rank(kernels)
    environment.check_rank("native")


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
    claim(out, run)
    held = json.loads((out / "campaign.json").read_text())
    env = held["environment"]
    assert set(env) >= {"commit", "torch", "python", "cpu", "cpu_capability", "math_library",
                        "math_settings", "threads", "device", "backend"}  # fmt: skip
    assert (env["threads"], env["device"], env["backend"]) == ("1", "cpu", "gloo")
    check_out(out, run)  # the same campaign, the same environment: it resumes

    def record(**changes: str) -> None:
        (out / "campaign.json").write_text(json.dumps({**held, "environment": {**env, **changes}}))

    record(commit="0" * 40)
    check_out(out, run)
    record(cpu_capability="SVE256", math_settings="none")
    with pytest.raises(ConfigError, match=r"another environment \(cpu_capability .* -> "):
        check_out(out, run)
    # A folder from before environments were recorded: its numbers' origin is unknown.
    without = {k: v for k, v in held.items() if k != "environment"}
    (out / "campaign.json").write_text(json.dumps(without, sort_keys=True, indent=1))
    with pytest.raises(ConfigError, match="another environment"):
        check_out(out, run)


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
