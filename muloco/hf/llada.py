"""LLaDA's Hugging Face folders (``GSAI-ML/LLaDA-8B-*``) seen as Llama folders.

LLaDA is a Llama with bidirectional attention saved under OLMo's names and config keys: its
``config.json`` says ``d_model``, ``n_layers``, ``mlp_hidden_size`` ... with ``model_type``
``llada``, and its weights are ``model.transformer.wte``, ``blocks.<i>.q_proj/k_proj/v_proj``,
``attn_out``, ``ff_proj`` (the gate), ``up_proj``, ``ff_out`` (down), ``attn_norm``, ``ff_norm``,
``ln_f`` and ``model.transformer.ff_out`` (the head). Its rotary embedding rotates the two halves
of each head as Hugging Face's Llama does and its RMSNorm is Llama's, so renaming keys is the
whole mapping: torchtitan's Llama 3 adapter does the rest, as for any Llama folder. Options
LLaDA's code has and muloco's model does not compute (biases, another activation or norm, QK
norm, ALiBi, clipped QKV) are one error naming the option.
"""

from __future__ import annotations

import re

MODEL_TYPE = "llada"

TOP = {
    "model.embed_tokens.weight": "model.transformer.wte.weight",
    "model.norm.weight": "model.transformer.ln_f.weight",
    "lm_head.weight": "model.transformer.ff_out.weight",
}
"""Hugging Face Llama name → LLaDA name, outside the blocks."""

BLOCK = {
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "mlp.gate_proj": "ff_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ff_norm",
}
"""Within block ``i``: ``model.layers.<i>.<key>.weight`` → ``model.transformer.blocks.<i>.<value>.weight``."""

UNSUPPORTED = {
    "include_bias": False,
    "include_qkv_bias": False,
    "activation_type": "silu",
    "layer_norm_type": "rms",
    "attention_layer_norm": False,
    "alibi": False,
    "rope": True,
    "clip_qkv": None,
    "block_type": "llama",
    "multi_query_attention": None,
}
"""LLaDA options and the value muloco's Llama model computes (absent counts as that value)."""


def is_llada(config: dict) -> bool:
    return config.get("model_type") == MODEL_TYPE


def llama_view(config: dict) -> dict:
    """LLaDA's config as a Hugging Face Llama config (``model_type`` kept as ``llada``: its
    attention is bidirectional); ValueError naming an option muloco does not compute."""
    for key, want in UNSUPPORTED.items():
        if config.get(key, want) != want:
            raise ValueError(f"LLaDA option {key}={config[key]!r}: muloco's Llama model computes {key}={want!r}")
    heads = config["n_heads"]
    return {
        "model_type": MODEL_TYPE,
        "hidden_size": config["d_model"],
        "num_hidden_layers": config["n_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("n_kv_heads") or heads,
        "intermediate_size": config["mlp_hidden_size"],
        "vocab_size": config.get("embedding_size") or config["vocab_size"],
        "rms_norm_eps": config.get("rms_norm_eps", 1e-5),
        "rope_theta": config.get("rope_theta", 10000.0),
        "tie_word_embeddings": bool(config.get("weight_tying", False)),
        "max_position_embeddings": config.get("max_sequence_length", 4096),
        "mask_token_id": config.get("mask_token_id"),
    }


def _rename(state: dict, top: dict[str, str], block: dict[str, str], pattern: str, template: str) -> dict:
    out = {}
    for key, value in state.items():
        if key in top:
            out[top[key]] = value
            continue
        m = re.fullmatch(pattern, key)
        if m is None or m["part"] not in block:
            raise KeyError(f"{key}: not a weight of a Llama/LLaDA checkpoint")
        out[template.format(i=m["i"], part=block[m["part"]])] = value
    return out


def to_llada_names(state: dict) -> dict:
    """Hugging Face Llama names → LLaDA's."""
    return _rename(
        state,
        TOP,
        BLOCK,
        r"model\.layers\.(?P<i>\d+)\.(?P<part>.+)\.weight",
        "model.transformer.blocks.{i}.{part}.weight",
    )


def to_llama_names(state: dict) -> dict:
    """LLaDA's names → Hugging Face Llama's."""
    return _rename(
        state,
        {v: k for k, v in TOP.items()},
        {v: k for k, v in BLOCK.items()},
        r"model\.transformer\.blocks\.(?P<i>\d+)\.(?P<part>.+)\.weight",
        "model.layers.{i}.{part}.weight",
    )
