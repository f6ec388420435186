"""SDPA inner attention with a causal on/off switch.

torchtitan's llama3 flavors use FlexAttention, whose backward does not run on CPU,
and its ``get_attention_config("sdpa")`` refuses SDPA for language models. The
masked-diffusion objective also needs bidirectional attention. torchtitan's own
``ScaledDotProductAttention`` already accepts ``is_causal`` per call but
``GQAttention`` never passes it, so the switch lives in the config here.
Packed sequences are not masked per document (SDPA takes no document mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.common.attention import ScaledDotProductAttention


class SwitchableSDPA(ScaledDotProductAttention):
    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        is_causal: bool = True
        """False gives bidirectional attention (masked-diffusion objective)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.is_causal = config.is_causal

    def forward(self, q_BLNH, k_BLNH, v_BLNH, **kwargs) -> torch.Tensor:
        kwargs["is_causal"] = self.is_causal
        return super().forward(q_BLNH, k_BLNH, v_BLNH, **kwargs)
