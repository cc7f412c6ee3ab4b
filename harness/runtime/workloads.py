"""Training workloads whose every micro-batch is a pure function of (seed, step, rank, micro-batch).

Any rank can regenerate any other rank's micro-batch bit for bit, which is what replay audits
need, and two runs with the same seed see exactly the same data. So can its random draws: each
micro-batch's forward and backward run under torch's generators seeded from the same key
(`forward_rng`), so dropout (or anything else drawing from torch's generators in forward) masks
the same elements wherever that micro-batch is computed (docs/design.md, section 9).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness import losses
from harness.config.schema import WorkloadConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Distinct stream tags keep the data, teacher, evaluation and forward generators independent.
_STREAM_TRAIN, _STREAM_TEACHER, _STREAM_EVAL, _STREAM_FORWARD = 1, 2, 3, 4


def stream_seed(*key: int) -> int:
    """A 63-bit seed from an integer tuple, stable across processes and runs."""
    seed = 0x9E3779B97F4A7C15
    for part in key:
        seed = (seed * 0x100000001B3 ^ (part & 0xFFFFFFFFFFFFFFFF)) % (1 << 63)
    return seed


def generator(*key: int) -> torch.Generator:
    """A CPU generator seeded from an integer tuple, stable across processes and runs."""
    return torch.Generator().manual_seed(stream_seed(*key))


@contextmanager
def forked_rng(device: torch.device) -> Iterator[None]:
    """torch's generators of the CPU and of `device` (if a GPU), restored on exit: what runs
    inside draws without moving the caller's stream."""
    gpus = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus, device_type="cuda"):
        yield


@contextmanager
def seeded_rng(seed: int, device: torch.device) -> Iterator[None]:
    """`forked_rng`, with the CPU's generator and `device`'s (CUDA: its Philox seed, offset 0)
    seeded from `seed`."""
    with forked_rng(device):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        yield


class MLP(nn.Module):
    def __init__(self, cfg: WorkloadConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.in_dim, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, cfg: WorkloadConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A small decoder-only transformer (about 430k parameters at the defaults)."""

    def __init__(self, cfg: WorkloadConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def llama(cfg: WorkloadConfig) -> nn.Module:
    """transformers' LlamaForCausalLM from a LlamaConfig at the workload's sizes, random init
    (nothing is downloaded): RMSNorm, rotary positions, SwiGLU, grouped-query attention."""
    import transformers  # the `hf` extra; validation refuses workload=llama without it

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.intermediate or -(-8 * cfg.d_model // 24) * 8,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads or cfg.heads,
        max_position_embeddings=cfg.context,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config)


def _instantiate(node: Any) -> Any:
    """Hydra's instantiate, imported at first use: only a custom workload needs it, and Hydra
    with OmegaConf costs every rank that starts as a fresh interpreter (torchrun's) 0.4 s of CPU."""
    from hydra.utils import instantiate

    return instantiate(node)


class Workload:
    """Builds the model and produces deterministic batches and losses for one config."""

    def __init__(self, cfg: WorkloadConfig, device: str | torch.device = "cpu"):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        self.autocast = DTYPES[cfg.autocast] if cfg.autocast else None
        # Batches are drawn on the CPU, from the same generators on any device, then moved.
        self.device = torch.device(device)
        teacher = generator(cfg.seed, _STREAM_TEACHER)
        if cfg.name == "custom":
            self._data = _instantiate(cfg.data)
            self._loss = _instantiate(cfg.loss)
        elif cfg.name == "mlp":
            self._teacher = torch.randn(cfg.in_dim, cfg.classes, generator=teacher)
        else:
            # A sparse random Markov chain: learnable structure, so the loss falls visibly.
            logits = torch.randn(cfg.vocab, cfg.vocab, generator=teacher) * 3.0
            self._transitions = torch.softmax(logits, dim=1)

    def build_model(self) -> nn.Module:
        """The model, initialised from the seed; on the `meta` device (names and shapes only, as
        the config's checks need them) nothing is allocated or initialised."""
        torch.manual_seed(self.cfg.seed)
        with self.device if self.device.type == "meta" else nullcontext():
            if self.cfg.name == "custom":
                model = _instantiate(self.cfg.model)
            elif self.cfg.name == "llama":
                model = llama(self.cfg)
            else:
                model = MLP(self.cfg) if self.cfg.name == "mlp" else GPT(self.cfg)
        return model.to(device=self.device, dtype=self.dtype)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        if self.cfg.name == "custom":
            return _instantiate(self.cfg.optimizer)(model.parameters())
        # AdamW adds eps to the root of the second moment in the weights' dtype: float16 rounds
        # 1e-8 to 0, and an element whose gradient is 0 then updates by 0/0 = NaN at step 0.
        eps = max(1e-8, torch.finfo(self.dtype).tiny)
        betas, decay = self.cfg.betas or (0.9, 0.999), self.cfg.weight_decay
        return torch.optim.AdamW(
            model.parameters(), lr=self.cfg.lr, eps=eps, betas=betas,
            weight_decay=0.01 if decay is None else decay,
        )  # fmt: skip

    def prepare_update(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """The recipe between the step's checks and its optimizer step: clip the gradient's
        global norm (after every check, as Megatron checks the norm for NaN before clipping),
        then set the step's learning rate from the schedule."""
        if self.cfg.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.clip_grad_norm)
        factor = self.cfg.lr_factor(step)
        for group in optimizer.param_groups:
            # torch's schedulers keep the base rate under this key; the optimizer's state_dict
            # carries it, so a resumed run scales the same base.
            group.setdefault("initial_lr", group["lr"])
            group["lr"] = group["initial_lr"] * factor

    def batch(self, step: int, rank: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.name == "custom":
            return self._placed(self._custom(step, rank, micro_batch, self.cfg.micro_batch_size))
        gen = generator(self.cfg.seed, _STREAM_TRAIN, step, rank, micro_batch)
        return self._placed(self._sample(gen, self.cfg.micro_batch_size))

    def eval_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.name == "custom":  # a held-out batch: a step no training run reaches
            return self._placed(self._custom(-1, 0, 0, 4 * self.cfg.micro_batch_size))
        gen = generator(self.cfg.seed, _STREAM_EVAL)
        return self._placed(self._sample(gen, 4 * self.cfg.micro_batch_size))

    def forward_rng(self, step: int, rank: int, micro_batch: int) -> AbstractContextManager[None]:
        """The random state of one micro-batch's forward and backward, whichever rank computes
        it: the training rank, a replaying peer, or a third rank breaking a tie."""
        key = stream_seed(self.cfg.seed, _STREAM_FORWARD, step, rank, micro_batch)
        return seeded_rng(key, self.device)

    def _placed(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if self.device.type == "cpu":
            return batch
        return tuple(t.to(self.device, non_blocking=True) for t in batch)

    def _custom(self, step: int, rank: int, micro: int, size: int) -> tuple[torch.Tensor, ...]:
        inputs, targets = self._data(self.cfg.seed, step, rank, micro, size)
        return (inputs.to(self.dtype) if inputs.is_floating_point() else inputs), targets

    def _sample(self, gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if cfg.name == "mlp":
            x = torch.randn(n, cfg.in_dim, generator=gen)
            return x.to(self.dtype), (x @ self._teacher).argmax(dim=1)
        tokens = torch.empty(n, cfg.context + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(cfg.vocab, (n,), generator=gen)
        for t in range(cfg.context):
            probs = self._transitions[tokens[:, t]]
            tokens[:, t + 1] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The model's output reaches the loss as the model returned it (harness/losses.py);
        under a mixed precision, forward and loss run under autocast, as Lightning runs them."""
        inputs, targets = batch
        with torch.autocast(self.device.type, self.autocast, enabled=self.autocast is not None):
            return self.loss_of(model(inputs), targets)

    def loss_of(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.cfg.name == "custom":
            return self._loss(output, targets)
        return losses.cross_entropy(output, targets)

    def eval_loss(self, model: nn.Module) -> float:
        """The loss on the held-out batch, with the model in eval mode (no dropout), so that
        the final loss that judges a trial's harm draws nothing at random."""
        training = model.training
        model.eval()
        with torch.no_grad():
            value = float(self.loss(model, self.eval_batch()))
        model.train(training)
        return value
