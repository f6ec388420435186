"""Schedules of the outer step: its learning rate, momentum and error-feedback β over the run.

DiLoCo's recipe holds the outer step constant (η 0.7, μ 0.9). With few syncs or a short H, a
constant momentum carries the large pseudo-gradients of the early, high-learning-rate syncs into
the inner schedule's cool-down (``docs/compression.md`` has the experiment), and the literature
schedules it: Pier (arXiv 2511.17849; its public code) starts the momentum high (0.99) and
decays it to 0.9 while the outer learning rate warms up and then decays; the DiLoCo scaling
study tunes η per size and H. Each scheduled value here is its configured value times a
factor of the training progress p = step / total steps (the inner schedule's total):

- ``warmup`` > 0: the factor rises linearly from ``start`` at p = 0 to 1 at p = ``warmup``;
- ``decay`` ``linear`` | ``cosine``: from p = ``decay_from`` (≥ warmup) it falls to ``final``
  at p = 1 (cosine: final + (1 − final)·(1 + cos πq)/2, q the share of the decay done);
- ``decay`` ``inner``: the factor *is* the inner learning rate's own factor at that step (its
  warmup and its decay to ``lr_scheduler.min_lr_factor``), so the outer step cools down with
  the inner one;
- the default (no warmup, no decay) keeps the value constant.

The factor is a pure function of the trainer step, which every replica in a quorum shares, a
healing replica receives from its peer, and a checkpoint restores: a schedule needs no state
of its own to agree bitwise across replicas and to resume exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from torchtitan.config import Configurable

DECAYS = ("none", "linear", "cosine", "inner")


class ValueSchedule(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        warmup: float = 0.0
        """Share of the run over which the factor rises linearly from ``start`` to 1 (0: none)."""
        start: float = 0.0
        """The factor at the start of the warmup."""
        decay: str = "none"
        """none | linear | cosine (to ``final`` at the end of the run) | inner (the inner lr's factor)."""
        decay_from: float = 0.0
        """Share of the run after which a linear or cosine decay begins (at least ``warmup``)."""
        final: float = 1.0
        """The factor at the end of the run (linear and cosine decays)."""

        @property
        def constant(self) -> bool:
            return self.warmup == 0 and self.decay == "none"

        def validate(self, name: str = "schedule") -> None:
            if self.decay not in DECAYS:
                raise ValueError(f"{name}.decay must be one of {', '.join(DECAYS)}; got {self.decay!r}")
            if not 0.0 <= self.warmup < 1.0:
                raise ValueError(f"{name}.warmup is a share of the run, in [0, 1); got {self.warmup!r}")
            if not 0.0 <= self.decay_from < 1.0:
                raise ValueError(f"{name}.decay_from is a share of the run, in [0, 1); got {self.decay_from!r}")
            if self.decay in ("linear", "cosine") and self.decay_from < self.warmup:
                raise ValueError(
                    f"{name}.decay_from ({self.decay_from:g}) must be at least {name}.warmup "
                    f"({self.warmup:g}): the decay starts after the warmup"
                )
            if self.decay == "inner" and self.warmup:
                raise ValueError(f"{name}.decay inner follows the inner schedule, warmup included; drop {name}.warmup")
            for key in ("start", "final"):
                value = getattr(self, key)
                if not (math.isfinite(value) and value >= 0):
                    raise ValueError(f"{name}.{key} must be a finite factor >= 0; got {value!r}")

        def largest_factor(self) -> float:
            """The largest factor the schedule reaches (its values are piecewise monotone)."""
            return max(
                1.0, self.start if self.warmup else 1.0, self.final if self.decay in ("linear", "cosine") else 1.0
            )

        def describe(self) -> str:
            if self.constant:
                return "constant"
            parts = []
            if self.warmup:
                parts.append(f"warmup {self.start:g}->1 over {self.warmup:g} of the run")
            if self.decay == "inner":
                parts.append("decay with the inner lr")
            elif self.decay != "none":
                parts.append(f"{self.decay} decay to {self.final:g} from {self.decay_from:g} of the run")
            return ", ".join(parts)

    def __init__(self, config: Config, *, total_steps: int, inner_factor: Callable[[int], float] | None = None):
        self.config = config
        self.total_steps = max(int(total_steps), 1)
        self.inner_factor = inner_factor

    def factor(self, step: int) -> float:
        """The factor at trainer step ``step``."""
        c = self.config
        if c.decay == "inner":
            if self.inner_factor is None:
                raise ValueError("a schedule that decays with the inner lr needs the inner schedule")
            return float(self.inner_factor(step))
        p = min(max(step / self.total_steps, 0.0), 1.0)
        if c.warmup and p < c.warmup:
            return c.start + (1.0 - c.start) * p / c.warmup
        if c.decay in ("linear", "cosine") and p > c.decay_from:
            q = (p - c.decay_from) / (1.0 - c.decay_from)
            g = 1.0 - q if c.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * q))
            return c.final + (1.0 - c.final) * g
        return 1.0


@dataclass(kw_only=True, slots=True)
class StepSchedules:
    """The outer step's three schedules (``--outer.step_schedule.{lr,momentum,feedback_beta}.*``)."""

    lr: ValueSchedule.Config = field(default_factory=ValueSchedule.Config)
    """Factor on ``outer.optimizer.lr``."""
    momentum: ValueSchedule.Config = field(default_factory=ValueSchedule.Config)
    """Factor on ``outer.optimizer.momentum`` (Nesterov or SGD momentum μ)."""
    feedback_beta: ValueSchedule.Config = field(default_factory=ValueSchedule.Config)
    """Factor on ``outer.exchange.error_feedback.beta``: the compressed configs' momentum (their
    outer step is plain SGD and the error-feedback residual carries the past)."""

    def validate(self, *, momentum: float, beta: float) -> None:
        for name in ("lr", "momentum", "feedback_beta"):
            getattr(self, name).validate(f"outer.step_schedule.{name}")
        if momentum * self.momentum.largest_factor() >= 1:
            raise ValueError(
                f"outer.step_schedule.momentum reaches {momentum * self.momentum.largest_factor():g} "
                f"(outer.optimizer.momentum {momentum:g} times its largest factor); momentum must stay < 1"
            )
        if beta * self.feedback_beta.largest_factor() > 1:
            raise ValueError(
                f"outer.step_schedule.feedback_beta reaches {beta * self.feedback_beta.largest_factor():g}"
                f" (outer.exchange.error_feedback.beta {beta:g} times its largest factor); β must stay <= 1"
            )

    def describe(self) -> str:
        return (
            "; ".join(
                f"{name} {getattr(self, name).describe()}"
                for name in ("lr", "momentum", "feedback_beta")
                if not getattr(self, name).constant
            )
            or "constant"
        )
