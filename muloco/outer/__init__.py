"""The semi-synchronous outer loop (DiLoCo / streaming DiLoCo) on torchft.

torchft provides membership, quorum, commit and healing; this package owns what
torchtitan's wiring hard-codes: the global parameters, the pseudo-gradient, the
outer optimizer, the exchange and the fragment schedule.

The names below are imported when first used, so a reader of one submodule (the link
planner reads ``outer.exchange``'s wire format) does not pay for torchft and the loop.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "Exchange": "muloco.outer.exchange",
    "PendingExchange": "muloco.outer.exchange",
    "OuterLoop": "muloco.outer.loop",
    "OuterOptimizer": "muloco.outer.optimizer",
    "SyncSchedule": "muloco.outer.schedule",
    "model_fragments": "muloco.outer.schedule",
}

__all__ = sorted(_WHERE)

if TYPE_CHECKING:
    from muloco.outer.exchange import Exchange, PendingExchange  # noqa: F401 - for type checkers: the names load lazily (__getattr__)
    from muloco.outer.loop import OuterLoop  # noqa: F401 - for type checkers: the names load lazily (__getattr__)
    from muloco.outer.optimizer import OuterOptimizer  # noqa: F401 - for type checkers: the names load lazily (__getattr__)
    from muloco.outer.schedule import SyncSchedule, model_fragments  # noqa: F401 - for type checkers: the names load lazily (__getattr__)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'muloco.outer' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
