"""The semi-synchronous outer loop (DiLoCo / streaming DiLoCo) on torchft.

torchft provides membership, quorum, commit and healing; this package owns what
torchtitan's wiring hard-codes: the global parameters, the pseudo-gradient, the
outer optimizer, the exchange and the fragment schedule.
"""

from muloco.outer.exchange import Exchange, PendingExchange
from muloco.outer.loop import OuterLoop
from muloco.outer.optimizer import OuterOptimizer
from muloco.outer.schedule import SyncSchedule, model_fragments

__all__ = [
    "Exchange",
    "OuterLoop",
    "OuterOptimizer",
    "PendingExchange",
    "SyncSchedule",
    "model_fragments",
]
