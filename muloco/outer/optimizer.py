"""The outer optimizer: one step on the global parameters per committed sync.

One sign convention everywhere: the pseudo-gradient is Δ = θ_g − θ_local (averaged
over replicas), it is treated as a gradient and *minimized*, and the outer learning
rate is applied here and nowhere else. With g = mean Δ:

- ``nesterov``: b ← μ·b + g;  θ_g ← θ_g − η·(g + μ·b)   (DiLoCo's outer optimizer)
- ``sgd``:      b ← μ·b + g;  θ_g ← θ_g − η·b
- ``none``:     θ_g ← θ_g − g   (= the average of the local models; η, μ unused)

η and μ may change from one sync to the next (:meth:`OuterOptimizer.set`, driven by the
schedules in ``step_schedule.py``); torch's SGD reads them from its parameter group at each step.

The step is ``torch.optim.SGD(momentum=μ, nesterov=True, foreach=True)`` (torch's
multi-tensor kernels, one launch per op and dtype/device bucket), not a hand-written
loop; its momentum buffers are created up front (zeros: the first step gives b = g,
as torch's own first step does) so they exist before the first sync, live with θ_g
(same device, fp32) and travel with it: they are part of the checkpoint and of the
state a healing replica receives.
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

    def __init__(self, config: Config, *, params: list[torch.Tensor], zeros_like=torch.zeros_like):
        config.validate()
        self.config = config
        self.params = params
        if config.name == "none":  # θ_g ← θ_g − g
            self.sgd = torch.optim.SGD(params, lr=1.0, momentum=0.0, foreach=True)
        else:
            self.sgd = torch.optim.SGD(
                params,
                lr=config.lr,
                momentum=config.momentum,
                foreach=True,
                nesterov=config.name == "nesterov" and config.momentum > 0,
            )
        self.momentum: list[torch.Tensor] = []
        if config.name != "none" and config.momentum > 0:
            self.momentum = [zeros_like(p) for p in params]
            for p, b in zip(params, self.momentum):
                self.sgd.state[p]["momentum_buffer"] = b

    def set(self, *, lr: float, momentum: float) -> None:
        """The learning rate and momentum of the next step (a schedule's values at this sync)."""
        if self.config.name == "none":
            return
        group = self.sgd.param_groups[0]
        group["lr"] = lr
        if self.momentum:  # built with μ > 0: a schedule moves it, never to or from "no momentum"
            group["momentum"] = momentum

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        """One outer step with the averaged pseudo-gradients ``grads``, which it consumes:
        torch's Nesterov step adds μ·b into them in place (no second copy of the model)."""
        for p, g in zip(self.params, grads):
            p.grad = g
        self.sgd.step()
        for p in self.params:
            p.grad = None
