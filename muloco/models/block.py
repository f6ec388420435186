"""Transformer block with optional post-attention and post-FFN norms (MuLoCo's `_pa_pf`).

MuLoCo's flavors use a "sandwich" block,
``h = x + N(Attn(N(x)))`` and ``out = h + N(FFN(N(h)))``; without the post norms it
is torchtitan's pre-norm Llama 3 block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.common import RMSNorm
from torchtitan.models.llama3.model import Llama3TransformerBlock


class SandwichBlock(Llama3TransformerBlock):
    @dataclass(kw_only=True, slots=True)
    class Config(Llama3TransformerBlock.Config):
        post_attention_norm: RMSNorm.Config | None = None
        post_ffn_norm: RMSNorm.Config | None = None

    def __init__(self, config: Config):
        super().__init__(config)
        self.post_attention_norm = config.post_attention_norm.build() if config.post_attention_norm else None
        self.post_ffn_norm = config.post_ffn_norm.build() if config.post_ffn_norm else None

    def forward(self, x: torch.Tensor, attention_masks, positions=None):
        a = self.attention(self.attention_norm(x), attention_masks, positions)
        if self.post_attention_norm is not None:
            a = self.post_attention_norm(a)
        h = x + a
        f = self.feed_forward(self.ffn_norm(h))
        if self.post_ffn_norm is not None:
            f = self.post_ffn_norm(f)
        return h + f
