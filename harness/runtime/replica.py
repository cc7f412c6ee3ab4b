"""A plain replica of a module that FSDP2's `fully_shard` wrapped: what replay recomputes a step
on, this rank holding every parameter whole (harness/core/plugins.py, `DetectorContext.replica`),
in campaigns and in the guard alike.

`deepcopy` would copy FSDP's state and process groups, which FSDP refuses; building the model
anew needs its constructor and draws an initialisation that is thrown away. This copies the
module tree itself: each module of its original class (FSDP's dynamic `FSDP<Class>` undone),
its attributes as they are (a config, a rotary embedding's cached scaling), its buffers cloned,
each parameter a new whole one, uninitialised (the caller copies the gathered weights in), a
parameter shared by two modules (tied embeddings) shared in the copy, and no module hook
(FSDP's gather shards; the caller installs its own).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
from torch.distributed.fsdp import FSDPModule

# What fully_shard adds to a module's __dict__: its state and registry (torch's composable API)
# and the flags it sets for Dynamo.
_FSDP_ATTRIBUTES = frozenset(
    {STATE_KEY, REGISTRY_KEY, "_is_fsdp_managed_module", "_fsdp_use_orig_params"}
)
_HOOK_DICTS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
    "_backward_pre_hooks",
)  # fmt: skip


def unsharded_copy(model: nn.Module) -> nn.Module:
    """A plain module of `model`'s structure and classes, without FSDP."""
    copies: dict[int, object] = {}

    def parameter(p: nn.Parameter) -> nn.Parameter:
        if id(p) not in copies:
            data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            copies[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
        return copies[id(p)]

    def module(m: nn.Module) -> nn.Module:
        if id(m) in copies:
            return copies[id(m)]
        cls = type(m)
        if isinstance(m, FSDPModule):
            cls = cls.__mro__[cls._orig_cls_mro_index]
        copy = cls.__new__(cls)
        copies[id(m)] = copy
        state = {k: v for k, v in m.__dict__.items() if k not in _FSDP_ATTRIBUTES}
        for hooks in _HOOK_DICTS:
            if hooks in state:
                state[hooks] = OrderedDict()
        state["_parameters"] = {
            n: None if p is None else parameter(p) for n, p in m._parameters.items()
        }
        state["_buffers"] = {n: None if b is None else b.clone() for n, b in m._buffers.items()}
        state["_modules"] = {n: None if c is None else module(c) for n, c in m._modules.items()}
        copy.__dict__.update(state)
        return copy

    return module(model)
