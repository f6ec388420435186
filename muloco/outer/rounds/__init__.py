"""Round modes of the outer loop (``--outer.round NAME``): the interface the loop asks
(``mode.py``), lockstep rounds (the default) and deadline rounds for groups of unequal speed."""

from __future__ import annotations

from typing import Annotated

import tyro

from muloco.outer.rounds.deadline import DeadlineRounds
from muloco.outer.rounds.lockstep import Lockstep
from muloco.outer.rounds.mode import RoundMode

__all__ = ["DeadlineRounds", "Lockstep", "RoundConfig", "RoundMode"]

RoundConfig = (
    Annotated[Lockstep.Config, tyro.conf.subcommand(Lockstep.name)]
    | Annotated[DeadlineRounds.Config, tyro.conf.subcommand(DeadlineRounds.name)]
)
"""``--outer.round lockstep|deadline`` (``muloco/config/variants.py``): a deadline setting is then
``--outer.round.quantile`` and the like, and one given with lockstep rounds is an error. A new mode
is a module here and a member of this union."""
