"""Lockstep rounds (the default): every group trains H inner steps, then the quorum waits for the
slowest. The trainer step is the run's position everywhere: the loop's :class:`SyncSchedule` says when
a fragment's sync is prepared and performed (τ steps later under streaming DiLoCo), torchtitan's rules
say when the run validates, saves and ends. Nothing to keep: all replicas agree on the trainer step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from muloco.outer.rounds.mode import RoundMode


class Lockstep(RoundMode):
    @dataclass(kw_only=True, slots=True)
    class Config(RoundMode.Config):
        name: ClassVar[str] = "lockstep"

    name = Config.name

    def step_trained(self, step: int, started: float) -> bool:
        return self.schedule.prepare_due(step)

    def perform_due(self, step: int) -> bool:
        return self.schedule.perform_due(step)

    def position(self, step: int) -> float:
        return step

    def validation_due(self, step: int, freq: int) -> bool:
        """At a full-round sync boundary, once per ``freq`` inner steps."""
        h = self.schedule.sync_every
        return self.schedule.round_complete(step) and step // freq > (step - h) // freq

    def boundary(self, step: int) -> tuple[int, int] | None:
        """Every sync boundary, in trainer steps."""
        interval = self.schedule.interval
        return (step, interval) if step % interval == 0 else None
