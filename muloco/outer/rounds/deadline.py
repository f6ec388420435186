"""Deadline rounds: each replica group trains the inner steps of its own pace that fit in the round
(``--outer.round deadline``), for groups of unequal speed.

In a deadline round (``muloco/utils/round_budget.py`` has the arithmetic, shared with the planner)
every group's budget H_i comes from the step times the quorum has agreed: each sync gathers a work
record from every replica (its group, the inner steps and tokens it trained this round, and the
seconds they took: ``exchange/pipeline.py``), and on a committed sync every replica folds the same
records into the same state here — each group's pace (an average of its recent seconds per step),
the run's progress in nominal steps (Σ H_i / K per round) and the next round's budgets. Nothing in it
depends on anything one replica alone knows, so budgets agree on every replica and rank, travel to a
healing peer with θ_g, and are saved with it.

The run's progress replaces the trainer step wherever all groups must agree: the outer lr, momentum
and error-feedback β schedules, the inner learning rate (a group at its j-th step of a round of H_i
steps stands at P + j/H_i of the round's planned progress, so every group sweeps the same stretch of
the schedule in the steps it trains), validation, checkpoints, stops and the end of the run
(progress reaching ``training.steps``: the same tokens as a lockstep run of that length).

The first round, and a group whose pace is not known yet, trains H steps (lockstep).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from muloco.outer.exchange.pipeline import RECORD_FIELDS, Work
from muloco.outer.rounds.mode import RoundMode
from muloco.outer.schedule import SyncSchedule
from muloco.utils import round_budget


class DeadlineRounds(RoundMode):
    """Each group trains the inner steps of its own pace that fit in the round (the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoundMode.Config):
        name: ClassVar[str] = "deadline"
        auto_weighting: ClassVar[str] = "tokens"
        """A group's Δ from fewer steps counts less (measured in RUNNING_JOBS.md, "Groups of unequal speed")."""
        gathers_work: ClassVar[bool] = True
        """The paces come from every replica's steps and seconds."""
        quantile: float = 1.0
        """A round lasts H times this quantile of the groups' step times (1: the slowest's; below 1,
        slower groups train fewer than H steps instead of holding up the round)."""
        min_steps: int = 1
        """Fewest inner steps a group trains in a round."""
        max_steps: int = 0
        """Most inner steps a group trains in a round (0: 2H)."""
        pace_memory: float = 0.5
        """Weight of a group's earlier pace against its newest round's (0: the newest only)."""

        def validate(self) -> None:
            if not 0 < self.quantile <= 1:
                raise ValueError(
                    f"outer.round.quantile must be in (0, 1] (1: the slowest group's H steps); got {self.quantile!r}"
                )
            if self.min_steps < 1 or self.max_steps < 0 or (self.max_steps and self.max_steps < self.min_steps):
                raise ValueError(
                    f"outer.round.min_steps {self.min_steps} and max_steps {self.max_steps}: need "
                    f"1 <= min_steps <= max_steps (max_steps 0: twice outer.sync_every)"
                )
            if not 0 <= self.pace_memory < 1:
                raise ValueError(f"outer.round.pace_memory must be in [0, 1); got {self.pace_memory!r}")

        def validate_outer(self, schedule: SyncSchedule) -> None:
            h = schedule.sync_every
            if self.min_steps > (self.max_steps or 2 * h):
                raise ValueError(
                    f"outer.round.min_steps {self.min_steps} is more than a round's most steps, "
                    f"{2 * h} (outer.round.max_steps 0: twice outer.sync_every "
                    f"{h}): lower min_steps, or raise outer.round.max_steps"
                )
            if schedule.num_fragments != 1 or schedule.delay != 0:
                raise ValueError(
                    f"outer.round deadline syncs the whole model at each round's end: it needs "
                    f"outer.num_fragments 1 and outer.fragment_sync_delay 0 (got {schedule.num_fragments} "
                    f"and {schedule.delay}); use lockstep rounds for streaming DiLoCo"
                )

    name = Config.name

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
        config.validate()
        super().__init__(config, schedule=schedule)
        sync_every = schedule.sync_every
        self.sync_every, self.total_steps, self.device = sync_every, total_steps or sync_every, device
        self.group, self.groups = group, max(groups, group + 1)
        self.max_steps = config.max_steps or 2 * sync_every
        self.paces = torch.full((self.groups,), math.nan, dtype=torch.float64)
        """Seconds per inner step of each replica group, as the quorum agreed (NaN: not seen yet)."""
        self.progress = torch.zeros((), dtype=torch.float64)
        """The run's progress in nominal inner steps (committed rounds)."""
        self.rounds = torch.zeros((), dtype=torch.int64)
        """Committed rounds."""
        self.budgets: dict[int, int] = {}
        """This round's inner steps per group (planned on every replica alike); unknown groups: H."""
        self.steps_done = 0
        """Inner steps this group has trained in the current round."""
        self._timed_from: float | None = None
        """When this round's first timed step started (``time.perf_counter``): a round's time runs from
        there to the end of its last step, so syncs, validation and saves (between rounds) stay out."""
        self._untimed = 0
        """Steps of this round left out of its time: a process's first step (warm-up, compilation)."""
        self._warm = False
        self._round_end = 0.0
        """When this round's last step ended (its sync began)."""
        self._over_from: float | None = None
        """The progress before this round's sync, from the step that trains the budget to the end of
        that step's syncs (``step_ended``); None mid-round."""
        self._last_round: tuple[int, float, float] | None = None
        """The trainer step the last round ended at, and the progress before and after it."""

    # -------------------------------------------------------------- the round
    @property
    def budget(self) -> int:
        return self.budgets.get(self.group, self.sync_every)

    def planned_progress(self) -> float:
        """Nominal steps this round adds if every group trains its budget (the groups in the plan)."""
        plan = list(self.budgets.values()) or [self.sync_every]
        return round_budget.progress(plan)

    def step_done(self, started: float) -> bool:
        """Count one inner step, begun at ``started``; True when this group's round is over (its sync is due)."""
        self.steps_done += 1
        if not self._warm:  # the pace leaves out this process's first step, which also warms up
            self._warm, self._untimed = True, self.steps_done
        elif self._timed_from is None:
            self._timed_from = started
        return self.steps_done >= self.budget

    def timed_work(self, tokens: float, ended: float) -> Work:
        """This round's record (called as the sync starts; its last step ``ended``): the steps, and the
        seconds they took (the timed steps' seconds scaled to all of them when a warm-up step was left out)."""
        seconds = ended - self._timed_from if self._timed_from is not None else 0.0
        timed = self.steps_done - self._untimed
        if 0 < timed < self.steps_done:
            seconds *= self.steps_done / timed
        return Work(tokens=tokens, steps=self.steps_done, seconds=seconds, group=self.group)

    def inner_position(self) -> float:
        """Where this group stands on the run's schedules after ``steps_done`` steps of the round."""
        return float(self.progress) + self.steps_done / self.budget * self.planned_progress()

    def position_after_round(self) -> float:
        """The schedules' position at this round's sync (the same on every replica)."""
        return float(self.progress) + self.planned_progress()

    @property
    def finished(self) -> bool:
        return float(self.progress) >= self.total_steps - 1e-9

    # -------------------------------------------------------------- the loop's questions (``mode.py``)
    def step_trained(self, step: int, started: float) -> bool:
        """The sync (prepared and performed at once) when this group's budget is trained."""
        if not self.step_done(started):
            return False
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the round's last kernels are part of its time (Δ waits anyway)
        self._round_end = time.perf_counter()
        self._over_from = float(self.progress)
        return True

    def perform_due(self, step: int) -> bool:
        """Always right after the prepare (no overlap: the round's end is its sync)."""
        return True

    def step_ended(self, step: int) -> None:
        if self._over_from is not None:
            self.start_round()
            self._last_round = (step, self._over_from, float(self.progress))
            self._over_from = None

    def work(self, tokens: float, contributes: bool, group: int) -> Work:
        """Its steps and their seconds, the paces the budgets come from (nothing from a replica that
        does not contribute)."""
        return self.timed_work(tokens, self._round_end) if contributes else Work(tokens=0, group=group)

    def round_steps(self, work: Work) -> int | None:
        return work.steps

    def position(self, step: int) -> float:
        return self.position_after_round()

    def sync_progress(self) -> float | None:
        return float(self.progress)

    def validation_due(self, step: int, freq: int) -> bool:
        """After the round that ended at ``step`` when its progress passed a multiple of ``freq``."""
        return self._crossed(step, freq)

    def checkpoint_due(self, step: int, interval: int) -> bool | None:
        """After the round that ended at ``step`` when its progress passed a multiple of ``interval``."""
        return self._crossed(step, interval)

    def saves_at_end(self) -> bool:
        """A group's step count says nothing of the run's end."""
        return True

    def boundary(self, step: int) -> tuple[int, int] | None:
        """The committed rounds, after the step a round ended at."""
        ended = self._last_round is not None and self._last_round[0] == step
        return (int(self.rounds), 1) if ended else None

    def steps_left(self, trainer_rule: bool) -> bool:
        """Until the shared progress reaches the run's steps (groups train different step counts)."""
        return not self.finished

    def describe(self, steps: int) -> dict[str, Any]:
        return {"mode": self.name, "rounds": int(self.rounds), "progress": float(self.progress), "steps": steps}

    def _crossed(self, step: int, every: int) -> bool:
        if self._last_round is None or self._last_round[0] != step:
            return False
        _, before, after = self._last_round
        return math.floor(after / every + 1e-9) > math.floor(before / every + 1e-9)

    # -------------------------------------------------------------- the sync
    def commit(self, records: list[list[float]]) -> None:
        """Fold a committed sync's records (one row per replica: ``RECORD_FIELDS``) into the paces,
        the progress and the next round's budgets: the same numbers on every replica."""
        rows = [dict(zip(RECORD_FIELDS, row)) for row in records]
        trained = [r for r in rows if r["flag"] == 1 and r["steps"] > 0]
        keep = self.config.pace_memory
        for r in trained:
            g, pace = int(r["group"]), r["seconds"] / r["steps"]
            if g >= self.groups:
                continue
            old = float(self.paces[g])
            self.paces[g] = pace if math.isnan(old) else keep * old + (1 - keep) * pace
        if trained:
            self.progress += round_budget.progress([int(r["steps"]) for r in trained])
        self.rounds += 1
        self.plan_next([int(r["group"]) for r in rows])

    def plan_next(self, members: list[int]) -> None:
        """Budgets of the next round for the groups of the last quorum whose pace is known."""
        known = sorted(g for g in set(members) if g < self.groups and not math.isnan(float(self.paces[g])))
        budgets = {}
        if known:
            steps = round_budget.budgets(
                self.sync_every,
                [float(self.paces[g]) for g in known],
                self.config.quantile,
                self.config.min_steps,
                self.max_steps,
            )
            steps = round_budget.last_round(steps, float(self.progress), self.total_steps)
            budgets = dict(zip(known, steps))
        self.budgets = budgets

    def start_round(self) -> None:
        self.steps_done, self._untimed, self._timed_from = 0, 0, None

    # -------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        budgets = torch.full((self.groups,), -1, dtype=torch.int64)
        for g, b in self.budgets.items():
            budgets[g] = b
        return {"paces": self.paces, "progress": self.progress, "rounds": self.rounds, "budgets": budgets}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.paces.copy_(state["paces"])
        self.progress.copy_(state["progress"])
        self.rounds.copy_(state["rounds"])
        self.budgets = {g: int(b) for g, b in enumerate(state["budgets"].tolist()) if b >= 0}
        self.start_round()
