"""The `workload=custom` example's model and data, as a user would write their own: a small
convolutional net on synthetic 28x28 "digits" (experiments/workload/custom.yaml's default), the
Markov tokens gpt2.yaml trains on, and the wide MLP the verdict tests use. They live in the
installed package, not in the root examples/ (runnable scripts: the guarded loop), because a
Hydra `_target_` must import from any folder a campaign runs in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SmallConvNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.head = nn.Linear(16 * 7 * 7, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def synthetic_digits(
    seed: int, step: int, rank: int, micro: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch that is a pure function of its arguments: class-dependent blobs plus noise."""
    gen = torch.Generator().manual_seed(hash((seed, step, rank, micro)) & 0x7FFFFFFF)
    labels = torch.randint(10, (size,), generator=gen)
    grid = torch.linspace(-1, 1, 28)
    yy, xx = torch.meshgrid(grid, grid, indexing="ij")
    centers = torch.stack([torch.cos(labels * 0.63), torch.sin(labels * 0.63)], dim=1) * 0.5
    blobs = torch.exp(
        -((xx - centers[:, 0, None, None]) ** 2 + (yy - centers[:, 1, None, None]) ** 2) * 8
    )
    images = blobs + 0.3 * torch.randn(size, 28, 28, generator=gen)
    return images.unsqueeze(1), labels


class WideMLP(nn.Module):
    """The same task as `SmallConvNet` through wide linear layers: about 57 MB of float32
    parameters, so its gradients span several reduction chunks (harness/runtime/comm.py), as a real
    model's do."""

    def __init__(self, width: int = 2048, depth: int = 4, classes: int = 10):
        super().__init__()
        sizes = [28 * 28] + [width] * depth
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.hidden:
            x = F.relu(layer(x))
        return self.head(x)


def markov_tokens(
    seed: int, step: int, rank: int, micro: int, size: int, vocab: int = 512, context: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token data for a language model given as `workload=custom` (a Hugging Face causal LM
    takes the inputs as `input_ids`): sequences from a sparse random Markov chain fixed by
    `seed`, so the loss falls visibly, drawn as a pure function of the arguments."""
    chain = torch.Generator().manual_seed(seed)
    transitions = torch.softmax(torch.randn(vocab, vocab, generator=chain) * 3.0, dim=1)
    gen = torch.Generator().manual_seed(hash((seed, step, rank, micro)) & 0x7FFFFFFF)
    tokens = torch.empty(size, context + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (size,), generator=gen)
    for t in range(context):
        tokens[:, t + 1] = torch.multinomial(transitions[tokens[:, t]], 1, generator=gen).squeeze(1)
    return tokens[:, :-1], tokens[:, 1:]
