"""The outer optimizer: one step on the global parameters per committed sync, picked with
``--outer.optimizer NAME`` (``--outer.optimizer.name NAME`` says the same).

One sign convention everywhere: the pseudo-gradient is Δ = θ_g − θ_local (averaged
over replicas), it is treated as a gradient and *minimized*, and the outer learning
rate is applied here and nowhere else. With g = mean Δ:

- ``nesterov``: b ← μ·b + g;  θ_g ← θ_g − η·(g + μ·b)   (DiLoCo's outer optimizer)
- ``sgd``:      b ← μ·b + g;  θ_g ← θ_g − η·b
- ``none``:     θ_g ← θ_g − g   (= the average of the local models; no η, no μ)

η and μ may change from one sync to the next (:meth:`OuterOptimizer.set`, driven by the
schedules in ``step_schedule.py``); torch's SGD reads them from its parameter group at each step.

The step is ``torch.optim.SGD(momentum=μ, nesterov=True, foreach=True)`` (torch's
multi-tensor kernels, one launch per op and dtype/device bucket), not a hand-written
loop; its momentum buffers are created up front (zeros: the first step gives b = g,
as torch's own first step does) so they exist before the first sync, live with θ_g
(same device, fp32) and travel with it: :meth:`OuterOptimizer.state_tensors` is what the
checkpoint and a healing replica's state hold of an optimizer.

A new outer optimizer is a class here (its ``Config``, its step, its state tensors, the facts a
run records of it) and a member of ``OuterOptimizerConfig``; the loop asks only this interface.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch
import tyro
from torchtitan.config import Configurable


class OuterOptimizer(Configurable):
    """The interface the outer loop steps θ_g with."""

    name: ClassVar[str]

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        def validate(self) -> None:
            pass

        def values(self, lr_factor: float, momentum_factor: float) -> tuple[float, float]:
            """The lr and momentum of a sync whose schedules stand at these factors (as its record says them)."""
            raise NotImplementedError

        def check_schedules(self, schedules: Any, beta: float) -> None:
            """Refuse outer-step schedules this optimizer cannot follow (``StepSchedules.validate``)."""
            schedules.validate(momentum=0.0, beta=beta)

        def label(self) -> str:
            """The outer step as a run folder's name says it (``runs/names.py``)."""
            raise NotImplementedError

        def describe(self) -> str:
            """For the log: its name and settings."""
            return type(self)._owner.name

        def facts(self) -> dict[str, Any]:
            """What ``run.json`` records of it: its name, its settings, its label."""
            settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
            return {"name": type(self)._owner.name, **settings, "label": self.label()}

    def __init__(self, config: Config, *, params: list[torch.Tensor], zeros_like=torch.zeros_like):
        config.validate()
        self.config = config
        self.params = params

    def set(self, *, lr: float, momentum: float) -> None:
        """The learning rate and momentum of the next step (a schedule's values at this sync)."""

    def step(self, grads: list[torch.Tensor]) -> None:
        """One outer step with the averaged pseudo-gradients ``grads``, which it may consume."""
        raise NotImplementedError

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Its state, one tensor per parameter under each name: saved and sent to healing peers with θ_g."""
        return {}


class _TorchSGD(OuterOptimizer):
    """Steps through ``torch.optim.SGD``, the outer lr applied once, momentum buffers made up front."""

    nesterov: ClassVar[bool] = False

    @dataclass(kw_only=True, slots=True)
    class Config(OuterOptimizer.Config):
        carried_on_switch: ClassVar[tuple[str, ...]] = ("lr", "momentum")
        """``--outer.optimizer nesterov|sgd`` keeps these (``config/variants.py``): the same η and μ in either."""
        lr: float = 0.7
        """Outer learning rate η (DiLoCo: 0.7; MuLoCo's configs 0.8-0.9)."""
        momentum: float = 0.9
        """Outer momentum μ, in [0, 1)."""

        def validate(self) -> None:
            if not self.lr > 0:
                raise ValueError(f"outer.optimizer.lr must be > 0, got {self.lr}")
            if not 0 <= self.momentum < 1:
                raise ValueError(f"outer.optimizer.momentum must be in [0, 1), got {self.momentum}")

        def values(self, lr_factor: float, momentum_factor: float) -> tuple[float, float]:
            return self.lr * lr_factor, self.momentum * momentum_factor

        def check_schedules(self, schedules: Any, beta: float) -> None:
            schedules.validate(momentum=self.momentum, beta=beta)

        def describe(self) -> str:
            return f"{type(self)._owner.name} lr={self.lr} momentum={self.momentum}"

    def __init__(self, config: Config, *, params: list[torch.Tensor], zeros_like=torch.zeros_like):
        super().__init__(config, params=params, zeros_like=zeros_like)
        self.sgd = torch.optim.SGD(
            params,
            lr=config.lr,
            momentum=config.momentum,
            foreach=True,
            nesterov=self.nesterov and config.momentum > 0,
        )
        self.momentum: list[torch.Tensor] = []
        if config.momentum > 0:
            self.momentum = [zeros_like(p) for p in params]
            for p, b in zip(params, self.momentum):
                self.sgd.state[p]["momentum_buffer"] = b

    def set(self, *, lr: float, momentum: float) -> None:
        group = self.sgd.param_groups[0]
        group["lr"] = lr
        if self.momentum:  # built with μ > 0: a schedule moves it, never to or from "no momentum"
            group["momentum"] = momentum

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        """torch's Nesterov step adds μ·b into ``grads`` in place (no second copy of the model)."""
        for p, g in zip(self.params, grads):
            p.grad = g
        self.sgd.step()
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"momentum": self.momentum} if self.momentum else {}


class Nesterov(_TorchSGD):
    nesterov = True

    @dataclass(kw_only=True, slots=True)
    class Config(_TorchSGD.Config):
        def label(self) -> str:
            """``olr0.7``, with ``-m0.5`` when μ is not DiLoCo's 0.9."""
            return f"olr{self.lr:g}" + ("" if self.momentum == 0.9 else f"-m{self.momentum:g}")

    name = "nesterov"


class SGD(_TorchSGD):
    @dataclass(kw_only=True, slots=True)
    class Config(_TorchSGD.Config):
        def label(self) -> str:
            """``olr1-sgd``, with ``-m0.5`` when there is momentum."""
            return f"olr{self.lr:g}-sgd" + ("" if self.momentum == 0.0 else f"-m{self.momentum:g}")

    name = "sgd"


class Averaging(OuterOptimizer):
    """θ_g ← θ_g − g: the average of the replicas' models (no lr, no momentum, no state)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OuterOptimizer.Config):
        def values(self, lr_factor: float, momentum_factor: float) -> tuple[float, float]:
            return 1.0, 0.0

        def check_schedules(self, schedules: Any, beta: float) -> None:
            if not (schedules.lr.constant and schedules.momentum.constant):
                raise ValueError(
                    "outer.optimizer none averages the models (no lr, no momentum): "
                    "drop outer.step_schedule.lr/momentum, or use --outer.optimizer sgd"
                )
            schedules.validate(momentum=0.0, beta=beta)  # (no super() in a slots dataclass)

        def label(self) -> str:
            return "avg"

        def describe(self) -> str:
            return "none (the replicas' models averaged)"

    name = "none"

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        torch._foreach_sub_(self.params, grads)


OuterOptimizerConfig = (
    Annotated[Nesterov.Config, tyro.conf.subcommand(Nesterov.name)]
    | Annotated[SGD.Config, tyro.conf.subcommand(SGD.name)]
    | Annotated[Averaging.Config, tyro.conf.subcommand(Averaging.name)]
)
"""``--outer.optimizer nesterov|sgd|none`` (``muloco/config/variants.py``): η and μ are then
``--outer.optimizer.lr`` and ``--outer.optimizer.momentum``; switching between nesterov and sgd
keeps them (``carried_on_switch``)."""
