"""Targets for the bring-your-own-model tests that must not ship in the package."""

from __future__ import annotations

import os

import torch

from harness.examples import SmallConvNet


def unseeded_digits(seed: int, step: int, rank: int, micro: int, size: int):
    """Ignores its arguments: a data function replay and golden runs cannot use."""
    return torch.randn(size, 1, 28, 28), torch.randint(10, (size,))


class RaisingNet(torch.nn.Module):
    """A model whose forward always raises, as a user's model with a shape bug does."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(28 * 28, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)  # (n, 1, 28, 28) against 784 inputs: a shape error


class BreaksWhileTraining(torch.nn.Module):
    """Raises in its third forward, as a user's model whose bug shows after its first steps:
    its config passes every check (the dry step runs one forward), and the job fails as it
    trains."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(28 * 28, 10)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if self.forwards > 2:
            raise RuntimeError("a bug that shows at the third forward")
        return self.head(x.flatten(1))


class FrozenNet(torch.nn.Module):
    """A fine-tuning model's stand-in: its first layer frozen (requires_grad False)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(28 * 28, 64).requires_grad_(False)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x.flatten(1))))


class FrozenView(torch.nn.Module):
    """A frozen weight multiplied through a view of it, as a hand-written layer does."""

    def __init__(self):
        super().__init__()
        weight = torch.randn(64, 28 * 28, generator=torch.Generator().manual_seed(0)) / 28
        self.w = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.t()


class FrozenViewNet(FrozenNet):
    """FrozenNet with its frozen layer a FrozenView."""

    def __init__(self):
        super().__init__()
        self.body = FrozenView()


class UnusedNet(FrozenNet):
    """A layer its forward never uses, trainable: DDP without find_unused_parameters fails at
    the step after the first, FSDP2's reduce-scatter leaves it out of its layout."""

    def __init__(self):
        super().__init__()
        self.spare = torch.nn.Linear(64, 10)


class IrreproducibleNet(torch.nn.Module):
    """Dropout drawn from a generator of its own seeded by the OS: no seeding of torch's
    generators makes two computations of a micro-batch agree (a non-deterministic op's
    stand-in)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(28 * 28, 64)
        self.head = torch.nn.Linear(64, 10)
        self.noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(x.flatten(1)))
        keep = torch.rand(h.shape, generator=self.noise) > 0.1
        return self.head(h * keep / 0.9)


class CountedConvNet(SmallConvNet):
    """The example's net, counting its constructions in this process, and across processes in
    the file $SDC_COUNT_BUILDS names (one line with the building process's id each)."""

    built = 0

    def __init__(self):
        super().__init__()
        CountedConvNet.built += 1
        if os.environ.get("SDC_COUNT_BUILDS"):
            with open(os.environ["SDC_COUNT_BUILDS"], "a") as f:
                f.write(f"{os.getpid()}\n")
