"""A model exported by muloco whose block transformers has no class for: Qwen3's attention (Llama
with optional per-head QK norms) in MuLoCo's "sandwich" block, whose optional post-attention and
post-FFN norms scale each sublayer's output before it joins the residual stream, and optionally
bidirectional attention (masked diffusion).

Shipped inside the exported folder and loaded with ``trust_remote_code=True``:

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)   # next-token
    model = AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)   # masked diffusion

``h = x + N_pa(Attn(N(x)))``, ``out = h + N_pf(FFN(N(h)))``; without ``post_attention_norm`` and
``post_ffn_norm`` it is Qwen3's block (with ``qk_norm``) or Llama's (without), with Qwen2's biases
on q/k/v where ``qkv_bias`` says so. For a masked-diffusion
model (``bidirectional``) every position attends to every other (padding excepted, from
``attention_mask``) and the logits at ``config.mask_token_id`` predict the hidden token.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm


class MulocoConfig(Qwen3Config):
    model_type = "muloco"

    def __init__(
        self,
        qk_norm: bool = True,
        post_attention_norm: bool = False,
        post_ffn_norm: bool = False,
        bidirectional: bool = False,
        mask_token_id: int | None = None,
        qkv_bias: bool = False,
        **kwargs,
    ):
        self.qk_norm, self.bidirectional, self.mask_token_id = qk_norm, bidirectional, mask_token_id
        self.qkv_bias = qkv_bias
        self.post_attention_norm, self.post_ffn_norm = post_attention_norm, post_ffn_norm
        super().__init__(**kwargs)


class MulocoDecoderLayer(Qwen3DecoderLayer):
    def __init__(self, config: MulocoConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if not config.qk_norm:
            self.self_attn.q_norm = nn.Identity()
            self.self_attn.k_norm = nn.Identity()
        if config.bidirectional:
            self.self_attn.is_causal = False
        if config.qkv_bias:  # Qwen2's biases: on q, k and v, not on the output projection
            for name in ("q_proj", "k_proj", "v_proj"):
                plain = getattr(self.self_attn, name)
                setattr(self.self_attn, name, nn.Linear(plain.in_features, plain.out_features, bias=True))
        self.attn_output_norm = (
            Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if config.post_attention_norm else None
        )
        self.mlp_output_norm = (
            Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if config.post_ffn_norm else None
        )

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        attn, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        if self.attn_output_norm is not None:
            attn = self.attn_output_norm(attn)
        hidden_states = hidden_states + attn
        ffn = self.mlp(self.post_attention_layernorm(hidden_states))  # transformers' name for the pre-FFN norm
        if self.mlp_output_norm is not None:
            ffn = self.mlp_output_norm(ffn)
        return hidden_states + ffn


class MulocoModel(Qwen3Model):
    config_class = MulocoConfig

    def __init__(self, config: MulocoConfig):
        super().__init__(config)
        self.layers = nn.ModuleList([MulocoDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs):
        if not self.config.bidirectional:
            return super().forward(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
            )
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, length = inputs_embeds.shape[:2]
        keep = (
            torch.ones(batch, length, dtype=torch.bool, device=inputs_embeds.device)
            if attention_mask is None
            else attention_mask.to(torch.bool)
        )
        # a prepared 4D additive mask (passed through as is): padding keys closed to every query
        mask = torch.zeros(batch, 1, length, length, dtype=inputs_embeds.dtype, device=inputs_embeds.device)
        mask = mask.masked_fill(~keep[:, None, None, :], torch.finfo(inputs_embeds.dtype).min)
        return super().forward(inputs_embeds=inputs_embeds, attention_mask=mask, **kwargs)


class MulocoForCausalLM(Qwen3ForCausalLM):
    config_class = MulocoConfig

    def __init__(self, config: MulocoConfig):
        super().__init__(config)
        self.model = MulocoModel(config)
        self.post_init()
