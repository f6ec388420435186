"""One sync's exchange in flight: buckets through encode → collective → decode/average.

The outer loop writes Δ into the fragment's stream buffers (``layout.py``) and starts a
:class:`Sync`. A worker thread then takes the buckets through the strategy's stages: a
strategy's ``run`` is a generator per bucket that encodes, yields the collective it
issued, and on resumption decodes and averages (a reduce-scatter yields twice: its second
phase is issued the moment its first one completes). It is handed a ``bucket.BucketContext``,
not the sync: each collective it yields carries its bytes, which the worker counts, and what
it returns (contributors, the peers' quorum times) the worker records. The worker keeps
``depth`` buckets in flight: bucket b+1 is encoded while bucket b's collective runs (gloo
works on its own threads; on CUDA the worker runs on a side stream), and with τ > 0 the
whole exchange, both reduce-scatter phases included, proceeds while the training loop runs.
Every replica issues the same collectives in the same order (same buckets, same schedule).

Memory: Δ's buffers (n float32; with error feedback they then hold the residuals each
bucket replaced, for a rollback) and, with error feedback, the average's buffers (n
float32), plus about ``depth`` buckets of payloads, gathered payloads and decoded rows:
O(n) + O(K · bucket), never O(K · n). ``peak_extra_bytes`` is the peak of the buffers
the sync holds, counted where they are allocated and released (the codecs' short-lived
temporaries, a few buckets' worth, are not in it).

Time: the parts of the blocked time are measured where they happen (quorum, Δ, commit,
outer step, pull on the caller's side; encode, collective, link, decode on the worker's). The
worker's time counts only where the caller waits for it: its intervals are intersected
with the caller's wait, so the parts add up to the blocked time (the rest is ``other``).
With an emulated link (``link.py``) each collective is held after it completes until its
emulated end; that hold is the part ``link``, and what τ inner steps overlap of it is hidden
exactly as the real collective would be. Times come from the link's clock.

Weighted syncs (``--outer.exchange.weighting tokens``, or ``auto`` in deadline rounds): before any bucket every replica
all-gathers its work record (flag, tokens trained since its last sync); each contributor's Δ
then enters the average with the weight :func:`work_weights` gives it, the same numbers on
every replica. Where every contributor did the same work the weights are all 1.0 and the
average is the plain one, bit for bit.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from muloco.compress import Codec, ErrorFeedback, Pieces
from muloco.outer.exchange import collectives
from muloco.outer.exchange.bucket import Averaged, BucketContext, ContributorCount, Job, Quorum, Traffic
from muloco.outer.exchange.layout import FragmentLayout
from muloco.outer.exchange.link import Clock, Link, Transfer

RECORD_FIELDS = ("flag", "tokens", "steps", "seconds", "group")
RECORD_BYTES = 8 * len(RECORD_FIELDS)
"""A sync's work record, one per replica, gathered before any bucket (weighted syncs, and deadline
rounds): its flag, and the tokens and inner steps its group trained since its last sync, the
seconds they took and the group's id, float64 each."""


def record_bytes(k: int) -> dict[str, float]:
    """What gathering the work records costs one of ``k`` replicas: its record, sent to and
    received from each of the others."""
    return {"payload": RECORD_BYTES, "sent": (k - 1) * RECORD_BYTES, "received": (k - 1) * RECORD_BYTES}


@dataclass(frozen=True)
class Work:
    """What a replica trained since its last sync, as it reports it in the sync's record."""

    tokens: float
    steps: int = 0
    seconds: float = 0.0
    group: int = 0


WEIGHT_GRID = 2**16
"""Weights are multiples of 1/WEIGHT_GRID (see :func:`work_weights`)."""

PARTS = (
    "quorum",
    "cut_off",
    "wait_slowest",
    "queued",
    "pseudo_gradient",
    "encode",
    "collective",
    "link",
    "decode",
    "commit",
    "outer_step",
    "pull",
    "other",
)
"""The blocked time of a sync, part by part (``cut_off`` is the part of the quorum this group could
not reach the lighthouse: cut off, not waiting; ``wait_slowest`` the part spent
waiting for the last replica to arrive, where the strategy carries the headers to tell;
``link`` the emulated link's hold, 0 without one; ``queued`` the device work queued before each
part, with device timing only)."""
TIMINGS = ("host", "device")


class Tally:
    """Bytes of the tensors registered with :meth:`track` that are still alive, and their peak."""

    def __init__(self):
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()

    def track(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = t.numel() * t.element_size()
        with self._lock:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._release, nbytes)
        return t

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes


class PartTimer:
    """Intervals of named work on one thread; attributed later to a window of another.

    With ``settle`` (device timing) each part first waits for the device work queued before it
    (a ``queued`` interval) and ends when its own kernels have run: the parts then hold their
    device time, not the time the host happened to block in them (on CUDA a host-timed part
    absorbs every kernel queued before its first wait). A ``collective`` part does not wait
    first: what is queued before it is the collective it waits for. Settling waits for every
    stream, so with τ > 0 the training kernels that run meanwhile land in ``queued``, and it
    serialises the sync's overlap: it is for finding where a sync's time goes, not for timing
    training."""

    def __init__(self, clock: Clock | None = None, settle: Callable[[], None] | None = None):
        self.clock = clock or Clock()
        self.settle = settle
        self.segments: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def __call__(self, part: str):
        if part != "collective":  # the queue before a collective's wait is that collective
            self.wait_queued()
        start = self.clock.now()
        try:
            yield
        finally:
            if self.settle is not None:
                self.settle()
            self.segments.append((part, start, self.clock.now()))

    def wait_queued(self) -> None:
        """With device timing: wait for the queued device work, as a ``queued`` interval."""
        if self.settle is not None:
            start = self.clock.now()
            self.settle()
            self.segments.append(("queued", start, self.clock.now()))

    def within(self, start: float, end: float) -> dict[str, float]:
        out: dict[str, float] = collections.defaultdict(float)
        for part, a, b in self.segments:
            overlap = min(b, end) - max(a, start)
            if overlap > 0:
                out[part] += overlap
        return out


class PendingExchange:
    """An exchange in flight; ``wait`` gives the averaged pseudo-gradients (per tensor)."""

    bytes_sent: float = 0
    bytes_received: float = 0
    payload_bytes: int = 0
    """Size of this replica's encoded Δ (headers included)."""
    dense_fp32_bytes: float = 0
    """What a dense fp32 ring all-reduce of the same Δ would carry each way, for comparison."""
    contributors: int = 0
    """Replicas whose Δ is in the average (known after ``wait``)."""
    peak_extra_bytes: int = 0
    times: dict[str, float]
    weights: list[float] | None = None
    """A weighted sync's weight per quorum rank (known after ``wait``); None: the plain mean."""
    works: list[float] | None = None
    """A weighted sync's work (tokens) per quorum rank, as each reported it."""
    rank: int = 0
    """This replica's quorum rank (its index in ``weights`` and ``works``)."""
    records: list[list[float]] | None = None
    """Every replica's work record (``RECORD_FIELDS``, by quorum rank), when the sync gathered them."""

    def wait(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def rollback(self) -> None:
        """The sync did not commit: undo any replica-local state change it made."""

    def wait_for_slowest(self) -> float | None:
        """Seconds of this replica's quorum spent waiting for the last replica, if known."""
        return None


@dataclass(frozen=True)
class Plan:
    """What every sync of one fragment shares: made once by the exchange."""

    layout: FragmentLayout
    strategy: Any
    codecs: dict[str, Codec]
    """Per stream (layout.COMPRESSED, layout.DENSE)."""
    feedback: ErrorFeedback
    bucket_numel: int
    depth: int
    """Buckets in flight."""
    device: torch.device
    link: Link
    """The emulated link (off by default: nothing is held)."""
    timing: str = "host"
    """host: parts are the host's blocked time; device: each part waits for its kernels
    (:class:`PartTimer`)."""


def work_weights(flags: list[float], work: list[float]) -> list[float]:
    """Each replica's weight in a weighted average: its work over the most any contributor did,
    rounded to a multiple of 1/WEIGHT_GRID (at least one step of it for work > 0), so that
    every sum of up to 256 weights is exact in float32 and no kernel's order of addition can
    make replicas differ; 0 for a replica that does not contribute. All contributors with equal
    work (or none with any) get 1.0."""
    most = max((w for f, w in zip(flags, work) if f == 1), default=0.0)
    if most <= 0:
        return [1.0 if f == 1 else 0.0 for f in flags]
    return [
        0.0 if f != 1 else 0.0 if w <= 0 else max(1, round(w / most * WEIGHT_GRID)) / WEIGHT_GRID
        for f, w in zip(flags, work)
    ]


class Sync(PendingExchange):
    """One sync of one fragment, from Δ to the average (see the module docstring)."""

    def __init__(
        self,
        plan: Plan,
        manager: Any,
        fill: Callable[[list[torch.Tensor]], None],
        *,
        contributes: bool,
        quorum_seconds: float,
        work: Work | None = None,
        weighted: bool = False,
    ):
        self.manager, self.plan, self.strategy, self.device = manager, plan, plan.strategy, plan.device
        self.contributes, self.quorum_seconds = contributes, quorum_seconds
        self.work = work
        """What this replica trained since its last sync, gathered from every
        replica before the buckets when given (None: no records)."""
        self.weighted = weighted
        """The average weighs each contributor by its tokens (``work_weights``): the exchange's
        decision (its ``weighted``), which needs the work records."""
        if weighted and work is None:
            raise ValueError("a weighted sync needs this replica's work (its record carries the weight)")
        self.k, self.rank = collectives.group_size(manager), collectives.group_rank(manager)
        self.clock = plan.link.clock
        self.link = plan.link.session()
        self._unsent = [0.0, 0.0]
        """Bytes counted since the last collective was put on the link (sent, received)."""
        settle = (
            (lambda: torch.cuda.synchronize(self.device))
            if plan.timing == "device" and self.device.type == "cuda"
            else None
        )
        self.tally, self.timer = Tally(), PartTimer(self.clock, settle)
        self.times = {}
        self.peers_quorum_seconds: list[float] | None = None
        self._error: BaseException | None = None
        queued_from = self.clock.now()
        if settle is not None:  # device timing: the last training step's kernels are not Δ's
            settle()
        self._started = started = self.clock.now()
        self._worker_end = started
        self.deltas = {s: self.tally.track(b) for s, b in plan.layout.new_buffers(plan.device).items()}
        with torch.no_grad():  # Δ is data, not part of any graph (the caller may have grad mode on)
            fill(plan.layout.views(self.deltas))
            plan.layout.to_tiles(self.deltas, plan.bucket_numel)  # SparseLoCo's tile layout, if asked
        self.jobs = self._jobs(plan.codecs, plan.feedback, plan.bucket_numel)
        self.dense_fp32_bytes = 2 * (self.k - 1) / self.k * 4 * sum(plan.layout.numel.values())
        if settle is not None:
            settle()
            self.times["queued"] = started - queued_from
        self._streams = _SideStream.after_current(plan.device)
        self._thread = threading.Thread(target=self._work, name="muloco-exchange", daemon=True)
        self._thread.start()
        self.times["pseudo_gradient"] = self.clock.now() - started

    def _jobs(self, codecs: dict[str, Codec], feedback: ErrorFeedback, bucket_numel: int) -> list[Job]:
        """With error feedback, averages go to buffers of their own: Δ's keep the replaced residuals."""
        outs = {}
        for stream, delta in self.deltas.items():
            fed = feedback.applies_to(codecs[stream])
            outs[stream] = self.tally.track(torch.empty_like(delta)) if fed else delta
        jobs = []
        for b in self.plan.layout.buckets(codecs, bucket_numel):
            codec = Pieces(codecs[b.stream], b.pieces) if b.pieces else codecs[b.stream]  # tensor by tensor
            fed = feedback if feedback.applies_to(codec) else None
            jobs.append(
                Job(
                    b,
                    codec,
                    self.deltas[b.stream][b.start : b.end],
                    outs[b.stream][b.start : b.end],
                    fed,
                    f"{self.plan.layout.key}/{b.stream}",
                )
            )
        self.outputs = outs
        return jobs

    # ------------------------------------------------------------------ worker

    def _work(self) -> None:
        self.clock.start_thread(self._started)
        try:
            with self._streams.side(), torch.no_grad():  # grad mode is per thread: off here too
                if self.work is not None:
                    self._gather_records()
                self._schedule()
        except BaseException as err:  # noqa: BLE001 - re-raised by wait() on the caller's thread
            self._error = err
        finally:
            self._streams.record_done()
            self._worker_end = self.clock.now()

    def _gather_records(self) -> None:
        """Every replica's work record, before any bucket (the weights are needed to encode an
        all-reduce's Δ); its bytes ride on the emulated link with the first bucket."""
        w = self.work
        mine = torch.tensor(
            [1.0 if self.contributes else 0.0, float(w.tokens), float(w.steps), float(w.seconds), float(w.group)],
            dtype=torch.float64,
            device=self.device,
        )
        gathered = torch.zeros(self.k, len(RECORD_FIELDS), dtype=torch.float64, device=self.device)
        with self.timer("collective"):
            collectives.all_gather(self.manager, gathered, mine).wait()
        self._count(Traffic(**record_bytes(self.k)))
        if self.failed():
            return
        self.records = gathered.cpu().tolist()  # one copy to the host: the rows are read on it
        flags = [r[RECORD_FIELDS.index("flag")] for r in self.records]
        self.works = [r[RECORD_FIELDS.index("tokens")] for r in self.records]
        if self.weighted:
            self.contributors = sum(1 for f in flags if f == 1)
            self.weights = work_weights(flags, self.works)

    def _schedule(self) -> None:
        """Each bucket's generator runs to its first collective; the oldest in flight is
        resumed once ``depth`` are out (so encoding overlaps the previous collectives)."""
        quorum = self._quorum()
        active: collections.deque[tuple[Iterator, Any]] = collections.deque()
        for job in self.jobs:
            self._advance(active, self.strategy.run(BucketContext(job, quorum)))
            while len(active) >= self.plan.depth:
                self._resume(active)
        while active:
            self._resume(active)

    def _resume(self, active) -> None:
        gen, pending, held_until = active.popleft()
        with self.timer("collective"):
            pending.wait()
        if held_until is not None and not self.failed():
            with self.timer("link"):
                self.link.hold(held_until)
        self._advance(active, gen)

    def _quorum(self) -> Quorum:
        """What the buckets' strategy sees of this sync (after the work records: the weights)."""
        return Quorum(
            manager=self.manager,
            k=self.k,
            rank=self.rank,
            contributes=self.contributes,
            quorum_seconds=self.quorum_seconds,
            device=self.device,
            weights=self.weights,
            count=None if self.weighted else ContributorCount(self.manager, self.contributes, self.device, self.k),
            timer=self.timer,
            track=self.tally.track,
        )

    def _advance(self, active, gen) -> None:
        """Run ``gen`` to its next collective (counted, and queued behind the others, on the link
        too), or to its end (what the bucket learned is recorded)."""
        try:
            collective = next(gen)
        except StopIteration as end:
            if end.value is not None:
                self._record(end.value)
            return
        for traffic in collective.traffic:
            self._count(traffic)
        sent, received = self._unsent
        self._unsent = [0.0, 0.0]
        active.append((gen, collective, self.link.reserve(Transfer(sent, received, self.strategy.rounds(self.k)))))

    def _record(self, averaged: Averaged) -> None:
        """What a bucket learned: the contributors (every bucket counts the same ones) and,
        from the first headers, the peers' quorum times."""
        if averaged.contributors is not None:
            self.contributors = averaged.contributors
        if averaged.quorum_seconds is not None and self.peers_quorum_seconds is None:
            self.peers_quorum_seconds = averaged.quorum_seconds

    def _count(self, traffic: Traffic) -> None:
        """Bytes of a collective being issued (the emulated link carries them with it)."""
        self.bytes_sent += traffic.sent
        self.bytes_received += traffic.received
        self.payload_bytes += traffic.payload
        self._unsent[0] += traffic.sent
        self._unsent[1] += traffic.received

    def failed(self) -> bool:
        """A collective of the quorum failed: the buffers hold garbage, nothing will be committed."""
        return self.manager.errored() is not None

    # ------------------------------------------------------------------ caller

    def wait(self) -> list[torch.Tensor]:
        started = self.clock.now()
        self._thread.join()
        self.clock.sleep_until(self._worker_end)  # a no-op on the real clock: the worker is done
        self._streams.wait_done()
        ended = self.clock.now()
        if self._error is not None:
            raise self._error
        for part, seconds in self.timer.within(started, ended).items():
            self.times[part] = self.times.get(part, 0.0) + seconds
        self.times["other"] = self.times.get("other", 0.0) + max(
            0.0, (ended - started) - sum(self.timer.within(started, ended).values())
        )
        self.peak_extra_bytes = self.tally.peak
        if self.failed():  # the buffers hold garbage; nothing will be committed
            return [torch.zeros(s, device=self.device) for s in self.plan.layout.shapes]
        with torch.no_grad():
            self.plan.layout.from_tiles(self.outputs, self.plan.bucket_numel)
        return self.plan.layout.views(self.outputs)

    def wait_for_slowest(self) -> float | None:
        """Seconds of this replica's quorum spent waiting for the last one to arrive: its
        quorum time minus the fastest replica's (the quorum's own cost), if the headers came."""
        if not self.peers_quorum_seconds:
            return None
        return max(0.0, self.quorum_seconds - min(self.peers_quorum_seconds))

    def rollback(self) -> None:
        """Error-feedback residuals back to what they were before this sync."""
        for job in self.jobs:
            if job.encoded:
                job.feedback.restore(job.key, job.delta, offset=job.bucket.start)
                job.encoded = False


class _SideStream:
    """On CUDA: the worker runs on its own stream, after the caller's work so far (Δ), and
    the caller's stream waits for it at ``wait``. Elsewhere: nothing to order."""

    def __init__(self, device: torch.device, ready):
        self.device = device
        self.ready = ready
        self.stream = torch.cuda.Stream(device) if ready is not None else None
        self.done = torch.cuda.Event() if ready is not None else None

    @classmethod
    def after_current(cls, device: torch.device) -> "_SideStream":
        if device.type != "cuda":
            return cls(device, None)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        return cls(device, ready)

    @contextlib.contextmanager
    def side(self):
        if self.stream is None:
            yield
            return
        self.stream.wait_event(self.ready)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def record_done(self) -> None:
        if self.done is not None:
            self.done.record(self.stream)

    def wait_done(self) -> None:
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)
