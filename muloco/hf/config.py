"""A Llama model's shapes as a Hugging Face ``config.json`` says them, for export and import.

``muloco.export`` writes this config; a run started from a Hugging Face folder
(``--checkpoint.initial_load_path DIR --checkpoint.initial_load_in_hf``) is checked against the
folder's config before anything is built, so a flavor of another shape is one error naming the
first difference instead of a failed load deep in the checkpointer.
"""

from __future__ import annotations

import json
from pathlib import Path

from muloco.hf.llada import is_llada, llama_view

SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "vocab_size",
)
"""What must agree for the weights to load, in the order a mismatch is reported."""


def _rope_parameters(rope, theta: float) -> dict:
    """``rope_parameters`` of torchtitan's RoPE config: plain, or Llama 3.x's scaling."""
    if rope.scaling == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if rope.scaling != "llama":
        raise ValueError(f"RoPE scaling {rope.scaling!r} has no Hugging Face form here (only Llama 3's)")
    return {
        "rope_type": "llama3",
        "factor": rope.scaling_factor,
        "low_freq_factor": rope.low_freq_factor,
        "high_freq_factor": rope.high_freq_factor,
        "original_max_position_embeddings": rope.original_max_position_embeddings,
        "rope_theta": theta,
    }


def llama_config(model_config, bos_id: int, eos_id: int, seq_len: int) -> dict:
    """``config.json`` of a ``LlamaForCausalLM`` with the shapes of torchtitan's ``model_config``
    (a ``Qwen2ForCausalLM`` where the q/k/v projections have biases, a ``Qwen3ForCausalLM``, Llama
    with per-head QK norms, where the model has them; the shipped ``MulocoForCausalLM`` where its
    blocks have output norms or both QK norms and q/k/v biases). Llama 3.x's RoPE scaling is written
    in ``rope_parameters`` as transformers reads it (``rope_type: llama3``)."""
    attention = model_config.layers[0].attention
    heads = attention.n_heads
    theta = attention.rope.theta
    block = model_config.layers[0]
    post = {
        "post_attention_norm": block.post_attention_norm is not None,
        "post_ffn_norm": block.post_ffn_norm is not None,
    }
    qk_norm = attention.qk_norm is not None
    qkv_bias = bool(attention.qkv_linear.wq.bias)
    if any(post.values()) or (qk_norm and qkv_bias):  # the shipped sandwich-block class
        variant = {
            "architectures": ["MulocoForCausalLM"],
            "model_type": "muloco",
            "use_sliding_window": False,
            "qk_norm": qk_norm,
            "qkv_bias": qkv_bias,
            **post,
        }
    elif qk_norm:
        variant = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False}
    elif qkv_bias:
        variant = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": False}
    else:
        variant = {}
    rope = _rope_parameters(attention.rope, theta)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model_config.vocab_size,
        "hidden_size": model_config.dim,
        "intermediate_size": model_config.layers[0].feed_forward.w1.out_features,
        "num_hidden_layers": len(model_config.layers),
        "num_attention_heads": heads,
        "num_key_value_heads": attention.n_kv_heads or heads,
        "head_dim": attention.qkv_linear.head_dim or model_config.dim // heads,
        "hidden_act": "silu",
        "rms_norm_eps": model_config.norm.eps,
        "rope_theta": theta,
        "rope_parameters": rope,
        "max_position_embeddings": max(seq_len, rope.get("original_max_position_embeddings", 0)),
        "tie_word_embeddings": bool(model_config.enable_weight_tying),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        **variant,
    }


BIDIRECTIONAL = ("muloco_mdlm", "llada")
"""Model types whose attention is bidirectional (masked diffusion): muloco's export, LLaDA."""
LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "muloco", *BIDIRECTIONAL)
"""Model types muloco's Llama model computes (Llama 2/3.x, Qwen2/Qwen2.5, Qwen3, LLaDA): ``qwen2``
is Llama with biases on q/k/v, ``qwen3`` Llama with per-head QK norms, ``muloco`` the shipped
sandwich-block class (``muloco/hf/remote_code/modeling_muloco.py``)."""
SUPPORTED = (
    "Llama 2/3/3.1/3.2/3.3 (llama), Qwen2/Qwen2.5 (qwen2), Qwen3 (qwen3), LLaDA (llada) and "
    "muloco's own exports (muloco, muloco_mdlm)"
)
"""What :data:`LLAMA_FAMILY` means to a user, for the error naming an unsupported folder."""
ROPE_SCALINGS = ("default", "llama3")
"""RoPE variants muloco computes: plain, and Llama 3.1's frequency scaling (torchtitan's)."""


def bidirectional(theirs: dict) -> bool:
    return theirs.get("model_type") in BIDIRECTIONAL or bool(theirs.get("bidirectional"))


def _normalized(theirs: dict) -> dict:
    """A Hugging Face config with the defaults its class would fill in made explicit (a LLaDA
    config as the Llama config it is)."""

    theirs = llama_view(theirs) if is_llada(theirs) else dict(theirs)
    theirs.setdefault("num_key_value_heads", theirs.get("num_attention_heads"))
    if not theirs.get("head_dim") and theirs.get("hidden_size") and theirs.get("num_attention_heads"):
        theirs["head_dim"] = theirs["hidden_size"] // theirs["num_attention_heads"]
    ropes = [theirs[key] for key in ("rope_parameters", "rope_scaling") if isinstance(theirs.get(key), dict)]
    types = [rope.get("rope_type") or rope.get("type") or "default" for rope in ropes]
    # a scaling in either key counts (transformers reads rope_scaling next to a default rope_parameters)
    scaled = next(((t, rope) for t, rope in zip(types, ropes) if t != "default"), ("default", {}))
    theirs["_rope_type"], theirs["_rope_scaling"] = scaled
    theta = next((rope["rope_theta"] for rope in ropes if "rope_theta" in rope), theirs.get("rope_theta", 10000.0))
    theirs["_rope_theta"] = float(theta)
    return theirs


def _inconsistent_heads(theirs: dict) -> str | None:
    """Head counts transformers' Llama cannot build (None: they fit): the width must split into the
    heads (transformers checks it even where head_dim sets the heads' own width), and the query heads
    into groups of the key/value heads."""
    heads, kv_heads, hidden = (theirs.get(k) for k in ("num_attention_heads", "num_key_value_heads", "hidden_size"))
    if not all(isinstance(v, int) and v > 0 for v in (heads, kv_heads, hidden)):
        return None  # a missing or non-integer shape is named by the caller
    if heads % kv_heads:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
    if hidden % heads:  # also with head_dim given: transformers' config validation refuses it
        return (
            f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}: transformers refuses "
            "such a config (head_dim given or not), so a run from it could never be exported"
        )
    return None


def _unexpressible(theirs: dict) -> str | None:
    """What a normalized config asks for that muloco's Llama models do not compute (None: nothing)."""
    if theirs.get("model_type") not in LLAMA_FAMILY:
        return f"model_type is {theirs.get('model_type')!r}: the folders that load are {SUPPORTED}"
    if theirs.get("use_sliding_window"):
        return "it uses sliding-window attention, which muloco's models do not compute"
    if theirs["_rope_type"] not in ROPE_SCALINGS:
        return (
            f"its RoPE has {theirs['_rope_type']!r} scaling; muloco computes plain RoPE and Llama 3's "
            f"('llama3') scaling"
        )
    if theirs["_rope_type"] == "llama3":
        missing = [k for k in ("factor",) if not isinstance(theirs["_rope_scaling"].get(k), (int, float))]
        if missing:
            return f"its llama3 RoPE scaling gives no {missing[0]}"
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if theirs.get(key, want) != want:
            return (
                f"{key} is {theirs.get(key)} there; muloco's Llama models have {want} (Qwen2's biases on "
                "q/k/v only load from a qwen2 folder)"
                if key == "attention_bias"
                else f"{key} is {theirs.get(key)} there; muloco's Llama models have {want}"
            )
    return None


IMPLIED = {"qk_norm": "qwen3", "qkv_bias": "qwen2"}
"""The model type whose blocks always have a feature (else a ``muloco`` config's flag says)."""


def _has(config: dict, feature: str) -> bool:
    """Whether a config's blocks have ``feature`` (``qk_norm``: Qwen3's attention, ``qkv_bias``:
    Qwen2's, or the flag of muloco's own class)."""
    return bool(config.get(feature)) or config.get("model_type") == IMPLIED.get(feature)


def _rope_scaling(theirs: dict) -> dict | None:
    """The fields of :class:`muloco.models.RopeScaling` a normalized config states (None: plain RoPE)."""
    if theirs["_rope_type"] != "llama3":
        return None
    given = theirs["_rope_scaling"]
    fields = dict(
        factor=float(given["factor"]),
        low_freq_factor=float(given.get("low_freq_factor", 1.0)),
        high_freq_factor=float(given.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(given.get("original_max_position_embeddings", 8192)),
    )
    if fields["high_freq_factor"] <= fields["low_freq_factor"]:
        raise ValueError(
            f"its llama3 RoPE scaling has high_freq_factor {fields['high_freq_factor']:g} <= "
            f"low_freq_factor {fields['low_freq_factor']:g}; the blend between them needs high > low"
        )
    return fields


def read(folder: str | Path) -> dict:
    """The folder's ``config.json``; ValueError naming what is wrong with it."""
    path = Path(folder) / "config.json"
    try:
        theirs = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{folder} holds no config.json: give a Hugging Face model folder") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a JSON config ({e})") from None
    if not isinstance(theirs, dict):
        raise ValueError(f"{path} is not a JSON object")
    return theirs


def architecture_fields(theirs: dict) -> dict:
    """The fields of :class:`muloco.models.Architecture` a Hugging Face Llama config states (its own
    shapes, RoPE base, norm epsilon, grouped-query heads and tying; ``Architecture.from_hf`` builds
    it); ValueError naming a feature muloco's models do not compute."""
    try:
        t = _normalized(theirs)
    except KeyError as e:
        raise ValueError(f"config.json gives no {e.args[0]}") from None
    why = _unexpressible(t)
    if why:
        raise ValueError(why)
    missing = [k for k in SHAPE_KEYS if not isinstance(t.get(k), int)]
    if missing:
        raise ValueError(f"config.json gives no integer {missing[0]}")
    why = _inconsistent_heads(t)
    if why:
        raise ValueError(why)
    return dict(
        dim=t["hidden_size"],
        depth=t["num_hidden_layers"],
        heads=t["num_attention_heads"],
        kv_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"],
        ffn_dim=t["intermediate_size"],
        vocab_size=t["vocab_size"],
        norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=t["_rope_theta"],
        tied=bool(t.get("tie_word_embeddings", False)),
        qk_norm=_has(t, "qk_norm"),
        post_attention_norm=_has(t, "post_attention_norm"),
        post_ffn_norm=_has(t, "post_ffn_norm"),
        qkv_bias=_has(t, "qkv_bias"),
        rope_scaling=_rope_scaling(t),
    )


def first_mismatch(folder: str | Path, ours: dict) -> str | None:
    """The first way the folder's config.json differs from ``ours`` (a :func:`llama_config`) so
    that its weights would not load or would compute another function; None when it fits."""
    try:
        theirs = _normalized(json.loads((Path(folder) / "config.json").read_text()))
    except (KeyError, ValueError) as e:
        return f"its config.json cannot be read as a Llama config ({e})"
    for key in SHAPE_KEYS:
        if theirs.get(key) != ours[key]:
            return f"{key} is {theirs.get(key)} there and {ours[key]} here"
    for key, default in (("tie_word_embeddings", False), ("rms_norm_eps", 1e-6)):
        if theirs.get(key, default) != ours[key]:
            return f"{key} is {theirs.get(key, default)} there and {ours[key]} here"
    why = _unexpressible(theirs)
    if why:
        return why
    for feature, name in (
        ("qk_norm", "per-head QK norms"),
        ("post_attention_norm", "post-attention norms"),
        ("post_ffn_norm", "post-FFN norms"),
        ("qkv_bias", "biases on q/k/v"),
    ):
        if _has(theirs, feature) != _has(ours, feature):
            return (
                f"it has {name} and this flavor does not"
                if _has(theirs, feature)
                else f"this flavor has {name} and it does not"
            )
    if theirs["_rope_theta"] != float(ours["rope_theta"]):
        return f"rope_theta is {theirs['_rope_theta']:g} there and {ours['rope_theta']:g} here"
    mine = _normalized(ours)
    if (_rope_scaling(theirs), theirs["_rope_type"]) != (_rope_scaling(mine), mine["_rope_type"]):
        return f"its RoPE is {theirs['_rope_type']!r} {theirs['_rope_scaling'] or ''} and here {mine['_rope_type']!r}"
    return None
