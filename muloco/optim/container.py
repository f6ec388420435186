"""The optimizer container torchtitan builds, with flat hyperparameters.

torchtitan 0.3.0 configures optimizers as a list of ``ParamGroupConfig`` whose
kwargs are a dict, which cannot be overridden field by field on the command line
(``--optimizer.lr 3e-4``). Here the common knobs are plain fields and the groups
are derived from them: norm weights get no weight decay, everything else does.
With ``name=Muon`` the 2-D hidden matrices (attention q/k/v/o, FFN w1/w2/w3, found by
``muon_pattern``, which survives activation-checkpoint wrappers) go to Muon and the
embeddings, head, norms and biases to AdamW, each with its lr factor. Explicit
``param_groups`` still win when a config sets them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from muloco.optim.muon import Muon, check_settings
from muloco.utils.values import require_at_least_zero, require_positive

NORM_PATTERN = r"(^|\.)(\w*norm)\.weight$"
HIDDEN_MATRIX_PATTERN = r"(^|\.)(attention|feed_forward)\.(\w+\.)*w\w*\.weight$"
EMBEDDING_PATTERN = r"(^|\.)tok_embeddings\.weight$"
HEAD_PATTERN = r"(^|\.)(lm_head|output)\.weight$"


class MulocoOptimizers(OptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        name: Literal["AdamW", "Muon"] = "AdamW"
        """Inner optimizer: AdamW, or Muon for hidden matrices (AdamW for the rest)."""
        lr: float = 3e-3
        """Peak learning rate (scaled by the LR schedule)."""
        beta1: float = 0.9
        beta2: float = 0.95
        eps: float = 1e-8
        weight_decay: float = 0.1
        """Decoupled weight decay; norm weights are never decayed."""
        muon_momentum: float = 0.95
        muon_nesterov: bool = True
        muon_ns_steps: int = 5
        muon_coefficients: str = "keller"
        """Newton–Schulz coefficients: keller | muloco | polar_express."""
        muon_lr_scaling: str = "original"
        """original √max(1, m/n) | match_rms_adamw 0.2·√max(m, n) | spectral √(m/n)."""
        muon_pattern: str = HIDDEN_MATRIX_PATTERN
        """Parameters optimized by Muon (regex on parameter names)."""
        embedding_lr_factor: float = 1.0
        head_lr_factor: float = 1.0
        scalar_lr_factor: float = 1.0
        """lr factors of the AdamW groups when name=Muon (embeddings, output head, norms/biases)."""

        def validate(self) -> None:
            require_positive("optimizer.lr", self.lr, "a positive learning rate (e.g. 3e-3)")
            for key in ("beta1", "beta2"):
                if not 0 <= getattr(self, key) < 1:
                    raise ValueError(f"optimizer.{key} is {getattr(self, key)!r}; it must be in [0, 1).")
            require_at_least_zero("optimizer.weight_decay", self.weight_decay)
            if self.name == "Muon":
                check_settings(self.muon_momentum, self.muon_ns_steps, self.muon_coefficients, self.muon_lr_scaling)

        def muon_param_groups(self) -> list[ParamGroupConfig]:
            adamw = {"betas": (self.beta1, self.beta2), "eps": self.eps}
            muon = {
                "lr": self.lr,
                "momentum": self.muon_momentum,
                "nesterov": self.muon_nesterov,
                "weight_decay": self.weight_decay,
                "ns_steps": self.muon_ns_steps,
                "coefficients": self.muon_coefficients,
                "lr_scaling": self.muon_lr_scaling,
            }
            return [
                ParamGroupConfig(pattern=self.muon_pattern, optimizer_name="Muon", optimizer_kwargs=muon),
                ParamGroupConfig(
                    pattern=NORM_PATTERN,
                    optimizer_name="AdamW",
                    optimizer_kwargs={**adamw, "lr": self.lr * self.scalar_lr_factor, "weight_decay": 0.0},
                ),
                ParamGroupConfig(
                    pattern=EMBEDDING_PATTERN,
                    optimizer_name="AdamW",
                    optimizer_kwargs={
                        **adamw,
                        "lr": self.lr * self.embedding_lr_factor,
                        "weight_decay": self.weight_decay,
                    },
                ),
                ParamGroupConfig(
                    pattern=HEAD_PATTERN,
                    optimizer_name="AdamW",
                    optimizer_kwargs={**adamw, "lr": self.lr * self.head_lr_factor, "weight_decay": self.weight_decay},
                ),
                ParamGroupConfig(
                    pattern=".*",
                    optimizer_name="AdamW",
                    optimizer_kwargs={**adamw, "lr": self.lr * self.scalar_lr_factor, "weight_decay": 0.0},
                ),
            ]

        def derived_param_groups(self) -> list[ParamGroupConfig]:
            if self.name == "Muon":
                return self.muon_param_groups()
            kwargs = {"lr": self.lr, "betas": (self.beta1, self.beta2), "eps": self.eps}
            return [
                ParamGroupConfig(
                    pattern=NORM_PATTERN,
                    optimizer_name=self.name,
                    optimizer_kwargs={**kwargs, "weight_decay": 0.0},
                ),
                ParamGroupConfig(
                    pattern=".*",
                    optimizer_name=self.name,
                    optimizer_kwargs={**kwargs, "weight_decay": self.weight_decay},
                ),
            ]

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        config.validate()
        if not config.param_groups:
            groups = _matching(config.derived_param_groups(), model_parts)
            config = dataclasses.replace(config, param_groups=groups)
        super().__init__(config, model_parts=model_parts)

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == "Muon":
            return Muon
        return OptimizersContainer._resolve_optimizer_factory(name)


def _matching(groups: list[ParamGroupConfig], model_parts: list[nn.Module]) -> list[ParamGroupConfig]:
    """The derived groups that claim at least one parameter (torchtitan rejects empty ones;
    a model without biases simply has no catch-all group)."""
    names = [n for m in model_parts for n, p in m.named_parameters() if p.requires_grad]
    claimed: set[str] = set()
    kept = []
    for g in groups:
        pattern = re.compile(g.pattern)
        mine = {n for n in names if n not in claimed and pattern.search(n)}
        if mine:
            kept.append(g)
            claimed |= mine
    return kept
