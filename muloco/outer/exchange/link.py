"""An emulated slow link between replica groups: the exchange held for the time its bytes take.

On one machine (or a fast cluster) every replica group talks over loopback or InfiniBand, so a
run cannot show what a 100 Mbps link between data centres would cost it. With
``--outer.link.mbps B [--outer.link.latency_ms L]`` each collective of the exchange is held,
after it really completes, until the time this model gives it; the training loop is blocked
exactly as it would be (with τ > 0 the exchange runs behind τ inner steps, which hide it up to
their own length). The time is logged as the sync's own part ``link`` and every figure that
includes it is labelled *emulated*.

The model, per replica and per collective (``Transfer``):

    seconds = max(bytes sent, bytes received) / (B / 8 · 10⁶)  +  rounds · L / 1000

- bytes are those the exchange hands its collectives for the *other* replicas (the byte
  accounting of ``strategies.py``): a ring all-reduce of n bytes sends and receives
  2(K−1)/K · n, an all-gather (K−1) · n, an all-to-all what goes to and comes from the others;
- the link is full duplex (each direction has the bandwidth B), so the larger direction counts;
- ``rounds``: the latency hops a collective waits in sequence: 2(K−1) for a ring all-reduce,
  K−1 for a ring all-gather, 1 for an all-to-all (every peer is sent to at once);
- collectives queue on the link: one starts when the previous one has finished (buckets in
  flight overlap their encoding with the link, never with each other's bytes). So while the
  link is the bottleneck a sync takes Σ seconds over its collectives, which is what
  :meth:`Link.seconds` computes from the wire format for the planner
  (``python -m muloco.model_map --link-mbps``);
- real network time is not counted twice: a collective is held until ``issue time + its
  seconds`` (queued), so the time it really took is part of its emulated time, not added to it.

The arithmetic is ``muloco/utils/link_model.py`` (pure Python, shared with the planner); time comes
from a :class:`Clock` (``perf_counter`` and ``sleep``); tests give a fake one.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from torchtitan.config import Configurable

from muloco.utils.link_model import Transfer, format_rate, transfer_seconds


class Clock:
    """The time the link and the sync's parts are measured in: this thread's ``now`` and a
    ``sleep_until``. A worker thread's time starts at ``start_thread(t)`` (no-op here)."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep_until(self, deadline: float) -> None:
        delay = deadline - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def start_thread(self, at: float) -> None:
        """Called first on a worker thread started at ``at`` (the caller's clock)."""


class Link(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        mbps: float = 0.0
        """Emulated bandwidth between replica groups in megabits per second, each direction
        (0: off, the exchange runs at the speed of the real network)."""
        latency_ms: float = 0.0
        """Emulated one-way latency per round of a collective, in milliseconds (needs ``mbps``)."""

        @property
        def enabled(self) -> bool:
            return self.mbps > 0

        def validate(self) -> None:
            for name, value in (("mbps", self.mbps), ("latency_ms", self.latency_ms)):
                if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                    raise ValueError(
                        f"outer.link.{name} must be a finite number >= 0, got {value!r} "
                        "(e.g. --outer.link.mbps 100 --outer.link.latency_ms 50)"
                    )
            if self.latency_ms > 0 and self.mbps == 0:
                raise ValueError(
                    f"outer.link.latency_ms {self.latency_ms:g} needs an emulated bandwidth: "
                    "set --outer.link.mbps too (0 turns the emulated link off)"
                )

        def describe(self) -> str:
            if not self.enabled:
                return "real network"
            latency = f", {self.latency_ms:g} ms per round" if self.latency_ms else ""
            return f"emulated link {format_rate(self.mbps)}{latency}"

    def __init__(self, config: Config, *, clock: Clock | None = None):
        config.validate()
        self.config = config
        self.clock = clock or Clock()

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def transfer_seconds(self, t: Transfer) -> float:
        """The emulated time of one collective (0 when the link is off or nothing crosses it)."""
        if not self.enabled:
            return 0.0
        return transfer_seconds(t, self.config.mbps, self.config.latency_ms)

    def seconds(self, transfers: list[Transfer]) -> float:
        """A sync's emulated time while the link is its bottleneck: the collectives queue."""
        return sum(self.transfer_seconds(t) for t in transfers)

    def session(self) -> "LinkSession":
        """The link's queue for one sync."""
        return LinkSession(self)


class LinkSession:
    """One sync's collectives on the link: each queued behind the previous one."""

    def __init__(self, link: Link):
        self.link = link
        self.clock = link.clock
        self.free_at = -math.inf
        self._lock = threading.Lock()

    def reserve(self, transfer: Transfer) -> float | None:
        """Queue a collective issued now; the time until which it is held (None: not held)."""
        seconds = self.link.transfer_seconds(transfer)
        if seconds <= 0:
            return None
        with self._lock:
            start = max(self.clock.now(), self.free_at)
            self.free_at = start + seconds
            return self.free_at

    def hold(self, deadline: float | None) -> None:
        """Block until the collective's emulated end (it has really completed by now)."""
        if deadline is not None:
            self.clock.sleep_until(deadline)


__all__ = ["Clock", "Link", "LinkSession", "Transfer"]
