"""Next-token prediction: causal attention, cross-entropy on every label (torchtitan's loss)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.components.loss import BaseLoss, CrossEntropyLoss

from .objective import NoiseKey, Objective, Prepared


class Autoregressive(Objective):
    name = "ar"
    causal = True
    next_token = True
    title = "next-token prediction"

    @dataclass(kw_only=True, slots=True)
    class Config(Objective.Config):
        document_mask: bool = False
        """Tokens attend only to earlier tokens of their own document (off: the whole row's past)."""

    loss_fn: BaseLoss = CrossEntropyLoss.Config().build()
    """torchtitan's loss (eager here); the trainer hands over the one it built from ``config.loss``
    and ``config.compile``, so a compiled run compiles the loss as stock torchtitan does (at a
    128K vocabulary the eager loss materialises the float32 logits: 0.79x stock on an H200)."""

    def use_loss(self, loss_fn: BaseLoss, compile_config=None) -> None:
        self.loss_fn = loss_fn

    def prepare(self, inputs: torch.Tensor, labels: torch.Tensor, key: NoiseKey | None = None) -> Prepared:
        return Prepared(inputs, labels, self.attention_kwargs(inputs))

    def loss_inputs(self, batch: Prepared) -> dict[str, torch.Tensor]:
        return {}

    def loss(self, pred, batch: Prepared, global_valid_tokens=None) -> torch.Tensor:
        return self.loss_fn(pred, batch.labels, global_valid_tokens)[0]
