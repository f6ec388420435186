"""A masked-diffusion language model exported by muloco: Llama weights, bidirectional attention.

Shipped inside the exported folder and loaded with ``trust_remote_code=True``:

    model = AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)

Every position attends to every other (padding excepted, from ``attention_mask``); the logits
at a position holding ``config.mask_token_id`` predict the token it hides. Only the attention
mask differs from ``LlamaForCausalLM``: the layers, weights and rotary embedding are transformers'
own. The mask token itself is never a prediction (muloco scores it at minus infinity).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel


class MulocoMdlmConfig(LlamaConfig):
    model_type = "muloco_mdlm"

    def __init__(self, mask_token_id: int | None = None, **kwargs):
        self.mask_token_id = mask_token_id
        super().__init__(**kwargs)


class MulocoMdlmModel(LlamaModel):
    config_class = MulocoMdlmConfig

    def __init__(self, config: MulocoMdlmConfig):
        super().__init__(config)
        for layer in self.layers:
            layer.self_attn.is_causal = False

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, length = inputs_embeds.shape[:2]
        keep = (
            torch.ones(batch, length, dtype=torch.bool, device=inputs_embeds.device)
            if attention_mask is None
            else attention_mask.to(torch.bool)
        )
        # a prepared 4D additive mask (transformers passes it through as is): keys that are padding
        # are closed to every query, nothing else is
        bidirectional = torch.zeros(batch, 1, length, length, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        bidirectional = bidirectional.masked_fill(~keep[:, None, None, :], torch.finfo(inputs_embeds.dtype).min)
        return super().forward(inputs_embeds=inputs_embeds, attention_mask=bidirectional, **kwargs)


class MulocoMdlmForMaskedLM(LlamaForCausalLM):
    config_class = MulocoMdlmConfig

    def __init__(self, config: MulocoMdlmConfig):
        super().__init__(config)
        self.model = MulocoMdlmModel(config)
        self.post_init()
