"""Where ranks compute (`topology.device`) and what exact replay on GPUs needs: the pure
decisions, and the refusals through the real command (exit 2, one line, nothing spawned)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from harness.config.load import exact_replay
from harness.errors import ConfigError
from harness.launch.torchrun_world import mixed_devices
from harness.runtime import determinism, devices
from harness.runtime.workloads import Workload
from tests.conftest import compose_run, sdc_bench


@pytest.mark.parametrize(
    ("requested", "backend", "ranks", "gpus", "device"),
    [
        (None, "gloo", 4, 0, "cpu"),  # the spawned simulation without a GPU: as always
        (None, "gloo", 4, 2, "cpu"),
        # docs/design.md section 4: the simulated gloo world runs on the CPU unless told
        # otherwise, however many GPUs the machine has; only NCCL, which cannot, takes them.
        (None, "gloo", 4, 8, "cpu"),
        ("cuda", "gloo", 4, 1, "cuda"),  # four ranks sharing one GPU: a valid test rig
        ("cpu", "gloo", 4, 8, "cpu"),
        (None, "nccl", 3, 4, "cuda"),
    ],
)
def test_the_device_resolves_from_the_machine(requested, backend, ranks, gpus, device):
    assert devices.resolve(requested, backend, ranks, gpus) == device


@pytest.mark.parametrize(
    ("requested", "backend", "ranks", "gpus", "key", "words"),
    [
        ("cuda", "gloo", 4, 0, "topology.device", "needs a GPU"),
        ("cpu", "nccl", 4, 8, "topology.backend", "needs topology.device=cuda"),
        (None, "nccl", 4, 0, "topology.backend", "needs topology.device=cuda"),
        ("cuda", "nccl", 4, 2, "topology.backend", "4 ranks on this machine, 2 GPUs"),
        ("tpu", "gloo", 4, 0, "topology.device", "allowed: cpu, cuda"),
    ],
)
def test_a_placement_that_cannot_work_is_refused_naming_the_key(
    requested, backend, ranks, gpus, key, words
):
    with pytest.raises(ConfigError) as err:
        devices.resolve(requested, backend, ranks, gpus)
    assert err.value.key == key and words in str(err.value)


def test_no_overrides_run_on_the_cpu_on_a_machine_with_a_gpu_per_rank(monkeypatch):
    """`sdc-bench` with no overrides runs the simulated 4-node gloo world on the CPU (the
    contract, docs/design.md section 4): on a machine of 8 GPUs it ran on them, whose rows are
    not the CPU's, so a nightly on a GPU host compared other numbers with its CPU baseline."""
    monkeypatch.setattr(devices, "gpu_count", lambda: 8)
    topology = compose_run().topology
    assert (topology.nodes, topology.backend, topology.device) == (4, "gloo", "cpu")
    assert compose_run("topology.device=cuda").topology.device == "cuda"
    nccl = compose_run("topology.backend=nccl").topology
    assert (nccl.backend, nccl.device) == ("nccl", "cuda")


def test_ranks_take_their_own_gpu_or_share_them_round_robin():
    assert devices.rank_device("cpu", 3, 0) == torch.device("cpu")
    assert [devices.rank_device("cuda", r, 2).index for r in range(4)] == [0, 1, 0, 1]


def test_a_workload_builds_its_model_and_batches_on_its_device():
    run = compose_run("workload=gpt")
    workload = Workload(run.workload, "meta")
    model = workload.build_model()
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {t.device.type for t in (*workload.batch(0, 1, 0), *workload.eval_batch())} == {"meta"}
    # The same draws as on the CPU: batches come from the same generators, then move.
    cpu = Workload(run.workload)
    assert all(t.device.type == "cpu" for t in cpu.batch(0, 1, 0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU to run on")
@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["topology.device=cuda"], "topology.device", "'cuda' needs a GPU"),
        (["topology.backend=nccl", "topology.device=cpu"], "topology.backend", "with device=cpu"),
    ],
)
def test_the_command_refuses_what_this_machine_cannot_run(tmp_path, overrides, key, words):
    out = tmp_path / "out"
    proc = sdc_bench(*overrides, f"out={out}", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"sdc-bench: error: {key}:") and words in line, line
    assert not out.exists()


def test_exact_replay_needs_cublas_workspace_and_one_nccl_algorithm_and_protocol():
    assert determinism.settings({}, "gloo") == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert determinism.settings({"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, "nccl") == {
        "CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"
    }  # fmt: skip
    assert determinism.settings({"NCCL_ALGO": "Tree"}, "nccl")["NCCL_ALGO"] == "Tree"
    for env, words in [
        ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, "CUBLAS_WORKSPACE_CONFIG in :4096:8, :16:8"),
        ({"NCCL_ALGO": "Ring,Tree"}, "NCCL_ALGO fixed to one choice"),
        ({"NCCL_PROTO": "^LL128"}, "NCCL_PROTO fixed to one choice"),
    ]:
        with pytest.raises(ConfigError) as err:
            determinism.settings(env, "nccl")
        assert err.value.key == "detectors.replay.compare" and words in str(err.value)
        assert len(str(err.value).splitlines()) == 1


def test_the_preflight_marks_exact_replay_and_refuses_it_on_cuda_where_it_cannot_hold():
    run = compose_run("detectors=[replay]", "detectors.replay.compare=exact")
    assert run.topology.deterministic and run.topology.device == "cpu"
    assert not compose_run("detectors=[replay]").topology.deterministic
    on_gpu = replace(run.topology, device="cuda")
    checks = run.detectors
    assert exact_replay(on_gpu, checks, list(run.trials), env={}).deterministic
    with pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG"):
        exact_replay(on_gpu, checks, list(run.trials), env={"CUBLAS_WORKSPACE_CONFIG": ":1:1"})
    # On the CPU nothing is set: its kernels are deterministic already.
    assert exact_replay(run.topology, checks, [], env={"CUBLAS_WORKSPACE_CONFIG": ":1:1"})


def test_a_torchrun_world_whose_hosts_resolve_different_devices_is_refused():
    """Each host resolves `topology.device` itself: hosts on two kinds of device would
    fingerprint weights by two methods and alarm on every consensus. The world refuses before
    its first trial (torchrun's ranks all gather their kind; the tests/test_multihost.py runs
    take that path with every host on the CPU)."""
    hosts = ["node-a", "node-a", "node-b", "node-b"]
    assert mixed_devices(["cpu"] * 4, hosts) is None
    assert mixed_devices(["cuda"] * 4, hosts) is None
    line = mixed_devices(["cuda", "cuda", "cpu", "cpu"], hosts)
    assert line is not None and line.startswith("topology.device: ")
    assert "cpu on node-b; cuda on node-a" in line and "topology.device=cpu" in line
