"""The round mode of the outer loop: lockstep (every group trains H inner steps, then waits for the
slowest) or deadline (each group trains the steps of its own pace that fit in the round).

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
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch
import tyro
from torchtitan.config import Configurable

from muloco.outer.exchange.pipeline import RECORD_FIELDS, Work
from muloco.utils import round_budget


class Lockstep(Configurable):
    """Every group trains H inner steps, then the quorum waits for the slowest (the default). It has
    no state: the outer loop counts a lockstep round in trainer steps (``SyncSchedule``)."""

    name = "lockstep"

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        deadline: ClassVar[bool] = False

        def validate(self) -> None:
            pass

    def __init__(self, config: Config, **_: Any):
        """Nothing to keep (the outer loop builds deadline rounds only): ``build`` works on either variant."""
        self.config = config


class DeadlineRounds(Configurable):
    """Each group trains the inner steps of its own pace that fit in the round (the module docstring)."""

    name = "deadline"

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        deadline: ClassVar[bool] = True
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

    def __init__(self, config: Config, *, sync_every: int, total_steps: int, groups: int, group: int):
        config.validate()
        self.config, self.sync_every, self.total_steps = config, sync_every, total_steps
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

    def work(self, tokens: float, ended: float) -> Work:
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


RoundConfig = (
    Annotated[Lockstep.Config, tyro.conf.subcommand(Lockstep.name)]
    | Annotated[DeadlineRounds.Config, tyro.conf.subcommand(DeadlineRounds.name)]
)
"""``--outer.round lockstep|deadline`` (``muloco/config/variants.py``): a deadline setting is then
``--outer.round.quantile`` and the like, and one given with lockstep rounds is an error."""
