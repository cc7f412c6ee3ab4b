"""Losses that take a model's output as the model returns it.

A model's output reaches its loss unchanged: a tensor, a tuple or list (logits first, as
Hugging Face models return with `return_dict=False`), a dict, or a `transformers` ModelOutput
(a dict with attributes). These functions find the logits in any of them, so a plain
`GPT2LMHeadModel` trains with no wrapper around it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F


def logits(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, the `logits` entry of a mapping (a
    ModelOutput is one), or the first element of a tuple or list."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return output["logits"]
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"cannot find logits in a model output of type {type(output).__name__}: return a "
        "tensor, a tuple whose first element is the logits, or a mapping with 'logits'"
    )


def cross_entropy(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position, in float32 whatever the model's dtype: logits of
    shape (..., classes) against integer targets of shape (...)."""
    scores = logits(output)
    return F.cross_entropy(scores.float().reshape(-1, scores.shape[-1]), targets.reshape(-1))
