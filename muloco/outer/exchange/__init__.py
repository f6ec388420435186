"""The exchange of pseudo-gradients between replica groups (see ``exchange.py``).

``layout`` (streams and buckets of a fragment), ``strategies`` (all-reduce, all-gather,
reduce-scatter), ``bucket`` (one bucket as a strategy sees it: all it asks of a sync),
``pipeline`` (one sync in flight: buckets, overlap, memory and time), ``collectives`` (what
the torchft Manager does not offer), ``link`` (an emulated slow link between replica groups,
``--outer.link.mbps``).
"""

from muloco.outer.exchange.exchange import Exchange
from muloco.outer.exchange.pipeline import PARTS, PendingExchange
from muloco.outer.exchange.strategies import AllGather, AllReduce, ReduceScatter, Strategy

__all__ = ["PARTS", "AllGather", "AllReduce", "Exchange", "PendingExchange", "ReduceScatter", "Strategy"]
