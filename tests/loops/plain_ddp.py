"""A plain, hand-written DDP training loop (not the harness trainer), run under torchrun.

    torchrun --standalone --nproc-per-node=4 tests/loops/plain_ddp.py OUT [--guard]
        [--mode act] [--inject JSON] [--fp16-hook]

Writes OUT/rank<r>.json: the SHA-256 of the final weights, and the alarm if one was raised.
"""

import argparse
import gc
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.guard import Guard, SDCAlarm


class SmallConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16 * 7 * 7, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--guard", action="store_true")
    parser.add_argument("--mode", default="observe")
    parser.add_argument("--inject", type=json.loads, default=None)
    parser.add_argument("--fp16-hook", action="store_true")
    args = parser.parse_args()

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = SmallConvNet()
    ddp = DDP(model)
    user_hook = (None, default_hooks.fp16_compress_hook) if args.fp16_hook else None
    if args.guard:
        checks = ["nan_inf", "weight_consensus", "allreduce_sketch", "grad_stats"]
        guard = Guard(ddp, detectors=checks, mode=args.mode, inject=args.inject,
                      comm_hook=user_hook)  # fmt: skip
    elif user_hook:
        ddp.register_comm_hook(*user_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    alarm = None
    try:
        for step in range(12):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x, y = (
                torch.randn(16, 1, 28, 28, generator=gen),
                torch.randint(10, (16,), generator=gen),
            )
            loss = F.cross_entropy(ddp(x), y)
            if args.guard:
                loss = guard.loss(loss)
            optimizer.zero_grad()
            loss.backward()
            if args.guard:
                guard.before_step()
            optimizer.step()
            if args.guard:
                guard.after_step(optimizer)
                if step % 4 == 3:
                    guard.before_checkpoint()
    except SDCAlarm as exc:
        alarm = {"detector": exc.detector, "step": exc.step, "suspect_ranks": exc.suspect_ranks,
                 "suspect_nodes": exc.suspect_nodes, "machines": exc.suspect_machines}  # fmt: skip
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    result = {"digest": digest.hexdigest(), "alarm": alarm}
    if args.guard:
        result["alerts"] = [{k: getattr(a, k) for k in ("step", "detector", "suspect_ranks")}
                            for a in guard.alerts]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    del ddp
    gc.collect()  # DDP's threads must not outlive the process group
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
