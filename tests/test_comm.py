"""The harness's comm hook on real 2-rank gloo worlds: each fixed chunk is reduced during
backward, as soon as its gradients are ready, and the result is the same, bit for bit, as
reducing every chunk at the end of backward."""

from __future__ import annotations

from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.core.bus import PluginBus
from harness.core.plugins import Bucket, Plugin
from harness.launch.world import shutdown
from harness.runtime.comm import HookState, comm_hook, harness_ddp
from harness.runtime.workloads import Workload
from tests.conftest import compose_run, forked_ranks

WORLD = 2
MICRO_BATCHES = 2


class Calls(Plugin):
    """The order of the hook's plug-in calls, and of the embedding's gradient (the last one
    backward makes) in it."""

    def __init__(self, seen: list):
        self.seen = seen

    def on_local_grad(self, step: int, bucket: Bucket) -> None:
        self.seen.append(("local", step, bucket.index, bucket.is_last))

    def on_contribution(self, step: int, index: int, parts: list[torch.Tensor]) -> None:
        self.seen.append(("contribution", step, index))

    def on_reduced_grad(self, step: int, bucket: Bucket) -> None:
        self.seen.append(("reduced", step, bucket.index))


class TwoDtypes(nn.Module):
    """A float32 layer and a bfloat16 one: a chunk each, and a DDP bucket each."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).bfloat16()).float()


def _wrapped(model: nn.Module, state: HookState, early: bool) -> DDP:
    if early:
        return harness_ddp(model, state)
    # The same single bucket per dtype and layout, every chunk launched once DDP's is ready.
    ddp = DDP(model, bucket_cap_mb=1 << 30)
    ddp.register_comm_hook(state, comm_hook)
    return ddp


def _train(early: bool) -> tuple[list, dict[str, torch.Tensor], int]:
    """Two steps of `gpt` with accumulation over two micro-batches, the first under no_sync:
    the plug-in calls and the embedding's gradient in order, the final gradients, the chunks."""
    workload = Workload(compose_run("workload=gpt", "workload.micro_batch_size=2").workload)
    model = workload.build_model()
    seen: list = []
    state = HookState(PluginBus([Calls(seen)]), model, WORLD)
    ddp = _wrapped(model, state, early)
    model.tok.weight.register_post_accumulate_grad_hook(lambda _: seen.append(("embedding",)))
    for step in range(2):
        state.step = step
        model.zero_grad(set_to_none=True)
        for micro in range(MICRO_BATCHES):
            with nullcontext() if micro == MICRO_BATCHES - 1 else ddp.no_sync():
                batch = workload.batch(step, dist.get_rank(), micro)
                (workload.loss(ddp, batch) / MICRO_BATCHES).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return seen, grads, len(state.layout)


def _two_dtypes(early: bool) -> tuple[list, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TwoDtypes()
    seen: list = []
    state = HookState(PluginBus([Calls(seen)]), model, WORLD)
    ddp = _wrapped(model, state, early)
    for step in range(2):
        state.step = step
        model.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        ddp(x).square().sum().backward()
    return seen, {name: p.grad.clone() for name, p in model.named_parameters()}


def _rank(rank: int, store: str, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    torch.set_num_threads(1)
    early, grads, chunks = _train(early=True)
    late, reference, _ = _train(early=False)
    same = all(torch.equal(grads[name], reference[name]) for name in reference)
    mixed, mixed_grads = _two_dtypes(early=True)
    _, mixed_reference = _two_dtypes(early=False)
    same = same and all(torch.equal(mixed_grads[n], mixed_reference[n]) for n in mixed_reference)
    digest = {n: g.sum().item() for n, g in (grads | mixed_grads).items()}
    results.put((rank, early, late, same, chunks, digest, mixed))
    shutdown()


def test_each_chunk_is_reduced_during_backward_bit_identical_to_reducing_at_its_end(tmp_path):
    ctx = forked_ranks(tmp_path)
    results = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_rank, args=(r, store, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = sorted((results.get(timeout=300) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=30)
    for _, early, late, same, chunks, _, mixed in got:
        assert chunks == 2, "gpt's gradients span two chunks"
        assert same, "launched during backward, the gradients are those of the end-of-backward run"
        # The plug-ins see the same calls, in the same order, on the sync micro-batch only.
        assert [c for c in early if c[0] != "embedding"] == [c for c in late if c[0] != "embedding"]
        for step in range(2):
            calls = [c for c in early if c[0] != "embedding" and c[1] == step]
            order = ["local", "contribution"] * chunks + ["reduced"] * chunks
            assert [c[0] for c in calls] == order
            assert [c[3] for c in calls if c[0] == "local"] == [False, True]
        # The first chunk's allreduce starts before backward has made the embedding's
        # gradient (the last); at the end of backward, not before, without the early launch.
        sync = [i for i, c in enumerate(early) if c[0] == "embedding"][1::MICRO_BATCHES]
        first = [i for i, c in enumerate(early) if c[:1] == ("contribution",) and c[2] == 0]
        assert all(f < s for f, s in zip(first, sync, strict=True)), early
        sync = [i for i, c in enumerate(late) if c[0] == "embedding"][1::MICRO_BATCHES]
        first = [i for i, c in enumerate(late) if c[:1] == ("contribution",) and c[2] == 0]
        assert all(f > s for f, s in zip(first, sync, strict=True)), late
        # Two dtypes: each chunk once per step, in layout order, whichever DDP bucket is last.
        assert [c[:3] for c in mixed if c[0] == "reduced"] == [
            ("reduced", step, index) for step in range(2) for index in range(2)
        ]
        assert [c[3] for c in mixed if c[0] == "local"] == [False, True] * 2
    assert got[0][5] == got[1][5], "the replicas' gradients agree"
