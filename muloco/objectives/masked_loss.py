"""The masked-diffusion loss's scoring as a torchtitan loss, compiled where stock's loss is.

The scoring upcasts the gathered logits to float32, sets the mask token's logit to −∞, takes the
cross-entropy and sums it weighted. Eagerly each step writes the float32 logits of every masked
position and reads them back for the log-softmax: at a 128K vocabulary that is gigabytes a step, and
on an H200 ``mdlm`` trained at 0.83x the compiled ``ar`` objective, whose loss torchtitan compiles
(docs/gpu.md). As a :class:`~torchtitan.components.loss.BaseLoss` it is compiled by torchtitan's own
switch (``--compile.enable`` with ``loss`` in ``--compile.components``) and fuses as stock's
cross-entropy does. The head stays outside, as torchtitan's chunked loss keeps it: it is an FSDP
module whose hooks gather its weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torchtitan.components.loss import BaseLoss
from torchtitan.config import CompileConfig


def masked_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, mask_id: int
) -> torch.Tensor:
    """Σ weights · CE(logits with the mask token's logit −∞, labels): (C, V), (C,), (C,) → scalar.

    ``logits`` is handed over (the gather's or the head's output, saved by neither for backward):
    float32 logits get the −∞ in place."""
    logits = logits.float()
    logits[:, mask_id] = -math.inf  # the mask token is never predicted
    return (F.cross_entropy(logits, labels, reduction="none") * weights).sum()


class MaskedCrossEntropyLoss(BaseLoss):
    """``(logits, labels, weights, mask_id) -> (Σ w·CE, {})`` of the masked positions."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        pass

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        self.fn = masked_cross_entropy
        self._maybe_compile(compile_config)

    def __call__(
        self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = self.fn(pred, labels, kwargs["weights"], kwargs["mask_id"])
        return (loss if global_valid_tokens is None else loss / global_valid_tokens), {}
