"""The outer optimizer: one step on the global parameters per committed sync.

One sign convention everywhere: the pseudo-gradient is Δ = θ_g − θ_local (averaged
over replicas), it is treated as a gradient and *minimized*, and the outer learning
rate is applied here and nowhere else. With g = mean Δ:

- ``nesterov``: b ← μ·b + g;  θ_g ← θ_g − η·(g + μ·b)   (DiLoCo's outer optimizer)
- ``sgd``:      b ← μ·b + g;  θ_g ← θ_g − η·b
- ``none``:     θ_g ← θ_g − g   (= the average of the local models; η, μ unused)

The momentum buffers live with θ_g (same device, fp32) and travel with it: they are
part of the checkpoint and of the state a healing replica receives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchtitan.config import Configurable

OUTER_OPTIMIZERS = ("nesterov", "sgd", "none")


class OuterOptimizer(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        name: str = "nesterov"
        """nesterov | sgd | none (plain averaging of the replicas' models)."""
        lr: float = 0.7
        """Outer learning rate η (DiLoCo: 0.7; MuLoCo's configs 0.8-0.9)."""
        momentum: float = 0.9
        """Outer momentum μ, in [0, 1)."""

        def validate(self) -> None:
            if self.name not in OUTER_OPTIMIZERS:
                raise ValueError(
                    f"outer.optimizer.name must be one of {', '.join(OUTER_OPTIMIZERS)}; got {self.name!r}"
                )
            if not self.lr > 0:
                raise ValueError(f"outer.optimizer.lr must be > 0, got {self.lr}")
            if not 0 <= self.momentum < 1:
                raise ValueError(f"outer.optimizer.momentum must be in [0, 1), got {self.momentum}")

    def __init__(self, config: Config, *, params: list[torch.Tensor]):
        config.validate()
        self.config = config
        self.params = params
        uses_momentum = config.name != "none" and config.momentum > 0
        self.momentum = [torch.zeros_like(p) for p in params] if uses_momentum else []

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        """Apply one outer step with the averaged pseudo-gradients ``grads``."""
        c = self.config
        if c.name == "none":
            torch._foreach_sub_(self.params, grads)
            return
        if not self.momentum:
            torch._foreach_add_(self.params, grads, alpha=-c.lr)
            return
        torch._foreach_mul_(self.momentum, c.momentum)
        torch._foreach_add_(self.momentum, grads)
        if c.name == "nesterov":
            torch._foreach_add_(self.params, grads, alpha=-c.lr)
            torch._foreach_add_(self.params, self.momentum, alpha=-c.lr * c.momentum)
        else:
            torch._foreach_add_(self.params, self.momentum, alpha=-c.lr)
