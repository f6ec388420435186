"""Next-token prediction: causal attention, cross-entropy on every label (torchtitan's loss)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.components.loss import cross_entropy_loss

from .objective import NoiseKey, Objective, Prepared


class Autoregressive(Objective):
    name = "ar"
    causal = True
    next_token = True

    @dataclass(kw_only=True, slots=True)
    class Config(Objective.Config):
        document_mask: bool = False
        """Tokens attend only to earlier tokens of their own document (off: the whole row's past)."""

    def prepare(self, inputs: torch.Tensor, labels: torch.Tensor, key: NoiseKey | None = None) -> Prepared:
        return Prepared(inputs, labels, self.attention_kwargs(inputs))

    def loss(self, pred, batch: Prepared, global_valid_tokens=None) -> torch.Tensor:
        loss = cross_entropy_loss(pred, batch.labels)
        return loss if global_valid_tokens is None else loss / global_valid_tokens
