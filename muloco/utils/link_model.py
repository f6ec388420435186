"""The emulated link's arithmetic, in pure Python: one collective's time on a link of given speed.

Shared by the exchange's emulated link (``muloco/outer/exchange/link.py``, which holds each
collective for this long) and the planner (``python -m muloco.model_map --link-mbps``, which
projects a sync from the wire format), so the two agree by construction. Per replica and
collective::

    seconds = max(bytes sent, bytes received) / (mbps · 10⁶ / 8)  +  rounds · latency_ms / 1000

(full duplex: each direction has the bandwidth; ``rounds``: the latency hops the collective
waits in sequence). No torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Transfer:
    """What one collective carries for this replica, and its latency hops."""

    sent: float
    received: float
    rounds: int


def transfer_seconds(t: Transfer, mbps: float, latency_ms: float = 0.0) -> float:
    """One collective's time on the link (0 when nothing crosses it)."""
    if t.sent == 0 and t.received == 0:
        return 0.0
    return max(t.sent, t.received) * 8 / (mbps * 1e6) + t.rounds * latency_ms / 1000


def format_rate(mbps: float) -> str:
    """``100 Mbps``, ``1 Gbps``, ``2.5 Gbps``, ``500 kbps``."""
    if mbps >= 1e3:
        return f"{mbps / 1e3:g} Gbps"
    if mbps >= 1:
        return f"{mbps:g} Mbps"
    return f"{mbps * 1e3:g} kbps"


def parse_rate(text: str) -> float:
    """``100mbps``, ``1gbps``, ``2.5Gbps``, ``500kbps`` → megabits per second (ValueError if not)."""
    t = text.strip().lower().replace(" ", "").replace("/s", "ps")
    for suffix, scale in (("kbps", 1e-3), ("mbps", 1.0), ("gbps", 1e3)):
        if t.endswith(suffix):
            try:
                value = float(t[: -len(suffix)]) * scale
            except ValueError:
                break
            if math.isfinite(value) and value > 0:
                return value
            break
    raise ValueError(
        f"{text!r} is not a link speed: write a positive number and a unit, e.g. 100mbps, 1gbps, 10gbps, 500kbps"
    )
