"""LoRA: low-rank updates trained beside the frozen projections of a built model.

A targeted projection (named as Hugging Face and peft name it, ``q_proj`` … ``down_proj``) stays
the same module with the same parameter names (``layers.0.attention.qkv_linear.wq.weight``), so
checkpoints, the Hugging Face state-dict adapter and an initial Hugging Face load see the base
model unchanged; it gains two children, ``lora_A`` (r × in) and ``lora_B`` (out × r), and its
class is swapped for a subclass whose forward adds ``(alpha / r) · B(A(dropout(x)))`` (the
swap FSDP2's ``fully_shard`` makes too). :func:`merge_lora` folds the update into the weight
and swaps the class back. A and B are torchtitan ``Linear`` modules with their own
``param_init`` (A kaiming-uniform as in peft, B zero, so training starts from the base model):
``init_states`` after ``to_empty`` initialises them like every other parameter, and the
trainer's module-protocol check passes.

torchtitan 0.3.0 ships a config-level ``LoRAConverter`` (``torchtitan.components.lora``); muloco
does not use it because it cannot express peft's adapters: it targets a config by its last name,
and ``make_gqa_config`` builds ``wk`` and ``wv`` from one shared ``wkv`` config, so LoRA on v
without k (peft's and the LoRA paper's ``q_proj, v_proj``) is impossible; it has no dropout; and it
freezes modules by swapping every config for a generated subclass, which the HF state-dict
adapter, the checkpoint and the outer loop would then all see.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.common import Linear

from muloco.hf.peft import TARGETS, site

A_INIT = {"weight": functools.partial(nn.init.kaiming_uniform_, a=math.sqrt(5))}
B_INIT = {"weight": nn.init.zeros_}


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    rank: int = 0
    """Rank r of each adapter (0: no LoRA, every parameter trains)."""
    alpha: float = 16.0
    """The update is scaled by alpha / r (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (peft's lora_dropout); the frozen path sees the input unchanged."""
    target_modules: list[str] = field(default_factory=lambda: list(TARGETS))
    """The projections that get an adapter, by their Hugging Face/peft names."""

    def validate(self) -> None:
        if self.rank < 0:
            raise ValueError(f"model.lora.rank {self.rank} is negative (0 turns LoRA off)")
        if self.alpha <= 0:
            raise ValueError(f"model.lora.alpha {self.alpha} is not positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout {self.dropout} is not in [0, 1)")
        unknown = [t for t in self.target_modules if t not in TARGETS]
        if unknown or not self.target_modules:
            raise ValueError(
                f"model.lora.target_modules {self.target_modules} must name some of {list(TARGETS)} "
                "(peft's names of the projections)"
            )


class LoraLinear(nn.Linear):
    """A linear layer plus its low-rank update; made by :func:`apply_lora` from an existing
    linear layer of any ``nn.Linear`` subclass, which :data:`base_class` remembers for the merge."""

    base_class: type[nn.Linear]
    lora_A: Linear
    lora_B: Linear
    scale: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_B(self.lora_A(F.dropout(x, self.lora_dropout, self.training)))
        return super().forward(x) + self.scale * update


@functools.cache
def _lora_class(cls: type[nn.Linear]) -> type[LoraLinear]:
    """One LoRA subclass per base class, so ``isinstance`` checks against the base still hold."""
    return type(f"{cls.__name__}WithLora", (LoraLinear, cls), {"base_class": cls})


def _adapter(in_features: int, out_features: int, init: dict, like: torch.Tensor) -> Linear:
    with torch.device(like.device):
        linear = Linear.Config(in_features=in_features, out_features=out_features, param_init=init).build()
    linear.to(like.dtype).init_states()
    return linear


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def apply_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Give each targeted projection an adapter and freeze every other parameter; the names of
    the projections wrapped (none when ``config.rank`` is 0: the model trains in full)."""
    config.validate()
    if not config.rank:
        return []
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters")
    wanted = set(config.target_modules)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and (s := site(n)) and s[1] in wanted]
    if not names:
        raise ValueError(
            f"model.lora.target_modules {config.target_modules} match no projection of the model "
            f"(known targets: {list(TARGETS)})"
        )
    model.requires_grad_(False)
    modules = dict(model.named_modules())
    for name in names:
        linear = modules[name]
        weight = linear.weight
        linear.__class__ = _lora_class(type(linear))
        linear.lora_A = _adapter(linear.in_features, config.rank, A_INIT, weight)
        linear.lora_B = _adapter(config.rank, linear.out_features, B_INIT, weight)
        linear.scale, linear.lora_dropout = config.alpha / config.rank, config.dropout
    return names


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors under their state-dict names (what an adapter checkpoint holds)."""
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}


def frozen_keys(model_parts: list[nn.Module]) -> set[str]:
    """The state-dict keys of the frozen parameters (a LoRA model's base), as the state dict
    names them: activation checkpointing's wrapper inserts ``_checkpoint_wrapped_module.`` into
    ``named_parameters()`` but not into the state dict's keys."""
    return {
        k
        for m in model_parts
        for k, v in m.state_dict(keep_vars=True).items()
        if isinstance(v, nn.Parameter) and not v.requires_grad
    }


def trainable_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


@torch.no_grad()
def merge_lora(model: nn.Module) -> None:
    """Fold each adapter into its weight (W += alpha/r · B A, in fp32) and restore the plain
    module: a model that computes the same with no adapter left, for export or inference. The
    parameters stay as frozen as :func:`apply_lora` left them."""
    for m in lora_modules(model).values():
        delta = m.lora_B.weight.float() @ m.lora_A.weight.float()
        m.weight.add_((m.scale * delta).to(m.weight.dtype))
        del m.lora_A, m.lora_B, m.scale, m.lora_dropout
        m.__class__ = m.base_class


def with_lora(parallelize_fn, config: LoraConfig):
    """torchtitan's ``parallelize_fn`` that first gives the (meta-device) model its adapters, so
    that FSDP, compile and activation checkpointing wrap the model LoRA trains, and the
    optimizer and the outer loop see only the adapters as trainable."""

    @functools.wraps(parallelize_fn)
    def parallelize(model, **kwargs):
        apply_lora(model, config)
        return parallelize_fn(model, **kwargs)

    return parallelize


__all__ = [
    "LoraConfig",
    "LoraLinear",
    "apply_lora",
    "frozen_keys",
    "lora_modules",
    "lora_state",
    "merge_lora",
    "trainable_names",
    "with_lora",
]
