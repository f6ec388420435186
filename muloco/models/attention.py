"""SDPA inner attention: causal or bidirectional, with an optional per-document mask.

torchtitan's llama3 flavors use FlexAttention, whose backward does not run on CPU,
and its ``get_attention_config("sdpa")`` refuses SDPA for language models; its
``ScaledDotProductAttention`` takes ``is_causal`` per call (``GQAttention`` never
passes it) and refuses any mask. The attention direction is fixed when the model is
built (the objective decides: next-token prediction is causal, masked diffusion is
bidirectional). Packed rows may carry a boolean ``(B, 1, L, L)`` mask from
:func:`muloco.objectives.documents.document_mask` (``True`` = may attend), which
already includes the causal triangle where the model is causal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchtitan.models.common.attention import ScaledDotProductAttention

# Flash attention takes no mask; the memory-efficient kernel does (and cuDNN on recent GPUs).
MASKED_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class SwitchableSDPA(ScaledDotProductAttention):
    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        is_causal: bool = True
        """False gives bidirectional attention (set from the objective, not by hand)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.is_causal = config.is_causal

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        if attention_masks is None:
            return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa,
                                   is_causal=self.is_causal)
        q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        with sdpa_kernel(MASKED_BACKENDS, set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale,
                                                 enable_gqa=enable_gqa)
        return out.transpose(1, 2)
