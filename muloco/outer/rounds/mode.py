"""What the outer loop asks of a round mode: when a sync is prepared and performed, where the run stands
on its schedules, when it validates, saves, may stop and ends, what a replica reports of its work, and
what of all this travels with θ_g. The loop (``outer/loop.py``) and the trainer ask; they never branch
on which mode runs. A new mode (say, asynchronous merges) is a module here and a line in ``RoundConfig``.

Invariants every mode keeps:

- every answer that all replica groups must agree on (positions, boundaries, the end) is a function of
  state every replica holds alike: the trainer step in lockstep rounds, the quorum's committed records
  in deadline rounds; that state is in :meth:`RoundMode.state_dict`, saved and sent to healing peers
  with θ_g;
- a mode changes nothing when a sync is not committed (:meth:`RoundMode.commit` is called on commit only);
- ``None`` from :meth:`RoundMode.inner_position`, :meth:`RoundMode.checkpoint_due` and
  :meth:`RoundMode.sync_progress` means "the trainer's own step count decides" (torchtitan's rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torchtitan.config import Configurable

from muloco.outer.exchange.pipeline import Work
from muloco.outer.schedule import SyncSchedule


class RoundMode(Configurable):
    """The interface; ``Lockstep`` and ``DeadlineRounds`` implement it."""

    name: ClassVar[str]

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        name: ClassVar[str]
        """The mode as ``--outer.round NAME`` picks it (also the component's ``name``)."""
        auto_weighting: ClassVar[str] = "equal"
        """What ``--outer.exchange.weighting auto`` means in this mode (equal or tokens)."""
        gathers_work: ClassVar[bool] = False
        """Every sync gathers each replica's work record (steps, seconds), whatever the weighting."""

        def validate(self) -> None:
            pass

        def validate_outer(self, schedule: SyncSchedule) -> None:
            """Refuse an outer loop this mode cannot run (one clear message naming the settings)."""

    def __init__(
        self,
        config: Config,
        *,
        schedule: SyncSchedule,
        total_steps: int = 0,
        groups: int = 1,
        group: int = 0,
        device: torch.device | None = None,
    ):
        """``schedule``: the loop's sync schedule (H, fragments, τ); ``total_steps``: the run's length in
        inner steps; ``groups``: the job's replica groups, ``group`` this one; ``device``: the training
        device. A mode keeps what it needs."""
        self.config = config
        self.schedule = schedule

    # ------------------------------------------------------------ each step
    def step_trained(self, step: int, started: float) -> bool:
        """Count trainer step ``step`` (begun at ``started``, ``time.perf_counter``); True: prepare a sync now."""
        raise NotImplementedError

    def perform_due(self, step: int) -> bool:
        """Perform the open sync after trainer step ``step`` (also asked after a heal moved the step)."""
        raise NotImplementedError

    def step_ended(self, step: int) -> None:
        """The step's syncs are done (``step``: the trainer step after them, a heal may have moved it)."""

    def start_round(self) -> None:
        """Begin a round afresh (the loop starts, or a heal moved the run)."""

    # ------------------------------------------------------------ the sync
    def work(self, tokens: float, contributes: bool, group: int) -> Work:
        """This replica's work record for the sync being prepared (``tokens`` trained since the last)."""
        return Work(tokens=tokens if contributes else 0, group=group)

    def round_steps(self, work: Work) -> int | None:
        """The inner steps a sync's record reports for this group's round (None: not recorded)."""
        return None

    def position(self, step: int) -> float:
        """Where a sync ending at trainer step ``step`` stands on the run's outer schedules (the same on
        every replica)."""
        raise NotImplementedError

    def commit(self, records: list[list[float]]) -> None:
        """A committed sync's work records (one row per replica), the same on every replica."""

    def sync_progress(self) -> float | None:
        """The run's progress a sync record reports (None: the trainer step says it)."""
        return None

    # ------------------------------------------------------------ the run
    def inner_position(self) -> float | None:
        """Where the next inner step stands on the inner lr schedule (None: the trainer's own count)."""
        return None

    def validation_due(self, step: int, freq: int) -> bool:
        """Validate θ_g after trainer step ``step`` (``freq``: the validator's interval)."""
        raise NotImplementedError

    def checkpoint_due(self, step: int, interval: int) -> bool | None:
        """Save after trainer step ``step`` (None: torchtitan's every-``interval``-steps rule)."""
        return None

    def saves_at_end(self) -> bool:
        """The run saves when it ends (a mode with save points of its own: torchtitan's last-step save
        counts the trainer step); False: torchtitan's last-step save."""
        return False

    def boundary(self, step: int) -> tuple[int, int] | None:
        """(boundary, spacing) where every group may stop together after trainer step ``step``; None
        mid-round."""
        raise NotImplementedError

    def steps_left(self, trainer_rule: bool) -> bool:
        """Whether the run trains on (``trainer_rule``: torchtitan's answer from the trainer step)."""
        return trainer_rule

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """What travels and persists with θ_g (empty: nothing; the checkpoint then has no entry)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def describe(self, steps: int) -> dict[str, Any]:
        """The summary's ``round`` entry (``steps``: the inner steps this group trained)."""
        return {"mode": self.name}
