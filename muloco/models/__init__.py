"""Llama-3-family models built from torchtitan's building blocks.

A flavor name from :mod:`muloco.model_map` plus the tokenizer's vocabulary
and the attention direction (fixed by the objective, not a model setting) gives a
torchtitan ``ModelSpec``. Initialisation,
parallelisation and the parameter/FLOP count come from torchtitan's llama3 model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.llama3 import (
    _depth_init,
    _EMBEDDING_INIT,
    _LINEAR_INIT,
    _NORM_INIT,
    _output_linear_init,
    Llama3Model,
    parallelize_llama,
)
from torchtitan.protocols.model_spec import ModelSpec

from muloco.compat.fsdp_gloo import gloo_safe_parallelize
from muloco.models.attention import SwitchableSDPA
from muloco.models.block import SandwichBlock
from muloco.model_map import Flavor, padded_vocab, parse_flavor

ROPE_THETA = 500_000.0
NORM_EPS = 1e-6


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    flavor: str = "llama3-w128-d4-h2"
    """Model-map flavor: llama3-w{dim}-d{depth}-h{heads}[_qk_torch-rmsnorm][_pa][_pf]."""
    vocab_multiple_of: int = 64
    """The embedding/head rows are padded to a multiple of this (GPU-friendly shapes)."""


def _norm(dim: int) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=NORM_EPS, param_init=_NORM_INIT)


def _layer(flavor: Flavor, layer_id: int, causal: bool) -> SandwichBlock.Config:
    s = flavor.shape
    return SandwichBlock.Config(
        attention_norm=_norm(s.dim),
        ffn_norm=_norm(s.dim),
        post_attention_norm=_norm(s.dim) if flavor.post_attention_norm else None,
        post_ffn_norm=_norm(s.dim) if flavor.post_ffn_norm else None,
        attention=make_gqa_config(
            dim=s.dim,
            n_heads=s.heads,
            wqkv_param_init=_LINEAR_INIT,
            wo_param_init=_depth_init(layer_id),
            inner_attention=SwitchableSDPA.Config(is_causal=causal),
            rope=ComplexRoPE.Config(
                dim=s.head_dim, max_seq_len=131072, theta=ROPE_THETA, scaling="none"
            ),
            fuse_qkv=False,
            qk_norm=_norm(s.head_dim) if flavor.qk_norm else None,
        ),
        feed_forward=make_ffn_config(
            dim=s.dim,
            hidden_dim=s.ffn_dim,
            w1_param_init=_LINEAR_INIT,
            w2w3_param_init=_depth_init(layer_id),
        ),
    )


def build_model_config(cfg: ModelConfig, vocab_size: int, causal: bool = True) -> Llama3Model.Config:
    flavor = parse_flavor(cfg.flavor)
    dim = flavor.shape.dim
    vocab = padded_vocab(vocab_size, cfg.vocab_multiple_of)
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT
        ),
        norm=_norm(dim),
        lm_head=Linear.Config(
            in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)
        ),
        layers=[_layer(flavor, i, causal) for i in range(flavor.shape.depth)],
    )


def init_model(cfg: ModelConfig, vocab_size: int, causal: bool = True, device="cpu") -> Llama3Model:
    """The model as torchtitan's trainer makes it, outside a trainer (sampling, benchmarks, tests):
    built on the meta device, materialised on ``device``, its weights and buffers (the RoPE
    tables, which checkpoints do not hold) initialised."""
    with torch.device("meta"):
        model = build_model_config(cfg, vocab_size, causal).build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def build_model_spec(cfg: ModelConfig, vocab_size: int, causal: bool = True) -> ModelSpec:
    return ModelSpec(
        name="llama3",
        flavor=cfg.flavor,
        model=build_model_config(cfg, vocab_size, causal),
        parallelize_fn=gloo_safe_parallelize(parallelize_llama),
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=hf_adapter(cfg),
    )


def hf_adapter(cfg: ModelConfig):
    """torchtitan's Llama 3 state-dict adapter where a flavor maps onto Hugging Face's Llama
    (None: QK norm or post norms, which it does not express): what ``muloco.export`` writes with
    and what ``--checkpoint.initial_load_in_hf`` reads with."""
    from muloco.compat.hf_adapter import Llama3Adapter

    plain = not (cfg.flavor.endswith(("_pa", "_pf")) or "_qk_" in cfg.flavor)
    return Llama3Adapter if plain else None


__all__ = ["ModelConfig", "build_model_config", "build_model_spec", "init_model"]
