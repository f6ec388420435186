"""The optimizer container torchtitan builds, with flat hyperparameters.

torchtitan 0.3.0 configures optimizers as a list of ``ParamGroupConfig`` whose
kwargs are a dict, which cannot be overridden field by field on the command line
(``--optimizer.lr 3e-4``). Here the common knobs are plain fields and the groups
are derived from them: norm weights get no weight decay, everything else does.
Explicit ``param_groups`` still win when a config sets them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

NORM_PATTERN = r"(^|\.)(\w*norm)\.weight$"


class MulocoOptimizers(OptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        name: Literal["AdamW"] = "AdamW"
        """Inner optimizer."""
        lr: float = 3e-3
        """Peak learning rate (scaled by the LR schedule)."""
        beta1: float = 0.9
        beta2: float = 0.95
        eps: float = 1e-8
        weight_decay: float = 0.1
        """Decoupled weight decay; norm weights are never decayed."""

        def derived_param_groups(self) -> list[ParamGroupConfig]:
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
        if not config.param_groups:
            config = dataclasses.replace(config, param_groups=config.derived_param_groups())
        super().__init__(config, model_parts=model_parts)
