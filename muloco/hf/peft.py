"""LoRA adapters in peft's folder format, both ways.

A muloco adapter saved here loads with ``peft.PeftModel.from_pretrained(base, folder)`` on the
Hugging Face base model (the folder a run started from, or its export), and a peft adapter
folder loads into a LoRA-wrapped muloco model. The folder holds ``adapter_config.json`` and
``adapter_model.safetensors`` keyed as peft saves a causal LM's adapters
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). torchtitan orders the rows
of ``wq``/``wk`` per head interleaved for its rotary embedding, Hugging Face half-split
(:class:`muloco.hf.adapter.Llama3Adapter`); the update ``B A x`` lands on those rows through B,
so B's rows of q/k take the same reordering and A (whose rows are the rank) none.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch.distributed.tensor import DTensor

from muloco.hf.adapter import Llama3Adapter
from muloco.utils.atomic_file import write_atomically

TARGETS = {
    "q_proj": "attention.qkv_linear.wq",
    "k_proj": "attention.qkv_linear.wk",
    "v_proj": "attention.qkv_linear.wv",
    "o_proj": "attention.wo",
    "gate_proj": "feed_forward.w1",
    "up_proj": "feed_forward.w3",
    "down_proj": "feed_forward.w2",
}
"""peft's name of each projection → its path inside a layer of muloco's model (the names LoRA
targets are given by, :mod:`muloco.models.lora`)."""
_SITE = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:.*\.)?(" + "|".join(map(re.escape, TARGETS.values())) + ")")
"""A targetable module's name; wrapper infixes (``_checkpoint_wrapped_module.``, ``_orig_mod.``)
allowed, since adapters are saved from a model parallelised for training."""
_TARGET_OF = {path: name for name, path in TARGETS.items()}


def site(name: str) -> tuple[int, str] | None:
    """The (layer index, peft target name) of a module's name; None for a module no target names."""
    m = _SITE.fullmatch(name)
    return (int(m[1]), _TARGET_OF[m[2]]) if m else None


def _adapted(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The projections that carry an adapter (``muloco.models.lora.LoraLinear``)."""
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A")}


def _adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}


CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
BASE_FILE = "muloco_base.json"
"""Beside peft's files: the fingerprint of the frozen base the adapter was trained on (peft's
``base_model_name_or_path`` is a name; the fingerprint tells a different base of the same shapes)."""
SUBLAYER = {t: "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for t in TARGETS}
ROTARY = {"q_proj": "q", "k_proj": "k"}
"""The targets whose output rows are in rotary order: their B takes the adapter's permutation."""
UNSUPPORTED = {
    "use_dora": False,
    "use_rslora": False,
    "use_qalora": False,
    "fan_in_fan_out": False,
    "lora_bias": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "layer_replication": None,
    "modules_to_save": None,
    "trainable_token_indices": None,
    "alora_invocation_tokens": None,
}
"""peft settings that change what an adapter computes beyond ``alpha/r · B A x``, with their off
values (written out, since peft reads the patterns as dicts): a folder must leave them off."""
_KEY = re.compile(r"(.*)\.lora_([AB])\.weight")


def _hf_key(layer: int, target: str, which: str) -> str:
    return f"base_model.model.model.layers.{layer}.{SUBLAYER[target]}.{target}.lora_{which}.weight"


def _ours_to_hf(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, str, str]]:
    """Each adapter tensor's state-dict name → (peft key, target, A or B)."""
    out = {}
    for key in state:
        module, which = _KEY.fullmatch(key).groups()
        layer, target = site(module)
        out[key] = (_hf_key(layer, target, which), target, which)
    return out


def base_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over the frozen parameters' bytes in parameter order (a LoRA model's base)."""
    h = hashlib.sha256()
    for p in model.parameters():
        if not p.requires_grad:
            value = p.full_tensor() if isinstance(p, DTensor) else p
            h.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_adapter(
    model: torch.nn.Module, model_config, lora_config, folder: str | Path, base_model_name_or_path: str
) -> None:
    """Write ``model``'s adapters (``model_config`` gives the heads the rotary order needs;
    ``lora_config`` their settings, a :class:`muloco.models.lora.LoraConfig`) as a peft adapter
    folder for the Hugging Face model ``base_model_name_or_path``, with the frozen base's
    fingerprint (:data:`BASE_FILE`)."""
    adapter, state = Llama3Adapter(model_config), _adapter_state(model)
    if not state:
        raise ValueError("the model has no LoRA adapters to save")
    tensors = {}
    for key, (hf_key, target, which) in _ours_to_hf(state).items():
        value = state[key].full_tensor() if isinstance(state[key], DTensor) else state[key]
        if which == "B" and target in ROTARY:
            value = adapter._permute(value, adapter._heads(ROTARY[target]))
        tensors[hf_key] = value.detach().cpu().contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None,
        "r": lora_config.rank,
        "lora_alpha": lora_config.alpha,
        "lora_dropout": lora_config.dropout,
        "target_modules": [t for t in TARGETS if t in lora_config.target_modules],
        "bias": "none",
        "inference_mode": True,
        "init_lora_weights": True,
        **UNSUPPORTED,
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(folder / WEIGHTS_FILE, save(tensors, metadata={"format": "pt"}))
    write_atomically(folder / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    write_atomically(
        folder / BASE_FILE,
        json.dumps({"base_sha256": base_fingerprint(model), "base_model_name_or_path": base_model_name_or_path}) + "\n",
    )


def adapter_settings(folder: str | Path) -> dict:
    """The LoRA settings of a peft adapter folder, as :class:`muloco.models.lora.LoraConfig`'s
    fields (to wrap a model with before :func:`load_adapter`); ValueError for an adapter muloco's
    LoRA does not compute."""
    path = Path(folder) / CONFIG_FILE
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable peft adapter config ({e})") from None
    if theirs.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {theirs.get('peft_type')!r} is not LORA")
    on = [name for name in UNSUPPORTED if theirs.get(name)] + (["bias"] if theirs.get("bias", "none") != "none" else [])
    if on:
        raise ValueError(f"{path} sets {on}, which muloco's LoRA does not compute")
    targets = theirs.get("target_modules")
    if not isinstance(targets, list):
        raise ValueError(f"{path}: target_modules {targets!r} is not a list of projection names")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"{path}: target_modules {targets} must name some of {list(TARGETS)}")
    try:
        return dict(
            rank=int(theirs["r"]),
            alpha=float(theirs["lora_alpha"]),
            dropout=float(theirs.get("lora_dropout", 0.0)),
            target_modules=list(targets),
        )
    except KeyError as e:
        raise ValueError(f"{path} lacks {e}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def _model_lora(model: torch.nn.Module) -> tuple[int, float, list[str]]:
    """(rank, alpha, targets) of the adapters ``model`` carries."""
    modules = _adapted(model)
    if not modules:
        raise ValueError("the model has no LoRA adapters to load into (apply_lora first)")
    m = next(iter(modules.values()))
    rank = m.lora_A.out_features
    return rank, round(m.scale * rank, 6), sorted({site(name)[1] for name in modules})


def _check_base(model: torch.nn.Module, folder: Path) -> None:
    """An adapter muloco exported goes onto the base it was trained on (ValueError otherwise)."""
    path = folder / BASE_FILE
    if not path.is_file():
        return  # an adapter from elsewhere (peft's own): its base is the user's word
    try:
        recorded = json.loads(path.read_text())
        want = recorded["base_sha256"]
        name = (
            recorded.get("base_model_name_or_path")
            or "its base (export the run with --lora-base to write the base beside the adapter)"
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a readable muloco base record ({e})") from None
    have = base_fingerprint(model)
    if have != want:
        raise ValueError(
            f"{folder} was trained on a base whose weights hash to {want[:16]}…, and the model it is "
            f"loaded onto hashes to {have[:16]}…: load it onto {name}, the base it was exported with"
        )


def load_adapter(model: torch.nn.Module, folder: str | Path) -> None:
    """Copy a peft adapter folder's tensors into ``model``'s adapters, which must have the
    folder's rank, alpha and targets (ValueError naming the difference otherwise). The heads the
    rotary order needs come from the model's own config (torchtitan models keep it as ``config``).
    Load before sharding: the tensors go in through ``load_state_dict``."""
    theirs, (rank, alpha, targets) = adapter_settings(folder), _model_lora(model)
    _check_base(model, Path(folder))
    for what, folder_value, ours in (
        ("rank", theirs["rank"], rank),
        ("lora_alpha", theirs["alpha"], alpha),
        ("target_modules", sorted(theirs["target_modules"]), targets),
    ):
        if folder_value != ours:
            raise ValueError(f"{folder}: the adapter's {what} is {folder_value}, the model's adapters have {ours}")
    path = Path(folder) / WEIGHTS_FILE
    try:
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    adapter, state = Llama3Adapter(model.config), _adapter_state(model)
    names = _ours_to_hf(state)
    expected = {hf_key for hf_key, _, _ in names.values()}
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{path} does not fit the model: "
            + (f"it lacks {missing[0]}" if missing else f"it has {unexpected[0]}, which no adapter takes")
        )
    new = {}
    for key, (hf_key, target, which) in names.items():
        value = tensors[hf_key]
        if which == "B" and target in ROTARY:
            value = adapter._reverse_permute(value, adapter._heads(ROTARY[target]))
        if value.shape != state[key].shape:
            raise ValueError(f"{path}: {hf_key} has shape {list(value.shape)}, the model's {list(state[key].shape)}")
        new[key] = value.to(state[key].dtype)
    model.load_state_dict(new, strict=False)


__all__ = ["TARGETS", "adapter_settings", "base_fingerprint", "load_adapter", "save_adapter", "site"]
