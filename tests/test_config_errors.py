"""Bad input: exit 2, one line naming the key and what is allowed, before anything is spawned
or written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import detectors
from harness import cli
from harness.analysis.sweep import planned_jobs
from harness.cli import CONFIG_DIR
from harness.errors import ConfigError
from tests.conftest import compose_run, sdc_bench

FSDP = ["topology.parallel=fsdp", "detectors=[nan_inf]", "campaign=single"]
# Hydra's choices of the workload group: every config in experiments/workload/.
WORKLOADS = sorted(p.stem for p in (Path(CONFIG_DIR) / "workload").glob("*.yaml"))
# What the refusals list, from the registry, so that a check added beside these leaves them true.
SHARDED_CHECKS = "allowed: " + ", ".join(
    sorted(n for n in detectors.available() if "fsdp" in detectors.detector_class(n).parallel)
)
EVERY_CHECK = "allowed: " + ", ".join(detectors.available())
CASES = [
    (["topology.parallel=zero"], "topology.parallel", "allowed: ddp, fsdp, hsdp"),
    (["topology.parallel=hsdp"], "topology.shard_size", "hsdp needs the size"),
    (["topology.parallel=hsdp", "topology.shard_size=3"], "topology.shard_size", "allowed: 2"),
    (["topology.parallel=hsdp", "topology.shard_size=4"], "topology.shard_size", "allowed: 2"),
    (["topology.shard_size=2"], "topology.shard_size", "only hsdp reads it"),
    (
        ["topology.parallel=fsdp", "detectors=[spiky_loss]"],
        "detectors.spiky_loss",
        SHARDED_CHECKS,
    ),
    ([*FSDP, "recovery.enabled=true"], "topology.spares", "allowed: 3 or more"),
    # DDP drops a quarantined node without a spare: one node would leave none to run on.
    (
        [
            "fault=grad_nan",
            "topology.nodes=1",
            "topology.ranks_per_node=4",
            "recovery.enabled=true",
        ],
        "topology.spares",
        "a world of one node with no spare has none left to train on",
    ),
    ([*FSDP, "fault=grad_scale", "fault.bucket=0"], "fault.bucket", "fsdp has no buckets"),
    (
        ["topology.parallel=fsdp", "detectors=[weight_consensus]"],
        "detectors.weight_consensus",
        SHARDED_CHECKS,
    ),
    (
        ["topology.parallel=hsdp", "topology.shard_size=2", "detectors=[weight_consensus]"],
        "topology.shard_size",
        "at least 3 replica groups",
    ),
    (
        [
            "topology.parallel=fsdp",
            "topology.nodes=8",
            "detectors=[nan_inf]",
            "campaign=single",
            "fault=weight_bitflip",
            "fault.tensor=head.bias",
            "fault.ranks=[6]",
        ],
        "fault.ranks",
        "rank 6 holds no element of 'head.bias' at site weight",
    ),  # fmt: skip
    (
        ["topology.parallel=fsdp", "detectors=[megatron_hash]"],
        "detectors.megatron_hash",
        SHARDED_CHECKS,
    ),
    (["detectors=[gather_consensus]"], "detectors.gather_consensus", "allowed: allreduce_sketch"),
    (
        [
            "topology.parallel=fsdp",
            "topology.nodes=1",
            "topology.ranks_per_node=2",
            "detectors=[gather_consensus]",
        ],
        "topology",
        "at least 3 ranks",
    ),  # fmt: skip
    (
        [*FSDP, "fault=allreduce_rank", "fault.model=drop"],
        "fault.model",
        "allowed: an element model",
    ),
    (
        ["campaign=single", "fault=grad_nan", "fault.site=gather"],
        "fault.site",
        "needs topology.parallel=fsdp or hsdp",
    ),
    (["campaign.golden_cache=7"], "campaign.golden_cache", "allowed: true, false or a folder"),
    (["campaign.golden_cache=off"], "campaign.golden_cache", "allowed: true, false or a folder"),
    (["campaign.golden_cache=/dev/null/goldens"], "campaign.golden_cache", "not a writable"),
    # Its permission bits let root write, yet nothing can be made there (a pseudo file system).
    (["campaign.golden_cache=/proc/goldens"], "campaign.golden_cache", "/proc is not a writable"),
    (["fault.site=gpu"], "fault.site", "allowed: none, grad, allreduce, weight, optimizer"),
    (["campaign=single", "fault=grad_bitflip", "fault.model=melt"], "fault.model", "bitflip"),
    (["campaign=single", "fault=grad_bitflip", "fault.bit=32"], "fault.bit", "0..31"),
    (
        ["campaign=single", "fault=grad_bitflip", "workload.dtype=bfloat16", "fault.bit=16"],
        "fault.bit",
        "0..15",
    ),
    (["campaign=single", "fault=grad_bitflip", "fault.ranks=[4]"], "fault.ranks", "0..3"),
    (["campaign=single", "fault=grad_bitflip", "fault.steps=[30]"], "fault.steps", "0..29"),
    (["campaign=single", "fault=grad_bitflip", "fault.steps=[]"], "fault.steps", "non-empty"),
    (["campaign=single", "fault=grad_scale", "fault.factor=inf"], "fault.factor", "finite"),
    (["campaign=single", "fault=grad_scale", "fault.factor=1"], "fault.factor", "never strike"),
    (["campaign=single", "fault=grad_bitflip", "fault.scope=rank"], "fault.scope", "no scope"),
    (
        ["campaign=single", "fault=grad_bitflip", "fault.tensor=nothing.*"],
        "fault.tensor",
        "matches nothing at site grad",
    ),
    (["fault.model=stuck", "fault.site=grad"], "fault.stuck_at", "allowed: 0, 1"),
    (
        ["campaign.scenarios=[{site:grad,model:bitflip,ranks:[0],steps:[1],grid:{bit:7}}]"],
        "campaign.scenarios[0].grid.bit",
        "not a list of values; or 'all'",
    ),
    (["campaign.fast_forward=sometimes"], "campaign.fast_forward", "allowed: true, false"),
    (["fault=grad_scale", "fault.ber=0.001"], "fault.ber", "needs model bitflip"),
    (
        ["topology.parallel=hsdp", "topology.shard_size=2", "detectors=[weight_consensus]"],
        "topology.shard_size",
        "this world of 4 has 2; allowed: a world of at least 6 ranks at this shard size",
    ),
    # Past what the forward trace saw the fault's target make: the rank raised IndexError, and
    # the trial was recorded as a crash; a unit's lane past every product never struck; more
    # elements than the module drawn makes were struck as fewer, recorded as asked.
    (
        [
            "fault.site=matmul",
            "fault.model=scale",
            "fault.factor=8",
            "fault.tensor=*",
            "fault.elements=2000",
        ],
        "fault.elements",
        "2000 is more than the 320 elements of the product struck in 'head'; allowed: 1..320",
    ),
    (
        [
            "fault=activation_nan",
            "fault.model=burst",
            "fault.burst_model=value",
            "fault.elements=9000",
        ],
        "fault.elements",
        "a burst of 9000 at stride 1 spans 9000 elements, past the output struck in 'fc1'",
    ),
    (
        [
            "fault.site=matmul",
            "fault.model=bitflip",
            "fault.phase=backward",
            "fault.schedule=[{step:3,rank:1,tensor:fc1,index:16384,bit:30}]",
        ],
        "fault.schedule[0].index",
        "16384 is out of range: the product's second operand struck in 'fc1' has 16384",
    ),
    (
        [
            "fault.site=activation",
            "fault.model=bitflip",
            "fault.schedule=[{step:3,rank:1,tensor:fc1,index:999999999,bit:30}]",
        ],
        "fault.schedule[0].index",
        "the output struck in 'fc1' has 8192 elements; allowed: 0..8191",
    ),
    (
        [
            "fault.site=matmul",
            "fault.model=defective_unit",
            "fault.persistence=permanent",
            "fault.lanes=1024",
            "fault.lane=1000",
        ],
        "fault.lane",
        "1000 is past every product '*' names, the widest 256 columns",
    ),
    (
        ["fault.site=matmul", "fault.model=bitflip", "fault.bit=null", "fault.ber=0.01"],
        "fault.ber",
        # What it offers instead is allowed there (index is not: drawn in the forward).
        "leave it unset (allowed there: elements, select, or model defective_unit",
    ),
    (
        [
            "fault.site=matmul",
            "fault.model=bitflip",
            "fault.product=9",
            "fault.schedule=[{step:3,rank:1,tensor:fc1,index:5,bit:30}]",
        ],
        "fault.product",
        "9 is never reached: 'fc1' makes 1 product",
    ),  # fmt: skip
    (["fault=grad_bitflip", "fault.select=smallest"], "fault.select", "allowed: random, largest"),
    (["fault=grad_scale", "fault.select=largest", "fault.index=3"], "fault.index", "picks the"),
    (
        ["fault=grad_bitflip", "fault.select=largest", "fault.ber=0.001"],
        "fault.ber",
        "select largest picks the elements itself",
    ),
    (
        [
            "fault.site=allreduce",
            "fault.scope=reduction",
            "fault.model=drop",
            "fault.ranks=[1]",
            "fault.steps=[1]",
            "fault.select=largest",
            "campaign=single",
        ],
        "fault.select",
        "not an element; allowed: random",
    ),  # fmt: skip
    (["fault=grad_bitflip", "fault.nbits=40"], "fault.nbits", "1..32"),
    # Keys only some faults read: ignored, they would still split the trials' scenario cells.
    (["fault=grad_scale", "fault.nbits=2"], "fault.nbits", "only model bitflip"),
    (["fault=grad_scale", "fault.bit=3"], "fault.bit", "model scale changes no chosen bit"),
    (["fault=grad_bitflip", "fault.factor=10.0"], "fault.factor", "only model scale"),
    (["fault=grad_scale", "fault.value=nan"], "fault.value", "only models value and crash"),
    (["fault=allreduce_reduction", "fault.follows=data"], "fault.follows", "one node's hardware"),
    (
        [
            "fault=weight_bitflip",
            "fault.bit=null",
            "fault.schedule=[{step:1,rank:0,tensor:fc1.weight,index:0,bit:3}]",
            "fault.nbits=2",
        ],
        "fault.nbits",
        "a schedule's entry its bit",
    ),
    (
        [
            "fault=grad_bitflip",
            "fault.bit=null",
            "fault.tensor=fc1.weight",
            "fault.schedule=[{step:1,rank:0,tensor:fc1.weight,index:0}]",
        ],
        "fault.tensor",
        "a schedule names each strike's tensor",
    ),
    (
        [
            "fault=grad_bitflip",
            "fault.site=activation",
            "fault.bit=null",
            "fault.tensor=fc2",
            "fault.schedule=[{step:1,rank:0,tensor:fc1,index:0}]",
        ],
        "fault.tensor",
        "a schedule names each strike's tensor",
    ),
    # At allreduce, gather and loss a schedule's entries name their tensors as well: there
    # `tensor` was ignored, and `riders` made the fault never strike.
    *[
        (
            [
                "fault=allreduce_rank",
                f"fault.tensor={tensor}",
                "fault.schedule=[{step:1,rank:0,tensor:fc1.weight,index:0}]",
            ],
            "fault.tensor",
            "a schedule names each strike's tensor",
        )
        for tensor in ("riders", "fc*")
    ],
    (
        [
            "fault=loss_scale",
            "fault.tensor=lo*",
            "fault.schedule=[{step:1,rank:0,tensor:loss,index:0}]",
        ],
        "fault.tensor",
        "a schedule names each strike's tensor",
    ),
    (
        [
            *FSDP,
            "fault=grad_scale",
            "fault.site=gather",
            "fault.tensor=fc*",
            "fault.schedule=[{step:1,rank:0,tensor:fc1.weight,index:0}]",
        ],
        "fault.tensor",
        "a schedule names each strike's tensor",
    ),
    # A broken reduction gives every receiver the same wrong sum from one node's hardware; a
    # schedule's entries strike the copies of the ranks they name, a fault of scope rank.
    (
        ["fault=allreduce_reduction", "fault.schedule=[{step:1,rank:1,tensor:fc1.weight,index:0}]"],
        "fault.schedule",
        "scope rank",
    ),
    (
        [
            "fault=allreduce_reduction",
            "fault.model=drop",
            "fault.factor=null",
            "fault.schedule=[{step:1,rank:1,tensor:fc1.weight,index:0}]",
        ],
        "fault.schedule",
        "whole contribution",
    ),
    (["fault=grad_bitflip", "fault.adjacent=false"], "fault.adjacent", "nbits > 1"),
    # Values the run would never read.
    (
        [
            "campaign=single",
            "fault=grad_scale",
            "+campaign.scenarios=[{site:weight,model:scale,factor:5.0,ranks:[1],steps:[2]}]",
        ],
        "campaign.scenarios",
        "would ignore them",
    ),
    (["campaign=default", "campaign.name=single"], "campaign.scenarios", "would ignore them"),
    (["recovery.max_recoveries=7"], "recovery.max_recoveries", "recovery.enabled=true"),
    (["topology.spares=1"], "topology.spares", "recovery.enabled=true"),
    (["workload=gpt", "+workload.kv_heads=2"], "workload.kv_heads", "never reads it (only llama)"),
    (["workload=mlp", "+workload.vocab=64"], "workload.vocab", "(only gpt and llama)"),
    (
        ["topology.nodes=2", "detectors=[grad_stats]", "detectors.grad_stats.threshold=3.0"],
        "detectors.grad_stats.threshold",
        "needs 3 or more ranks",
    ),
    (
        [
            "topology.nodes=1",
            "detectors=[grad_stats]",
            "campaign.scenarios=[{site:none,checks:{grad_stats:{min_ratio:2.0}}}]",
        ],
        "campaign.scenarios[0].checks.grad_stats.min_ratio",
        "needs 2 or more ranks",
    ),
    (
        # Recovery puts the run's checks in act mode; a scenario's observe would have switched
        # it off for its trials unsaid (no stop, no recovery, campaign.json saying enabled).
        [
            "recovery.enabled=true",
            "detectors=[nan_inf]",
            "campaign.scenarios=[{site:grad,model:value,value:nan,ranks:[3],steps:[5],"
            "checks:{nan_inf:{mode:observe}}}]",
        ],
        "campaign.scenarios[0].checks.nan_inf.mode",
        "observe: recovery acts on alerts",
    ),
    # The run's own check set to observe: recovery put it in act mode without a word.
    (
        [
            "campaign=single",
            "fault=grad_nan",
            "recovery.enabled=true",
            "topology.spares=1",
            "detectors.nan_inf.mode=observe",
        ],
        "detectors.nan_inf.mode",
        "observe: recovery acts on alerts, so its run's checks stop the step they alarm on; "
        "allowed: act, or leave it null",
    ),
    (["workload.min_lr_ratio=0.5"], "workload.min_lr_ratio", "lr_schedule=warmup_cosine"),
    (
        ["detectors=[replay]", "detectors.replay.compare=exact", "detectors.replay.rtol=0.01"],
        "detectors.replay.rtol",
        "only compare=tolerant",
    ),
    (
        ["detectors=[replay]", "detectors.replay.interval=null", "detectors.replay.steps=[3,30]"],
        "detectors.replay.steps",
        "allowed: 0..29",
    ),
    (
        [
            "detectors=[replay]",
            "++campaign.overhead={steps:3,rounds:1}",
            "campaign.scenarios=[{site:grad,model:scale,factor:10.0,ranks:[1],steps:[2],"
            "checks:{replay:{rtol:0.1}}},{site:grad,model:scale,factor:10.0,ranks:[1],steps:[3]}]",
        ],
        "campaign.scenarios[1].checks.replay",
        "campaign.overhead times one setting of replay",
    ),
    # A check that never looks in the run would be recorded as running and catching nothing.
    (
        ["detectors=[megatron_hash]", "workload.steps=8"],
        "detectors.megatron_hash.interval",
        "never looks in this 8-step run (every 10 steps, its first after step 9)",
    ),
    (
        ["detectors=[weight_consensus]", "workload.steps=8"],
        "detectors.weight_consensus.interval",
        "allowed: 1..8, or more workload.steps",
    ),
    # Consensus also looks before every checkpoint: every 5 steps here, whatever its interval.
    (
        [
            "detectors=[weight_consensus]",
            "detectors.weight_consensus.interval=50",
            "checkpoint.interval=5",
        ],
        "detectors.weight_consensus.interval",
        "set it to 5, or checkpoint.interval to a multiple of 50",
    ),
    (["fault=grad_bitflip", "fault.stuck_at=1"], "fault.stuck_at", "only model stuck"),
    (
        ["fault=grad_scale", "fault.persistence=permanent", "fault.probability=0.2"],
        "fault.probability",
        "only an intermittent fault",
    ),
    (
        [
            "fault=weight_bitflip",
            "fault.index=3",
            "fault.schedule=[{step:1,rank:0,tensor:fc1.weight,index:0}]",
        ],
        "fault.index",
        "a schedule names each strike's element",
    ),
    (["fault=activation_nan", "fault.tensor=conv*"], "fault.tensor", "nothing at site activation"),
    (["fault=weight_bitflip", "fault.bucket=0"], "fault.bucket", "allowed: grad, allreduce"),
    (
        ["fault=weight_bitflip", "fault.schedule=[{step:1,rank:0,tensor:fc9.weight,index:0}]"],
        "fault.schedule[0].tensor",
        "fc1.weight",
    ),
    (["fault=grad_bitflip", "fault.steps=[x:y]"], "fault.steps[0]", "not a range"),
    (
        ["detectors=[replay]", "detectors.replay.interval=0"],
        "detectors.replay.interval",
        "allowed: 1..inf",
    ),
    (
        ["detectors=[titan_replay]", "detectors.titan_replay.num_steps=-2"],
        "detectors.titan_replay.num_steps",
        "'-2' is not allowed; allowed: 1..inf, or -1 (every step)",
    ),
    (
        ["detectors=[weight_consensus]", "detectors.weight_consensus.interval=-2"],
        "detectors.weight_consensus.interval",
        "allowed: 1..inf",
    ),
    (
        ["detectors=[replay]", "detectors.replay.interval=4", "detectors.replay.steps=[3]"],
        "detectors.replay.steps",
        "give one of interval and steps",
    ),
    (["detectors=[replay]", "topology.nodes=2"], "topology.nodes", "at least 3 nodes"),
    # Faults that could never strike as configured, or would store another value than recorded.
    (
        ["workload.precision=bf16-true", "fault=grad_scale", "fault.factor=1.001"],
        "fault.factor",
        "rounds back to every element in bfloat16",
    ),
    (
        [
            "workload.precision=bf16-true",
            "fault=grad_scale",
            "fault.model=burst",
            "fault.burst_model=scale",
            "fault.elements=4",
            "fault.factor=1.001",
        ],
        "fault.factor",
        "rounds back to every element in bfloat16",
    ),  # fmt: skip
    (
        ["workload.precision=16-true", "fault=grad_nan", "fault.value=100000"],
        "fault.value",
        "is stored as inf in float16",
    ),
    (
        ["fault=grad_nan", "fault.value=1e40"],
        "fault.value",
        "<= 3.40282e+38, or nan, inf, -inf, max, zero, random",
    ),
    (["fault=loss_scale", "fault.model=swap", "fault.factor=null"], "fault.site", "one element"),
    (["fault=grad_bitflip", "fault.ber=1e-5"], "fault.bit", "draws its own bits"),
    (["fault=activation_nan", "fault.index=5"], "fault.index", "when the module's forward runs"),
    (
        [
            "workload.precision=bf16-mixed",
            "fault=activation_nan",
            "fault.model=bitflip",
            "fault.value=null",
            "fault.bit=20",
        ],
        "fault.bit",
        "20 is outside bfloat16, the dtype of the output of",
    ),  # fmt: skip
    # What a module fault writes, in the dtype it strikes (bfloat16 under autocast, where the
    # workload's is float32): its flipped bits, a schedule's bit, a finite value. Each ran,
    # and the rank's own error was recorded as the fault's effect, a crash; the value as an
    # infinity, recorded as a finite value caught.
    (
        [
            "workload.precision=bf16-mixed",
            "fault.site=matmul",
            "fault.model=bitflip",
            "fault.nbits=20",
            "fault.tensor=fc1",
        ],
        "fault.nbits",
        "20 bits do not fit in bfloat16, the dtype of the product 1 of 'fc1'; allowed: 1..16",
    ),  # fmt: skip
    (
        [
            "workload.precision=bf16-mixed",
            "fault.site=matmul",
            "fault.model=bitflip",
            "fault.schedule=[{step:1,rank:1,tensor:fc1,index:0,bit:20}]",
        ],
        "fault.schedule[0].bit",
        "20 is outside bfloat16, the dtype of the product 1 of 'fc1'",
    ),  # fmt: skip
    (
        [
            "workload.precision=bf16-mixed",
            "fault.site=matmul",
            "fault.model=value",
            "fault.value=3.4e38",
            "fault.tensor=fc1",
        ],
        "fault.value",
        "3.4e+38 is stored as inf in bfloat16, the dtype of the product 1 of 'fc1'",
    ),  # fmt: skip
    # A schedule's strikes write the same value in what they name (its check was left to the
    # workload's dtype, which says nothing of a module's products).
    (
        [
            "fault.site=matmul",
            "fault.model=value",
            "fault.value=1e39",
            "fault.schedule=[{step:1,rank:1,tensor:fc1,index:0}]",
        ],
        "fault.value",
        "1e+39 is stored as inf in float32, the dtype of the product 1 of 'fc1'",
    ),  # fmt: skip
    # Values a fault would ignore, and yet be recorded with: a permanent fault's later steps,
    # a persistence or a bit beside a schedule that names its steps and whose model reads no
    # bit, an entry listed twice (the bit flipped back), data to follow without recovery, a
    # keep that is not a boolean (bool('no') kept every checkpoint).
    (
        ["fault=grad_bitflip", "fault.persistence=permanent", "fault.steps=[5,10]"],
        "fault.steps",
        "a permanent fault strikes from its first step on and reads no other",
    ),
    (
        [
            "fault=grad_bitflip",
            "fault.persistence=permanent",
            "fault.bit=null",
            "fault.schedule=[{step:1,rank:1,tensor:fc1.weight,index:5,bit:30}]",
        ],
        "fault.persistence",
        "a schedule names each strike's step; leave it transient",
    ),  # fmt: skip
    (
        ["fault=grad_scale", "fault.schedule=[{step:1,rank:1,tensor:fc1.weight,index:5,bit:3}]"],
        "fault.schedule",
        "model scale changes no chosen bit",
    ),
    (
        [
            "fault=weight_bitflip",
            "fault.bit=null",
            "fault.schedule=[{step:1,rank:1,tensor:fc1.weight,index:5,bit:30},"
            "{step:1,rank:1,tensor:fc1.weight,index:5,bit:30}]",
        ],
        "fault.schedule",
        "two entries strike one element at one step",
    ),  # fmt: skip
    (["fault=grad_scale", "fault.follows=data"], "fault.follows", "without recovery"),
    (["checkpoint.keep=no"], "checkpoint.keep", "'no' is not allowed; allowed: true, false"),
    # More elements than a fault's tensors hold: the draw took fewer (the loss's one for 5),
    # and a burst past the largest tensor was cut, while the record said what was asked.
    (["fault=loss_scale", "fault.elements=5"], "fault.elements", "5 is more than the 1 elements"),
    (
        [
            "fault=grad_scale",
            "fault.model=burst",
            "fault.burst_model=scale",
            "fault.elements=2",
            "fault.stride=100000000",
        ],
        "fault.elements",
        "a burst of 2 at stride 100000000 spans 100000001 elements, past the largest tensor",
    ),  # fmt: skip
    # Site optimizer strikes Adam's moments, which plain SGD never makes (no event, effect none).
    (
        ["workload=custom", "workload.optimizer._target_=torch.optim.SGD", "fault=optimizer_scale"],
        "fault.site",
        "(torch.optim.SGD) keeps none: the fault could never strike",
    ),
    # Consensus over the optimizer's state of an optimizer that keeps none: the same rows and
    # events as without it, campaign.json saying the moments were fingerprinted.
    *(
        (
            [
                "workload=custom",
                "workload.optimizer._target_=torch.optim.SGD",
                "detectors=[weight_consensus]",
                "workload.steps=10",
                *extra,
            ],
            key,
            "true: workload.optimizer (torch.optim.SGD) keeps no state per element of a "
            "parameter, so the weights alone would be fingerprinted",
        )
        for key, extra in (
            (
                "detectors.weight_consensus.optimizer_state",
                ["campaign=single", "detectors.weight_consensus.optimizer_state=true"],
            ),
            (
                "campaign.scenarios[0].checks.weight_consensus.optimizer_state",
                [
                    "campaign.scenarios=[{site:none,checks:{weight_consensus:{optimizer_state:true}}}]"
                ],
            ),
        )
    ),  # fmt: skip
    # A model's sizes (a ZeroDivisionError, a TypeError, or a model of no width trained to the
    # end) and a custom part the harness calls with its arguments (Hydra's own error).
    (["workload=gpt", "workload.heads=0"], "workload.heads", "0 is out of range; allowed: 1.."),
    (["workload.hidden=2.5"], "workload.hidden", "'2.5' is not an integer"),
    (["workload.hidden=0"], "workload.hidden", "0 is out of range"),
    (["workload=custom", "workload.data._partial_=false"], "workload.data._partial_", "true"),
    # A schedule's index counts the rank's own shard: rank 0 holds 3 of head.bias's 10.
    (
        [
            *FSDP,
            "fault=weight_bitflip",
            "fault.schedule=[{step:1,rank:0,tensor:head.bias,index:9}]",
        ],
        "fault.schedule[0].index",
        "9 is out of range: rank 0 holds 3 elements of 'head.bias'",
    ),
    # The rider region holds zeros where no check rides on the reduction.
    (
        ["detectors=[nan_inf]", "fault=allreduce_rank", "fault.tensor=riders"],
        "fault.tensor",
        "riders: no check beside it rides on the reduction",
    ),  # fmt: skip
    # A matmul fault's bits in what it strikes: the product it names (bfloat16 under autocast),
    # a frozen weight's gradient (none ever made).
    (
        [
            "workload.precision=bf16-mixed",
            "fault.site=matmul",
            "fault.model=bitflip",
            "fault.bit=31",
            "fault.tensor=fc1",
        ],
        "fault.bit",
        "31 is outside bfloat16, the dtype of the product 1 of 'fc1'",
    ),
    # A Linear's frozen weight, and one multiplied through a view of it (x @ w.t()): that one
    # was accepted, and never struck (fired False).
    *(
        (
            [
                "workload=custom",
                f"workload.model._target_=tests.fixtures_custom.{net}",
                "fault.site=matmul",
                "fault.model=scale",
                "fault.factor=1000",
                "fault.phase=backward",
                "fault.tensor=body",
            ],
            "fault.phase",
            "backward: product 1 of 'body' multiplies a frozen weight, which no gradient reaches",
        )
        for net in ("FrozenNet", "FrozenViewNet")
    ),
    # A frozen weight gets no gradient, no reduction and no moments: a fault on one there was
    # accepted and never struck (and `*` could draw it).
    *(
        (
            [
                "workload=custom",
                "workload.model._target_=tests.fixtures_custom.FrozenNet",
                f"fault.site={site}",
                "fault.model=scale",
                "fault.factor=1000",
                f"fault.tensor={tensor}",
            ],
            "fault.tensor",
            f"'{tensor}' matches nothing at site {site} (trainable parameters: a frozen one",
        )
        for site, tensor in (("grad", "body.weight"), ("optimizer", "body.weight.exp_avg"))
    ),  # fmt: skip
    (
        ["workload=custom", "workload.model._target_=tests.fixtures_custom.UnusedNet"],
        "workload.model",
        "'tests.fixtures_custom.UnusedNet' leaves spare.weight, spare.bias without a gradient in "
        "a dry step",
    ),
    ([*FSDP, "fault=weight_bitflip", "fault.index=0"], "fault.index", "in the rank's own shard"),
    (["fault=grad_scale", "fault.bucket=1"], "fault.bucket", "reduce in 1 bucket; allowed: 0..0"),
    (
        ["workload=gpt", "fault=grad_scale", "fault.bucket=1", "fault.tensor=head.weight"],
        "fault.tensor",
        "matches nothing in bucket 1",
    ),
    # What a fault in one bucket names is counted in that bucket (gpt's bucket 1: 157,184
    # elements, 1,280 of them biases), not over the model: each fault below never struck.
    (
        ["workload=gpt", "fault.site=grad", "fault.model=bitflip", "fault.bucket=1"]
        + ["fault.schedule=[{step:3,rank:1,tensor:head.weight,index:3,bit:30}]"],
        "fault.schedule[0].tensor",
        "'head.weight' is not in bucket 1; allowed: tok.weight, pos.weight,",
    ),
    (
        ["workload=gpt", "fault=grad_bitflip", "fault.bucket=1", "fault.index=200000"],
        "fault.index",
        "200000 is out of range of the 157184 elements '*' names in bucket 1; allowed: 0..157183",
    ),
    (
        ["workload=gpt", "fault=grad_scale", "fault.bucket=1", "fault.tensor=*.bias"]
        + ["fault.elements=1500"],
        "fault.elements",
        "1500 is more than the 1280 elements '*.bias' names in bucket 1; allowed: 1..1280",
    ),
    # The rider region's index and elements within its slots (8 + 4 * 4 ranks), where the
    # index was ignored and the draw took fewer; with no spare, recovery may shrink the world to
    # one node (8 + 4 slots).
    *(
        (
            ["detectors=[allreduce_sketch]", "fault=allreduce_rank", "fault.tensor=riders", *extra],
            f"fault.{name}",
            message,
        )
        for extra, name, message in (
            (
                ["fault.index=100000"],
                "index",
                "of the 24 elements the rider region holds; allowed: 0..23",
            ),
            (
                ["fault.elements=100000"],
                "elements",
                "100000 is more than the 24 elements the rider region holds; allowed: 1..24",
            ),
            (
                ["fault.index=23", "recovery.enabled=true"],
                "index",
                "23 is out of range of the 12 elements the rider region holds; allowed: 0..11",
            ),
        )
    ),  # fmt: skip
    (["detectors.nan_inf.mode=panic"], "detectors.nan_inf.mode", "allowed: observe, act"),
    # Hydra's grammar error named neither the override nor its key.
    (["fault.steps=[3"], "fault.steps", "cannot parse 'fault.steps=[3' (no viable alternative"),
    (["fault=grad_scale", "fault.model=crash", "fault.value=melt"], "fault.value", "raise, exit"),
    # A broken reduction strikes every receiver: every rank's process went down, each recorded.
    (
        ["fault=allreduce_rank", "fault.model=crash", "fault.value=raise", "fault.scope=reduction"],
        "fault.scope",
        "not the sum every rank receives; allowed: rank",
    ),
    (["fault=allreduce_rank", "fault.scope=everyone"], "fault.scope", "allowed: rank, reduction"),
    (
        ["campaign=single", "fault=allreduce_reduction", "fault.ranks=[1,2]"],
        "fault.ranks",
        "allowed: one rank",
    ),
    (["workload=transformer"], "workload", f"allowed: {', '.join(WORKLOADS)}"),
    # Hydra's multi-line error, exit 1: the launcher group is Hydra's, not the harness's.
    (["hydra/launcher=nosuch"], "hydra/launcher", "allowed: basic, submitit_local"),
    (["workload.dtype=float8"], "workload.dtype", "allowed: float32, bfloat16, float16"),
    (
        ["detectors=[nan_inf,oracle]"],
        "detectors",
        EVERY_CHECK,
    ),
    # A sweep over sets of checks: each set's names, as Hydra's grammar reads them.
    (["-m", "detectors=[nan_inf],[replayy]"], "detectors", "'replayy' is not allowed"),
    # A check is one key once composed: the second entry ran nothing, unsaid.
    (
        ["detectors=[nan_inf,replay,nan_inf]"],
        "detectors",
        "'nan_inf' is listed twice in [nan_inf,replay,nan_inf]; allowed: each check once",
    ),
    (
        ["-m", "detectors=[nan_inf],[replay,replay]"],
        "detectors",
        "'replay' is listed twice in [replay,replay]",
    ),
    (["topology.nodes=0"], "topology.nodes", "1..inf"),
    (["topology.cpu_kernels=avx3"], "topology.cpu_kernels", "avx2, avx512, default, native"),
    (["topology.cpu_numerics=fast"], "topology.cpu_numerics", "allowed: emulated, native"),
    # A float32 workload makes no 16-bit product: either setting ran the same bits, and
    # campaign.json named the one given.
    *(
        (
            ["campaign=single", *extra, f"topology.cpu_numerics={mode}"],
            "topology.cpu_numerics",
            f"'{mode}' sets how 16-bit matrix products are computed, and workload {name} at "
            "precision 32-true makes only float32 ones",
        )
        for mode, name, extra in (
            ("native", "mlp", []),
            ("emulated", "gpt", ["workload=gpt"]),
            ("native", "llama", ["workload=llama", "workload.precision=32-true"]),
        )
    ),  # fmt: skip
    # No check to time: the campaign ran and wrote no overhead.csv, saying nothing.
    (
        ["campaign=single", "detectors=[]", "campaign.overhead={steps:3,rounds:1}"],
        "campaign.overhead",
        "detectors=[] chooses none, so no overhead.csv would be written; choose detectors, or "
        "leave it null",
    ),
    (["recovery.enabled=maybe"], "recovery.enabled", "allowed: true, false"),
    (["recovery.enabled=true", "detectors=[]"], "recovery.enabled", "choose detectors"),
    (["fault.sitee=grad"], "fault.sitee", ""),
    # A key under what holds no keys in this run: what it is, and what is allowed instead.
    (
        ["detectors=[nan_inf]", "detectors.replay.interval=2"],
        "detectors.replay.interval",
        "replay is not among this run's detectors (nan_inf); allowed: add replay to detectors",
    ),
    (
        ["detectors=[]", "detectors.replay.interval=2"],
        "detectors.replay.interval",
        "replay is not among this run's detectors (none); allowed: add replay to detectors",
    ),
    (
        ["detectors.replya.interval=2"],
        "detectors.replya.interval",
        f"replya is no check; {EVERY_CHECK}",
    ),
    (["campaign.overhead.steps=3"], "campaign.overhead.steps", "campaign.overhead is null"),
    (["workload.lr.x=1"], "workload.lr.x", "workload.lr is a value, not a group"),
    (["workload.precision=16-mixed"], "workload.precision", "needs dynamic loss scaling"),
    (["workload.precision=fp8"], "workload.precision", "allowed: 32-true, bf16-true, 16-true"),
    (
        ["workload.precision=bf16-mixed", "workload.dtype=bfloat16"],
        "workload.dtype",
        "contradicts workload.precision=bf16-mixed",
    ),
    (["workload.clip_grad_norm=0"], "workload.clip_grad_norm", "positive number"),
    (["workload.lr_schedule=linear"], "workload.lr_schedule", "allowed: constant, warmup_cosine"),
    (["workload.warmup_steps=3"], "workload.warmup_steps", "needs workload.lr_schedule"),
    (["workload.betas=[0.9,1.5]"], "workload.betas", "two numbers in [0, 1)"),
    # The rate would only climb to the run's end: the cosine and its min_lr_ratio never applied.
    (
        ["workload.lr_schedule=warmup_cosine", "workload.warmup_steps=30"],
        "workload.warmup_steps",
        "leaves the cosine no step of the 30-step run; allowed: 0..29",
    ),
    (["workload=custom", "+workload.weight_decay=0.1"], "workload.weight_decay", "on workload"),
    # A custom optimizer takes its own lr: workload.lr was recorded (plan.json) and never read.
    (
        ["workload=custom", "workload.lr=0.5", "workload.optimizer.lr=0.1"],
        "workload.lr",
        "0.5 is not the rate the custom optimizer takes (workload.optimizer.lr=0.1)",
    ),
    # A mistyped key of a fault model's own names the keys each model declares.
    (
        [
            "fault.site=matmul",
            "fault.model=defective_unit",
            "fault.persistence=permanent",
            "fault.rat=0.1",
        ],
        "fault.rat",
        "a model's own (defective_unit: lane, lanes, rate)",
    ),
]


def refused_in_process(monkeypatch, capsys, out, overrides: list[str]) -> str:
    """The command's own entry point, in-process (no interpreter start, no Hydra app, no world):
    the one line it printed when it exited 2."""
    monkeypatch.setattr(sys, "argv", ["sdc-bench", *overrides, f"out={out}"])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert not out.exists(), "nothing may be created before the config is valid"
    return lines[0]


@pytest.mark.parametrize(("overrides", "key", "allowed"), CASES, ids=[c[1] for c in CASES])
def test_bad_value_exits_2_with_one_line(tmp_path, monkeypatch, capsys, overrides, key, allowed):
    line = refused_in_process(monkeypatch, capsys, tmp_path / "out", overrides)
    assert line.startswith("sdc-bench: error: ") and key in line and allowed in line, line


# Through the installed command: a value check, Hydra's unknown group option and unknown key.
COMMAND = (["fault.site=gpu"], ["workload=transformer"], ["fault.sitee=grad"])
COMMAND_CASES = [c for c in CASES if c[0] in COMMAND]


@pytest.mark.parametrize("case", COMMAND_CASES, ids=lambda c: c[1])
def test_the_command_itself_exits_2_with_one_line_and_no_traceback(tmp_path, case):
    overrides, key, allowed = case
    out = tmp_path / "out"
    proc = sdc_bench(*overrides, f"out={out}", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert key in lines[0] and allowed in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not out.exists(), "nothing may be created before the config is valid"


def test_a_sweep_of_several_jobs_into_one_out_is_refused_before_any_job_runs(tmp_path):
    """Each job wrote into `out`: the first ran, the second was refused as another campaign's,
    and the merged report found no job's trials."""
    out, sweep = tmp_path / "out", tmp_path / "sweep"
    proc = sdc_bench("-m", "fault=grad_scale", "fault.factor=10,1000", f"out={out}",
                     f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "sdc-bench: error: out: a sweep's jobs each write into their own folder under "
        "hydra.sweep.dir; leave out unset (or name one per job: out=DIR/${hydra:job.num})"
    )
    assert not out.exists() and not sweep.exists()


def preflight_refusal(argv: list[str], capsys) -> str:
    """The one line the command's check of a sweep exits 2 with, before Hydra starts."""
    with pytest.raises(SystemExit) as exited:
        cli.preflight(cli.implied_campaign(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err.strip()


def test_a_swept_out_beside_another_swept_key_is_refused_where_jobs_share_a_folder(
    tmp_path, monkeypatch, capsys
):
    """Two outs for four jobs: jobs 0 and 1 ran into them, then job 2 was refused as another
    campaign's, after half the sweep had run. Refused before any job, naming both."""
    monkeypatch.chdir(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    argv = ["-m", "fault=grad_scale", "fault.factor=10,1000", f"out={a},{b}"]
    assert preflight_refusal(argv, capsys) == (
        f"sdc-bench: error: out: sweep jobs 0 (fault.factor=10 out={a}) and 2 "
        f"(fault.factor=1000 out={a}) both write into {a}; allowed: one out per job"
    )
    assert not a.exists() and not b.exists()


def test_a_sweep_with_a_bad_job_is_refused_before_any_job_runs(tmp_path):
    """Job 1 asks for bit 40 of a float32: job 0 trained to the end before it was refused."""
    sweep = tmp_path / "sweep"
    proc = sdc_bench("-m", "fault=grad_bitflip", "fault.bit=3,40", f"hydra.sweep.dir={sweep}",
                     cwd=tmp_path, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "sdc-bench: error: fault.bit: 40 is out of range; allowed: 0..31 (sweep job 1: "
        "fault.bit=40)"
    )
    assert not sweep.exists()


def test_a_sweep_into_a_folder_holding_a_job_it_does_not_launch_is_refused(
    tmp_path, monkeypatch, capsys
):
    """A sweep of fewer jobs than the one before it in the same folder left the earlier
    sweep's last jobs there, which its merged report, sweep.md and sdc-report counted as its
    own. Refused before Hydra writes anything; a job folder it does launch is checked as ever."""
    sweep = tmp_path / "sweep"
    (sweep / "1" / ".hydra").mkdir(parents=True)
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text("- fault.factor=1000\n")
    monkeypatch.chdir(tmp_path)
    argv = ["-m", "fault=grad_scale", "fault.factor=10", f"hydra.sweep.dir={sweep}"]
    assert preflight_refusal(argv, capsys) == (
        f"sdc-bench: error: hydra.sweep.dir: {sweep} holds job 1 (fault.factor=1000), which this "
        "sweep of 1 job does not launch: its reports would count that job's trials; choose a new "
        "hydra.sweep.dir"
    )
    argv[2] = "fault.factor=10,1000"  # job 1 is launched again: its own folder's check decides
    assert cli.preflight(cli.implied_campaign(argv)) is None


def test_a_shuffled_sweep_is_checked_job_by_job_not_in_an_order_of_its_own():
    """A shuffled sweep's order is drawn when the sweeper splits it: a split of its own named
    the wrong job's number, and checked job N's folder against another job's config."""
    assert planned_jobs(["fault.factor=shuffle(10,1000)", "fault.bit=1"]) is None
    assert planned_jobs(["fault.factor=10,1000"]) == [["fault.factor=10"], ["fault.factor=1000"]]


def test_an_out_that_is_a_sweeps_folder_is_refused(tmp_path, monkeypatch, capsys):
    """A campaign there overwrote the sweep's merged report and left its trials.csv among the
    jobs', which the sweep's reports then counted."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    monkeypatch.setattr(sys, "argv", ["sdc-bench", f"out={sweep}"])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith(f"sdc-bench: error: out: {sweep} is a sweep's folder")
    assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml"]


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "detectors=[nan_inf,replay]", "out=one"],  # a list, not a sweep: one job
        ["-m", "fault=grad_scale", "fault.factor=10,1000", "out=runs/${hydra:job.num}"],
        ["-m", "fault=grad_scale", "out=a,b"],  # out alone swept: one job each
        ["-m", "fault=grad_scale", "fault.factor=10,1000"],
    ],
)
def test_a_sweep_whose_jobs_write_apart_is_accepted(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.preflight(cli.implied_campaign(argv)) is None


@pytest.mark.parametrize(
    "sweep",
    [
        "detectors=[nan_inf,replay],[weight_consensus,allreduce_sketch]",
        "detectors=choice([nan_inf],[replay])",
    ],
)
def test_a_sweep_over_sets_of_checks_is_accepted(sweep, tmp_path, monkeypatch):
    """Hydra reads both as a sweep over two lists; the names were split at every comma, and
    'replay]' was refused."""
    monkeypatch.chdir(tmp_path)
    argv = cli.implied_campaign(["-m", "campaign=smoke", sweep])
    cli.check_group_choices(argv)
    assert cli.preflight(argv) is None


def test_a_sweep_whose_jobs_run_one_campaign_is_refused_before_any_job_runs(
    tmp_path, monkeypatch, capsys
):
    """Both jobs ran, then the merged report refused their rows as one campaign's: exit 1."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        cli.preflight(cli.implied_campaign(["-m", "fault=grad_bitflip", "fault.bit=3,3"]))
    assert exited.value.code == 2
    job = "fault=grad_bitflip fault.bit=3 campaign=single"
    assert capsys.readouterr().err == (
        f"sdc-bench: error: sweep: jobs 0 ({job}) and 1 ({job}) run the same campaign: the "
        "merged report would count its rows twice; allowed: values that change the campaign\n"
    )
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "results").exists()


def test_an_empty_out_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """`out=$OUT` with OUT unset: the campaign wrote campaign.json, trials.csv, the report and
    .hydra/ into the working folder, and exited 0."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["sdc-bench", "fault=grad_nan", "out="])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 2 and list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err.startswith("sdc-bench: error: out: empty, which would write")


def test_an_out_that_cannot_be_created_is_refused_before_anything_runs(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("the user's data\n")
    proc = sdc_bench(f"out={blocker / 'run'}", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"sdc-bench: error: out: {blocker} is not a folder; choose an out that can be created"
    )
    assert blocker.read_text() == "the user's data\n"


def test_an_out_where_nothing_can_be_made_is_refused_whoever_runs_it(monkeypatch, capsys):
    """/proc's permission bits let root (CI, a container) write: its mkdir failed after the
    config was accepted, a traceback and exit 1."""
    line = refused_in_process(monkeypatch, capsys, Path("/proc/sdc-bench-run"), [])
    assert line == "sdc-bench: error: out: /proc is not writable; choose another out"


# Each ran silently before: a fault.* value that `fault.site=none` (the default) ignored, or that
# no site checked.
IGNORED_OR_MISTYPED = [
    (["campaign=single", "fault.model=flip"], "fault.model", "'flip' is not allowed; allowed:"),
    (["campaign=single", "fault.ranks=[4]"], "fault.ranks", "0..3"),
    (["campaign=single", "fault.steps=[-1]"], "fault.steps", "0..29"),
    (["campaign=single", "fault.model=scale", "fault.factor=nan"], "fault.factor", "finite"),
    (["campaign=single", "fault.model=bitflip"], "fault.site", "ignores fault.model=bitflip"),
    (["fault=grad_nan", "fault.site=none"], "fault.site", "ignores fault.model=value"),
    (["fault.stuck_at=2"], "fault.stuck_at", "allowed: 0, 1"),
    (["fault.persistence=forever"], "fault.persistence", "allowed: transient"),
    (["fault.bit=sideways"], "fault.bit", "allowed: sign, exponent_msb"),
    (["fault.site=grad"], "fault.model", "site 'grad' needs a model; allowed: bitflip"),
    (
        ["fault.site=matmul", "fault.model=scale", "fault.phase=sideways"],
        "fault.phase",
        "allowed: forward, backward",
    ),
    (["campaign=single", "fault.stride=4"], "fault.site", "ignores fault.stride=4"),
    (["fault=grad_scale", "fault.product=2"], "fault.product", "only site matmul picks"),
    # gpt's block makes 6 products: qkv, attention's scores and values, proj, fc, out.
    (
        ["workload=gpt", "fault.site=matmul", "fault.model=scale", "fault.factor=8"]
        + ["fault.tensor=blocks.?", "fault.product=7"],
        "fault.product",
        "7 is never reached: 'blocks.0' makes 6 products per forward; allowed: 1..6",
    ),
    # A container's own forward never runs: a fault there could never strike.
    (
        [
            "workload=gpt",
            "fault.site=matmul",
            "fault.model=scale",
            "fault.factor=2",
            "fault.tensor=blocks",
        ],
        "fault.tensor",
        "'blocks' matches nothing at site matmul (modules in whose forward a matrix multiply "
        "runs); allowed: blocks.0, blocks.0.qkv,",
    ),
    (
        [
            "workload=gpt",
            "fault.site=activation",
            "fault.model=scale",
            "fault.factor=2",
            "fault.tensor=blocks",
        ],
        "fault.tensor",
        "(modules whose forward runs and returns a floating-point tensor); allowed: tok, pos, "
        "blocks.0, blocks.0.ln1,",
    ),
    # A Llama's attention returns a tuple: nothing there for a fault to corrupt (its rank raised).
    (
        [
            "workload=llama",
            "fault.site=activation",
            "fault.model=scale",
            "fault.factor=2",
            "fault.tensor=model.layers.0.self_attn",
        ],
        "fault.tensor",
        "'model.layers.0.self_attn' matches nothing at site activation",
    ),  # fmt: skip
    (
        ["detectors=[matmul_checksum]", "detectors.matmul_checksum.fraction=0"],
        "detectors.matmul_checksum.fraction",
        "must be a number > 0",
    ),
    (
        ["detectors=[matmul_checksum]", "detectors.matmul_checksum.fraction=1.5"],
        "detectors.matmul_checksum.fraction",
        "must be in (0, 1) or 1 (every product)",
    ),
    (["campaign=default", "fault=grad_nan"], "campaign", "use campaign=single"),
    # A schedule that is no list raised TypeError; 0 or false ran as no schedule.
    *(
        (
            ["campaign=single", "fault=weight_bitflip", f"fault.schedule={bad}"],
            "fault.schedule",
            f"'{shown}' is not a list of {{step, rank, tensor, index[, bit]}}",
        )
        for bad, shown in (("5", "5"), ("true", "True"), ("0", "0"))
    ),  # fmt: skip
    # A crash takes its process down at the first element: what it would strike was ignored.
    *(
        (
            [
                "campaign=single",
                "fault=grad_scale",
                "fault.model=crash",
                "fault.value=raise",
                "fault.factor=null",
                extra,
            ],
            f"fault.{name}",
            "a crash takes its rank's process down at the first element it reaches; leave it",
        )
        for extra, name in (
            ("fault.elements=5", "elements"),
            ("fault.select=largest", "select"),
            ("fault.index=3", "index"),
        )
    ),  # fmt: skip
    # The trial ends at a crash: a later step, or a permanent fault's next strike, never came.
    *(
        (
            ["campaign=single", "fault=grad_scale", "fault.model=crash", "fault.value=raise"]
            + ["fault.factor=null", extra],
            f"fault.{name}",
            message,
        )
        for extra, name, message in (
            (
                "fault.steps=[3,5]",
                "steps",
                "a crash ends the trial at its first step (3), so step "
                "5 could never strike; allowed: one step",
            ),
            (
                "fault.persistence=permanent",
                "persistence",
                "a crash ends the trial at its first strike",
            ),
        )
    ),  # fmt: skip
    # A burst from fault.index past the end of the tensor holding it was moved back to fit:
    # head.bias's index 6 struck 0, 3, 6, 9.
    (
        ["campaign=single", "fault=grad_scale", "fault.model=burst", "fault.burst_model=scale"]
        + ["fault.elements=4", "fault.stride=3", "fault.tensor=head.bias", "fault.index=6"],
        "fault.index",
        "6: a burst of 4 at stride 3 spans 10 elements, and from element 6 of 'head.bias' (10 "
        "elements) it runs past the end, so it would be moved back to start at 0; allowed: 0..0",
    ),
    # Counted over the named tensors: 2558 is in head.weight, whose end the burst crossed.
    (
        ["campaign=single", "fault=grad_scale", "fault.model=burst", "fault.burst_model=scale"]
        + ["fault.elements=4", "fault.tensor=head.*", "fault.index=2558"],
        "fault.index",
        "from element 2558 of 'head.weight' (2560 elements) it runs past the end, so it would "
        "be moved back to start at 2556; allowed: 0..2556",
    ),
    (
        ["campaign=single", "fault=grad_scale", "fault.site=activation", "fault.model=burst"]
        + ["fault.burst_model=scale", "fault.elements=4", "fault.tensor=head", "fault.index=318"],
        "fault.index",
        "from element 318 of the output struck in 'head' (320 elements) it runs past the end, so "
        "it would be moved back to start at 316; allowed: 0..316",
    ),
    # Largest among as many elements as are named takes them all, as random does: the same
    # strike (the loss's one element), told apart only by its trial id.
    (
        ["campaign=single", "fault=loss_scale", "fault.select=largest"],
        "fault.select",
        "largest: fault.elements=1 takes every element '*' names at site loss, as a random draw "
        "does; allowed: random",
    ),
    (
        ["campaign=single", "fault=grad_scale", "fault.select=largest"]
        + ["fault.tensor=head.bias", "fault.elements=10"],
        "fault.select",
        "'head.bias' names at site grad, as a random draw does; allowed: random, or "
        "fault.elements below 10",
    ),
    # A swap's or burst's index at a module site was clamped to the output's end.
    (
        [
            "campaign=single",
            "fault.site=activation",
            "fault.model=swap",
            "fault.tensor=fc2",
            "fault.index=999999",
        ],
        "fault.index",
        "999999 is out of range: the output struck in 'fc2' has",
    ),  # fmt: skip
]


@pytest.mark.parametrize(
    ("overrides", "key", "message"),
    IGNORED_OR_MISTYPED,
    ids=[" ".join(c[0]) for c in IGNORED_OR_MISTYPED],
)
def test_a_fault_value_ignored_or_mistyped_exits_2_with_one_line(
    tmp_path, monkeypatch, capsys, overrides, key, message
):
    line = refused_in_process(monkeypatch, capsys, tmp_path / "out", overrides)
    assert line.startswith(f"sdc-bench: error: {key}") and message in line, line


def test_a_clean_scenario_in_a_campaign_and_the_default_fault_are_accepted():
    run = compose_run("campaign=default")
    assert run.scenarios[0].clean and len(run.scenarios) == 8
    assert compose_run("campaign=single").scenarios[0].clean


def test_a_checks_mode_left_unset_observes_and_acts_under_recovery():
    assert compose_run("campaign=single").detectors["nan_inf"].mode == "observe"
    recovering = ["campaign=single", "recovery.enabled=true", "topology.spares=1"]
    assert compose_run(*recovering).detectors["nan_inf"].mode == "act"
    given = compose_run(*recovering, "detectors.nan_inf.mode=act")
    assert given.detectors["nan_inf"].mode == "act"


def test_optimizer_state_is_accepted_where_the_optimizer_keeps_some():
    momentum = ["workload.optimizer._target_=torch.optim.SGD", "+workload.optimizer.momentum=0.9"]
    for extra in ([], momentum):
        run = compose_run(
            "campaign=single", "workload=custom", *extra, "detectors=[weight_consensus]",
            "workload.steps=10", "detectors.weight_consensus.optimizer_state=true",
        )  # fmt: skip
        assert run.detectors["weight_consensus"].optimizer_state


def test_cpu_numerics_is_accepted_where_a_product_may_be_16_bit():
    """A 16-bit precision makes 16-bit products; a custom model may cast inside its forward."""
    for extra in (["workload.dtype=bfloat16"], ["workload=llama"], ["workload=gpt2"]):
        run = compose_run("campaign=single", *extra, "topology.cpu_numerics=native")
        assert run.topology.cpu_numerics == "native"


def test_a_matmul_faults_bits_are_those_of_the_value_it_strikes():
    """Under bf16-mixed a Linear's product is bfloat16 but its weight's gradient, which a
    backward fault corrupts, is float32 as the weight is; mixtral's attention scores (its
    attention's 4th product) are float32 beside bfloat16 projections. Each takes the bits of
    its own dtype: they were checked against every dtype of the module's products."""
    backward = compose_run("campaign=single", "workload.precision=bf16-mixed",
                           "fault.site=matmul", "fault.model=bitflip", "fault.bit=31",
                           "fault.tensor=fc1", "fault.phase=backward")  # fmt: skip
    assert backward.scenarios[0].bit == 31
    scores = compose_run("campaign=single", "workload=mixtral", "workload.precision=bf16-mixed",
                         "fault.site=matmul", "fault.model=bitflip", "fault.bit=20",
                         "fault.tensor=model.layers.0.self_attn", "fault.product=4")  # fmt: skip
    assert scores.scenarios[0].bit == 20


def test_the_loss_and_the_moments_are_checked_in_their_own_dtypes():
    """The loss is float32 from a 16-bit model's scores, and the moments take the weights'
    dtype (a user's optimizer its own): bits 16-31 of a bfloat16 run's loss were refused, and a
    value or factor no dtype there holds ran (an overflowed value as a crash row, 1e-50 stored
    as 0 under a row that said 1e-50, x1.001 on bfloat16 moments never striking)."""
    one = ("campaign=single", "workload.steps=4", "fault.ranks=[1]", "fault.steps=[2]")
    loss_bit = compose_run(*one, "workload.dtype=bfloat16", "fault.site=loss",
                           "fault.model=bitflip", "fault.bit=30")  # fmt: skip
    assert loss_bit.scenarios[0].bit == 30 and loss_bit.forward.loss == ("float32",)
    refused = [
        (("fault.site=loss", "fault.model=value", "fault.value=1e39"),
         "fault.value: 1e+39 is stored as inf in float32, the dtype of the loss"),
        (("fault.site=optimizer", "fault.model=value", "fault.value=1e-50"),
         "fault.value: 1e-50 is stored as 0 in float32"),
        (("workload.dtype=bfloat16", "fault.site=optimizer", "fault.model=scale",
          "fault.factor=1.001"), "fault.factor: 1.001 rounds back to every element in bfloat16"),
        (("workload=custom", "fault.site=optimizer", "fault.model=value", "fault.value=1e39"),
         "1e+39 is stored as inf in float32, the dtype of the optimizer's moments"),
        (("workload=custom", "fault.site=optimizer", "fault.model=bitflip", "fault.bit=40"),
         "40 is outside float32, the dtype of the optimizer's moments; allowed: 0..31"),
        # A schedule's bits too (bit 40 of the loss ran, and crashed its rank).
        (("fault.site=loss", "fault.model=bitflip",
          "fault.schedule=[{step:2,rank:1,tensor:loss,index:0,bit:40}]"),
         "fault.schedule[0].bit: 40 is outside float32, the dtype of the loss"),
        (("workload=custom", "fault.site=optimizer", "fault.model=bitflip",
          "fault.schedule=[{step:2,rank:1,tensor:conv1.weight.exp_avg,index:0,bit:40}]"),
         "fault.schedule[0].bit: 40 is outside float32, the dtype of the optimizer's moments"),
    ]  # fmt: skip
    for overrides, says in refused:
        with pytest.raises(ConfigError) as caught:
            compose_run(*one, *overrides)
        assert says in str(caught.value), (overrides, str(caught.value))


def test_a_module_fault_under_a_16_bit_dtype_takes_the_values_of_a_float32_product():
    """Under bf16-true (16-true) the workload is 16-bit but attention's score and value products
    are float32: a bit, bits, a factor and a value that float32 holds strike them, and were
    refused against the workload's dtype before the products' own were read. The same values
    stay refused at a 16-bit product."""
    scores = ("campaign=single", "workload=gpt", "fault.site=matmul", "fault.tensor=blocks.0",
              "fault.product=3")  # fmt: skip
    accepted = [
        ("workload.precision=bf16-true", "fault.model=bitflip", "fault.bit=20"),
        ("workload.precision=bf16-true", "fault.model=bitflip", "fault.bit=20",
         "fault.phase=backward"),
        ("workload.precision=bf16-true", "fault.model=bitflip", "fault.bit=sign",
         "fault.nbits=20"),
        ("workload.precision=bf16-true", "fault.model=scale", "fault.factor=1.001"),
        ("workload.precision=16-true", "fault.model=value", "fault.value=100000"),
    ]  # fmt: skip
    for overrides in accepted:
        assert compose_run(*scores, *overrides).scenarios[0].site == "matmul", overrides
    scheduled = compose_run(
        *scores[:3],
        "fault.product=3",
        "workload.precision=bf16-true",
        "fault.model=bitflip",
        "fault.schedule=[{step:1,rank:1,tensor:blocks.0,index:0,bit:20}]",
    )
    assert scheduled.scenarios[0].schedule[0]["bit"] == 20
    with pytest.raises(ConfigError, match="20 is outside bfloat16, the dtype of the product 1"):
        compose_run(*scores, "fault.product=1", "workload.precision=bf16-true",
                    "fault.model=bitflip", "fault.bit=20")  # fmt: skip


def test_a_sharded_runs_rider_fault_is_accepted_where_a_check_rides():
    """A rider region rides on FSDP's reduction as on DDP's; its fault named no parameter,
    and the shard check looked one up by the name `riders` (KeyError)."""
    run = compose_run("campaign=single", "topology.parallel=fsdp", "detectors=[allreduce_sketch]",
                      "fault=allreduce_rank", "fault.tensor=riders")  # fmt: skip
    assert run.scenarios[0].tensor == "riders"


def test_a_rider_fault_takes_a_bucket_and_an_index_within_the_region():
    """Every chunk's reduction carries the rider region where a check rides: `riders` in
    bucket 0 was refused as matching nothing there."""
    run = compose_run("campaign=single", "detectors=[allreduce_sketch]", "fault=allreduce_rank",
                      "fault.tensor=riders", "fault.bucket=0", "fault.index=23")  # fmt: skip
    assert (run.scenarios[0].bucket, run.scenarios[0].index) == (0, 23)
