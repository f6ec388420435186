"""Llama-3-family models built from torchtitan's building blocks.

A flavor name from :mod:`muloco.models.flavors` plus the tokenizer's vocabulary
and the attention direction (fixed by the objective, not a model setting) gives a
torchtitan ``ModelSpec``. Initialisation,
parallelisation and the parameter/FLOP count come from torchtitan's llama3 model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _LINEAR_INIT,
    _NORM_INIT,
    Llama3Model,
    _depth_init,
    _output_linear_init,
    parallelize_llama,
)
from torchtitan.protocols.model_spec import ModelSpec

from muloco.compat.fsdp_gloo import gloo_safe_parallelize
from muloco.hf import config as hf_config
from muloco.hf.adapter import Llama3Adapter, adapter_for
from muloco.models.attention import SwitchableSDPA
from muloco.models.block import SandwichBlock
from muloco.models.flavors import HF_FLAVOR, UnknownFlavorError, hf_folder, padded_vocab, parse_flavor
from muloco.models.lora import LoraConfig, apply_lora, with_lora

ROPE_THETA = 500_000.0
NORM_EPS = 1e-6


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    flavor: str = "llama3-w128-d4-h2"
    """Model-map flavor: llama3-w{dim}-d{depth}-h{heads}[_qk_torch-rmsnorm][_pa][_pf]; or hf:DIR, the
    shapes a Hugging Face folder's config.json states (Llama 2/3.x, Qwen2/2.5, Qwen3, LLaDA: heads,
    KV heads, FFN size, RoPE base and Llama 3's scaling, q/k/v biases, norm epsilon, tying, vocabulary). Its shapes
    only: to start from its weights add
    --checkpoint.initial_load_path DIR --checkpoint.initial_load_in_hf."""
    vocab_multiple_of: int = 64
    """The embedding/head rows are padded to a multiple of this (GPU-friendly shapes)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (--model.lora.rank 8): only they train (the rest is frozen), and under
    DiLoCo/MuLoCo only their pseudo-gradients are exchanged; rank 0 trains every parameter."""

    def validate(self) -> None:
        """A model-map flavor names a shape (an ``hf:DIR`` folder is checked with its tokenizer,
        in the pre-flight); LoRA settings are in range."""
        self.lora.validate()
        if hf_folder(self.flavor) is None:
            try:
                parse_flavor(self.flavor)
            except UnknownFlavorError as err:
                raise ValueError(str(err)) from None


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``rope_type: llama3``): frequencies of wavelength above
    ``original_max_position_embeddings / low_freq_factor`` divided by ``factor``, those below
    ``/ high_freq_factor`` kept, the band between blended. torchtitan's ``ComplexRoPE`` computes
    it (``scaling="llama"``); these are its parameters as a Hugging Face config states them."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def rope_fields(self) -> dict:
        """The arguments of torchtitan's ``RoPE.Config`` that apply this scaling."""
        return dict(
            scaling="llama",
            scaling_factor=self.factor,
            low_freq_factor=self.low_freq_factor,
            high_freq_factor=self.high_freq_factor,
            original_max_position_embeddings=self.original_max_position_embeddings,
        )


@dataclass(frozen=True)
class Architecture:
    """Every number the model's shapes and function depend on: a flavor's (with muloco's fixed
    RoPE base and norm epsilon) or a Hugging Face ``config.json``'s (:meth:`from_hf`)."""

    dim: int
    depth: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = NORM_EPS
    rope_theta: float = ROPE_THETA
    tied: bool = False
    qk_norm: bool = False
    post_attention_norm: bool = False
    post_ffn_norm: bool = False
    qkv_bias: bool = False
    """A bias on the query, key and value projections (Qwen2/Qwen2.5), not on the output's."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.x's frequency scaling (None: plain RoPE)."""

    @classmethod
    def of_flavor(cls, cfg: ModelConfig, vocab_size: int) -> "Architecture":
        """A model-map flavor's shapes, or, for ``hf:DIR``, those of that folder's ``config.json``
        (its vocabulary size too; the config checks that the tokenizer's ids fit in it)."""
        folder = hf_folder(cfg.flavor)
        if folder is not None:
            return cls.from_hf(hf_config.read(folder))
        flavor = parse_flavor(cfg.flavor)
        s = flavor.shape
        return cls(
            dim=s.dim,
            depth=s.depth,
            heads=s.heads,
            kv_heads=s.heads,
            head_dim=s.head_dim,
            ffn_dim=s.ffn_dim,
            vocab_size=padded_vocab(vocab_size, cfg.vocab_multiple_of),
            qk_norm=flavor.qk_norm,
            post_attention_norm=flavor.post_attention_norm,
            post_ffn_norm=flavor.post_ffn_norm,
        )

    @classmethod
    def from_hf(cls, theirs: dict) -> "Architecture":
        """A Hugging Face Llama ``config.json``'s architecture (:func:`muloco.hf.config.architecture_fields`:
        ValueError naming what muloco's models do not compute)."""
        fields = hf_config.architecture_fields(theirs)
        scaling = fields.pop("rope_scaling")
        return cls(**fields, rope_scaling=RopeScaling(**scaling) if scaling else None)


def _norm(dim: int, eps: float) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_NORM_INIT)


def _attention(a: Architecture, layer_id: int, causal: bool):
    """torchtitan's grouped-query attention with these shapes, RoPE scaling and q/k/v biases."""
    scaling = a.rope_scaling.rope_fields() if a.rope_scaling else {}
    config = make_gqa_config(
        dim=a.dim,
        n_heads=a.heads,
        n_kv_heads=a.kv_heads if a.kv_heads != a.heads else None,
        head_dim=a.head_dim if a.head_dim != a.dim // a.heads else None,
        wqkv_param_init=_LINEAR_INIT,
        wo_param_init=_depth_init(layer_id),
        inner_attention=SwitchableSDPA.Config(is_causal=causal),
        rope=ComplexRoPE.Config(dim=a.head_dim, max_seq_len=131072, theta=a.rope_theta, **scaling),
        fuse_qkv=False,
        qk_norm=_norm(a.head_dim, a.norm_eps) if a.qk_norm else None,
    )
    if a.qkv_bias:  # torchtitan's Linear takes a bias; its init zeroes it (_LINEAR_INIT)
        config.qkv_linear.wq.bias = config.qkv_linear.wkv.bias = True
    return config


def _layer(a: Architecture, layer_id: int, causal: bool) -> SandwichBlock.Config:
    return SandwichBlock.Config(
        attention_norm=_norm(a.dim, a.norm_eps),
        ffn_norm=_norm(a.dim, a.norm_eps),
        post_attention_norm=_norm(a.dim, a.norm_eps) if a.post_attention_norm else None,
        post_ffn_norm=_norm(a.dim, a.norm_eps) if a.post_ffn_norm else None,
        attention=_attention(a, layer_id, causal),
        feed_forward=make_ffn_config(
            dim=a.dim,
            hidden_dim=a.ffn_dim,
            w1_param_init=_LINEAR_INIT,
            w2w3_param_init=_depth_init(layer_id),
        ),
    )


def architecture_config(a: Architecture, causal: bool = True) -> Llama3Model.Config:
    """torchtitan's Llama 3 config with these shapes; ``causal`` is the attention direction."""
    return Llama3Model.Config(
        dim=a.dim,
        vocab_size=a.vocab_size,
        enable_weight_tying=a.tied,
        tok_embeddings=Embedding.Config(num_embeddings=a.vocab_size, embedding_dim=a.dim, param_init=_EMBEDDING_INIT),
        norm=_norm(a.dim, a.norm_eps),
        lm_head=Linear.Config(in_features=a.dim, out_features=a.vocab_size, param_init=_output_linear_init(a.dim)),
        layers=[_layer(a, i, causal) for i in range(a.depth)],
    )


def build_model_config(cfg: ModelConfig, vocab_size: int, causal: bool = True) -> Llama3Model.Config:
    return architecture_config(Architecture.of_flavor(cfg, vocab_size), causal)


def build(config: Llama3Model.Config, device="cpu") -> Llama3Model:
    """The model of ``config`` built on the meta device, materialised on ``device``, its weights
    and buffers (the RoPE tables, which checkpoints do not hold) initialised."""
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def init_model(cfg: ModelConfig, vocab_size: int, causal: bool = True, device="cpu") -> Llama3Model:
    """The model as torchtitan's trainer makes it, outside a trainer (sampling, benchmarks, tests),
    with its LoRA adapters (a LoRA run's checkpoint holds them)."""
    model = build(build_model_config(cfg, vocab_size, causal), device)
    apply_lora(model, cfg.lora)
    return model


def build_model_spec(cfg: ModelConfig, vocab_size: int, causal: bool = True) -> ModelSpec:
    return ModelSpec(
        name="llama3",
        flavor=cfg.flavor,
        model=build_model_config(cfg, vocab_size, causal),
        parallelize_fn=with_lora(gloo_safe_parallelize(parallelize_llama), cfg.lora),
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=hf_adapter(cfg),
    )


def hf_adapter(cfg: ModelConfig):
    """torchtitan's Llama 3 state-dict adapter, with the QK norms (Qwen3's names) and the sandwich
    block's output norms (``modeling_muloco.py``'s): what ``muloco.export`` writes with and what
    ``--checkpoint.initial_load_in_hf`` reads with."""

    folder = hf_folder(cfg.flavor)
    if folder is not None:
        return adapter_for(folder)
    return Llama3Adapter


__all__ = [
    "Architecture",
    "RopeScaling",
    "HF_FLAVOR",
    "ModelConfig",
    "hf_folder",
    "architecture_config",
    "build",
    "build_model_config",
    "build_model_spec",
    "init_model",
]
