"""The golden store (harness/campaign/golden_store.py): a golden run computed once stands in for
the same run in any later campaign folder or sweep job, with the same rows; an entry that is
corrupt or was computed from other inputs is recomputed, with a line saying so."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from harness.campaign.fastforward import golden_specs
from harness.campaign.golden_store import (
    GoldenMismatch,
    GoldenStore,
    code_version,
    package_version,
)
from harness.results.schema import Golden
from harness.runtime import checkpoint
from tests.conftest import compose_run, rows, sdc_bench, without_timing

# A fault at step 3 of 6, fast-forwarded from golden-s0's snapshot after step 2, on a GPT with
# 1.7 MB of gradients in bfloat16: the store has to hand over a snapshot (weights, AdamW state,
# every rank's check state) of a model over 1 MiB for the rows to match. A quarter of its tokens
# per step: the snapshot is the same size, the steps cost a third.
GPT_BF16 = [
    "campaign=single",
    "workload=gpt",
    "workload.micro_batch_size=4",
    "workload.dtype=bfloat16",
    "workload.steps=6",
    "campaign.seeds=1",
    "campaign.noise_seeds=2",
    "fault=grad_scale",
    "fault.steps=[3]",
    "detectors=[nan_inf,allreduce_sketch,grad_stats]",
]


def goldens(out: Path) -> dict[int, dict]:
    lines = (out / "golden.jsonl").read_text().splitlines()
    return {g["seed"]: g for g in map(json.loads, lines)}


def test_a_second_campaign_reuses_every_golden_with_the_same_rows_and_a_corrupt_one_reruns(
    tmp_path, run_ok
):
    store = tmp_path / "store"
    common = [*GPT_BF16, f"campaign.golden_cache={store}"]
    run_ok(*common, "out=first", cwd=tmp_path)
    assert all(g["reused_from"] is None for g in goldens(tmp_path / "first").values())

    second = run_ok(*common, "out=second", cwd=tmp_path)
    reused = goldens(tmp_path / "second")
    assert sorted(reused) == [0, 1]
    assert all(g["reused_from"].startswith(str(store)) for g in reused.values())
    assert f"golden store: 2 of the golden runs reused from {store} (seeds 0, 1)" in second.stderr
    assert without_timing(rows(tmp_path / "second")) == without_timing(rows(tmp_path / "first"))
    assert rows(tmp_path / "second")[0]["start_step"] == "3"  # it started from the snapshot
    report = (tmp_path / "second" / "report.md").read_text()
    assert f"Golden runs: 2; 2 reused from the golden store ({store}; seeds 0-1)" in report

    # One byte more in rank 1's check state of golden-s0's snapshot: that entry runs again (its
    # result and snapshot come back whole), the other is reused, and the rows stay the same.
    (snapshot,) = store.glob("*/s0/*/ff_000002.rank1.pt")
    snapshot.write_bytes(snapshot.read_bytes() + b"\0")
    third = run_ok(*common, "out=third", cwd=tmp_path)
    assert "does not match its checksum; golden-s0 runs again" in third.stderr
    again = goldens(tmp_path / "third")
    assert again[0]["reused_from"] is None and again[1]["reused_from"] is not None
    assert checkpoint.verify(snapshot)
    assert without_timing(rows(tmp_path / "third")) == without_timing(rows(tmp_path / "first"))


def test_other_checks_reuse_the_results_but_not_the_snapshots_their_state_is_in(tmp_path, run_ok):
    store = tmp_path / "store"
    mlp = ["campaign=single", "workload.steps=6", "campaign.seeds=1", "campaign.noise_seeds=2",
           "topology.nodes=2", "fault=grad_scale", "fault.steps=[3]",
           f"campaign.golden_cache={store}"]  # fmt: skip
    run_ok(*mlp, "detectors=[nan_inf]", "out=a", cwd=tmp_path)
    run_ok(*mlp, "detectors=[nan_inf,grad_stats]", "out=b", cwd=tmp_path)
    held = goldens(tmp_path / "b")
    # golden-s0 snapshots grad_stats' state for the trial: it runs; golden-s1 is only a
    # reference for the harm threshold: its result is reused.
    assert held[0]["reused_from"] is None and held[1]["reused_from"] is not None
    run_ok(*mlp, "detectors=[nan_inf,grad_stats]", "out=c", cwd=tmp_path)
    assert all(g["reused_from"] for g in goldens(tmp_path / "c").values())
    assert without_timing(rows(tmp_path / "c")) == without_timing(rows(tmp_path / "b"))

    # Off: every golden runs in its campaign, and the store is left as it was.
    held = sorted(p.relative_to(store) for p in store.rglob("*"))
    run_ok(*mlp, "detectors=[nan_inf,grad_stats]", "campaign.golden_cache=false", "out=off",
           cwd=tmp_path)  # fmt: skip
    assert all(g["reused_from"] is None for g in goldens(tmp_path / "off").values())
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == held
    assert without_timing(rows(tmp_path / "off")) == without_timing(rows(tmp_path / "b"))


@pytest.mark.slow  # 10 s: the default run keeps the reuse across two campaigns above
def test_a_sweep_of_three_fault_settings_runs_each_golden_once(tmp_path):
    store = tmp_path / "store"
    proc = sdc_bench(
        "-m",
        "fault=grad_scale",
        "fault.steps=[2]",
        "fault.factor=2,4,16",
        "workload.steps=4",
        "campaign.seeds=1",
        "campaign.noise_seeds=2",
        "topology.nodes=2",
        f"campaign.golden_cache={store}",
        "hydra.sweep.dir=sweep",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [goldens(tmp_path / "sweep" / str(n)) for n in range(3)]
    assert all(g["reused_from"] is None for g in jobs[0].values())
    assert all(g["reused_from"] for job in jobs[1:] for g in job.values())
    assert len(list(store.glob("*/s*/golden.json"))) == 2
    factors = [rows(tmp_path / "sweep" / str(n))[0]["factor"] for n in range(3)]
    assert factors == ["2.0", "4.0", "16.0"]


def test_a_result_that_differs_from_the_stores_for_the_same_inputs_is_refused(tmp_path):
    run = compose_run("campaign=single", "fault=grad_scale", "fault.steps=[3]")
    store = GoldenStore(tmp_path / "goldens", run, {"torch": "2.13.0"})
    spec = golden_specs(run)[0]
    (tmp_path / "campaign" / spec.trial_id).mkdir(parents=True)
    store.put(spec, Golden(spec.seed, 1.5, "abc"), tmp_path / "campaign")
    assert store.result(spec) == Golden(spec.seed, 1.5, "abc")
    store.put(spec, Golden(spec.seed, 1.5, "abc"), tmp_path / "campaign")
    with pytest.raises(GoldenMismatch, match="not deterministic, or its numbers depend on"):
        store.put(spec, Golden(spec.seed, 1.5000001, "abd"), tmp_path / "campaign")
    # Another environment is another key: nothing is found for it.
    other = GoldenStore(tmp_path / "goldens", run, {"torch": "2.14.0"})
    assert other.result(spec) is None
    # A workload one setting apart is another key too.
    longer = dataclasses.replace(run, workload=dataclasses.replace(run.workload, steps=31))
    assert GoldenStore(tmp_path / "goldens", longer, {"torch": "2.13.0"}).result(spec) is None


def test_the_code_version_follows_every_source_file_of_a_local_package(tmp_path, monkeypatch):
    package = tmp_path / "mymodels"
    (package / "deep").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "deep" / "blocks.py").write_text("WIDTH = 4\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)
    before = package_version("mymodels")
    (package / "deep" / "blocks.py").write_text("WIDTH = 5\n")
    package_version.cache_clear()
    assert package_version("mymodels") != before
    # A C kernel computes verdicts as its Python does (detectors/checksum.c): the same key, a
    # change to it passed for the same code.
    (package / "kernel.c").write_text("int width(void) { return 4; }\n")
    package_version.cache_clear()
    with_kernel = package_version("mymodels")
    (package / "kernel.c").write_text("int width(void) { return 5; }\n")
    package_version.cache_clear()
    assert package_version("mymodels") != with_kernel
    assert package_version("torch").startswith("torch==")
    # A workload's own packages are in its goldens' key by their installed versions.
    llama = code_version(compose_run("workload=llama").workload)
    assert llama["transformers"].startswith("transformers=="), llama
