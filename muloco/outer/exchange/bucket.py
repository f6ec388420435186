"""One bucket as a strategy sees it: all that passes between ``strategies.py`` and ``pipeline.py``.

A sync (``pipeline.Sync``) hands its strategy a :class:`BucketContext` for each bucket. Through it
the strategy encodes this replica's Δ (with the sync's error feedback), issues collectives on the
quorum's process group, reads the senders' headers and averages the contributors' rows into the
bucket's ``out``. It yields each :class:`Collective`, which carries the bytes it puts on the wire,
and returns what the bucket learned of the quorum (:class:`Averaged`); the pipeline counts the
bytes, holds each collective on the emulated link and records what was learned. So a strategy
reads and writes nothing of the sync, and the sync's accounting happens in one place.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from muloco.compress import Codec, ErrorFeedback
from muloco.compress.packing import from_bytes
from muloco.outer.exchange import collectives
from muloco.outer.exchange.layout import Bucket

HEADER_BYTES = 5
"""Each payload starts with its sender's flag (1: contributes, 0: sends zeros) and the
sender's quorum time in seconds (float32), from which the time spent waiting for the
slowest replica is told apart from the quorum's own cost."""


@dataclass
class Job:
    """One bucket of one stream: where its Δ is, where its average goes, how it is encoded."""

    bucket: Bucket
    codec: Codec
    delta: torch.Tensor
    out: torch.Tensor
    feedback: ErrorFeedback | None
    key: str
    encoded: bool = False
    """Its error-feedback residual was replaced (the sync's rollback restores it)."""

    @property
    def numel(self) -> int:
        return self.bucket.numel


@dataclass(frozen=True)
class Traffic:
    """Bytes of one collective: this replica's payload in it, and what it sends to and receives
    from the other replicas."""

    payload: int = 0
    sent: float = 0
    received: float = 0


@dataclass(frozen=True)
class Collective:
    """A collective in flight and its traffic, in issue order (a sync-wide collective issued with
    it first: the contributor count rides on the link with the bucket that issued it)."""

    pending: Any
    """What the collective returned: its ``wait()`` returns once it is done."""
    traffic: tuple[Traffic, ...]

    def wait(self) -> None:
        self.pending.wait()


@dataclass(frozen=True)
class Senders:
    """The K senders' headers of one bucket, in quorum rank order."""

    flags: list[int]
    quorum_seconds: list[float]


@dataclass(frozen=True)
class Averaged:
    """What a bucket learned of the quorum, for the sync to record."""

    contributors: int | None = None
    """Replicas whose Δ is in the average; None: the bucket did not count them (a weighted sync's
    work records did)."""
    quorum_seconds: list[float] | None = None
    """Each sender's quorum time, from the headers (None: the strategy sends none)."""


class ContributorCount:
    """A sync's one count of its contributors: a one-element all-reduce of the flags, issued by the
    first bucket that asks (its bytes ride with that bucket's collective); ``value`` waits for it."""

    def __init__(self, manager: Any, contributes: bool, device: torch.device, k: int):
        self.manager, self.contributes, self.device, self.k = manager, contributes, device, k
        self.flag: torch.Tensor | None = None
        self.work = None

    def issue(self) -> Traffic | None:
        """Issue the all-reduce unless a bucket did already; its bytes if it is issued now."""
        if self.work is not None:
            return None
        self.flag = torch.full((1,), 1.0 if self.contributes else 0.0, device=self.device)
        self.work = collectives.all_reduce(self.manager, self.flag)
        ring = 2 * (self.k - 1) / self.k * 4
        return Traffic(payload=4, sent=ring, received=ring)

    def value(self) -> int:
        self.work.wait()
        return int(self.flag.round().item())


@dataclass(frozen=True)
class Quorum:
    """What every bucket of one sync shares: the quorum, this replica's place and weight in it, and
    the sync's instruments (its part timer and its memory tally)."""

    manager: Any
    k: int
    rank: int
    contributes: bool
    quorum_seconds: float
    device: torch.device
    weights: list[float] | None
    """A weighted sync's weight per quorum rank (None: the plain mean)."""
    count: ContributorCount | None
    """The contributor count (None in a weighted sync: its work records count them)."""
    timer: Callable[[str], contextlib.AbstractContextManager]
    track: Callable[[torch.Tensor], torch.Tensor]


class BucketContext:
    """One bucket as its strategy sees it: encode, issue, count, average (see the module docstring).

    ``codec``, ``numel`` and ``out`` (where the bucket's average goes) are the bucket's; ``k``,
    ``rank`` and ``weights`` the quorum's; ``timer(part)`` times a part of the sync and ``track``
    registers a buffer with the sync's memory tally."""

    def __init__(self, job: Job, quorum: Quorum):
        self._job, self._quorum = job, quorum
        self.codec, self.numel, self.out = job.codec, job.numel, job.out
        self.fed = job.feedback is not None
        """Error feedback applies to this bucket (its payload is encoded from Δ plus the residual)."""
        self.k, self.rank, self.weights = quorum.k, quorum.rank, quorum.weights
        self.timer, self.track = quorum.timer, quorum.track
        self._riders: list[Traffic] = []
        """Bytes of sync-wide collectives issued since this bucket's last one (they ride with its next)."""

    def failed(self) -> bool:
        """A collective of the quorum failed: the buffers hold garbage, nothing will be committed."""
        return self._quorum.manager.errored() is not None

    # ------------------------------------------------------------------ encode

    def encode(self, codec: Codec | None = None) -> torch.Tensor:
        """This replica's payload for the bucket in ``codec`` (default: the bucket's), zeros if it
        does not contribute; with error feedback the residual piece it replaces is kept in Δ's
        buffer for a rollback."""
        job, codec = self._job, codec or self.codec
        if not self._quorum.contributes:  # a healed replica adds nothing and must not feed its buffer
            return self.track(codec.encode(torch.zeros_like(job.delta)))
        if job.feedback is None:
            return self.track(codec.encode(job.delta))
        job.encoded = True
        return self.track(job.feedback.compress(job.key, job.delta, codec, offset=job.bucket.start, keep=job.delta))

    def summand(self) -> torch.Tensor:
        """This replica's Δ in its own buffer, for a lossless sum in place: zeroed if it does not
        contribute, scaled by its weight in a weighted sync."""
        delta, weights = self._job.delta, self.weights
        if not self._quorum.contributes:  # a healed replica adds nothing
            delta.zero_()
        elif weights is not None and weights[self.rank] != 1.0:
            delta.mul_(weights[self.rank])
        return delta

    def header(self) -> torch.Tensor:
        """This replica's header (``HEADER_BYTES``), sent ahead of its payload."""
        flag = torch.tensor([1 if self._quorum.contributes else 0], dtype=torch.uint8)
        seconds = torch.tensor([self._quorum.quorum_seconds], dtype=torch.float32).view(torch.uint8)
        return torch.cat([flag, seconds]).to(self._quorum.device)

    # ------------------------------------------------------------------- issue

    def all_reduce(self, buf: torch.Tensor) -> Collective:
        """Sum ``buf`` (this replica's payload) over the quorum, in place: a ring, 2(K−1)/K × it each way."""
        work = collectives.all_reduce(self._quorum.manager, buf)
        nbytes = buf.numel() * buf.element_size()
        ring = 2 * (self.k - 1) / self.k * nbytes
        return self._issued(work, Traffic(payload=nbytes, sent=ring, received=ring))

    def all_gather(self, buf: torch.Tensor) -> tuple[torch.Tensor, Collective]:
        """Every replica's ``buf`` (this replica's payload) as the rows of a (K, size) buffer."""
        gathered = self.track(buf.new_empty(self.k, buf.numel()))
        fut = collectives.all_gather(self._quorum.manager, gathered, buf)
        nbytes = buf.numel() * buf.element_size()
        others = (self.k - 1) * nbytes
        return gathered, self._issued(fut, Traffic(payload=nbytes, sent=others, received=others))

    def all_to_all(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], *, payload: bool
    ) -> tuple[torch.Tensor, Collective]:
        """``send`` cut by ``send_splits`` to ranks 0..K−1; what arrives, cut by ``recv_splits``.
        ``payload``: ``send`` is this replica's payload (not a relay of what others sent)."""
        recv, fut = collectives.all_to_all(self._quorum.manager, send, send_splits, recv_splits)
        self.track(recv)
        size, me = send.element_size(), self.rank
        traffic = Traffic(
            payload=send.numel() * size if payload else 0,
            sent=(send.numel() - send_splits[me]) * size,
            received=(recv.numel() - recv_splits[me]) * size,
        )
        return recv, self._issued(fut, traffic)

    def _issued(self, pending: Any, traffic: Traffic) -> Collective:
        riders, self._riders = self._riders, []
        return Collective(pending, (*riders, traffic))

    # ------------------------------------------------------------------- count

    def contributor_count(self) -> ContributorCount | None:
        """The sync's count of contributors, issued with this bucket's next collective if no bucket
        has asked before; None in a weighted sync (its work records counted them)."""
        count = self._quorum.count
        if count is not None:
            traffic = count.issue()
            if traffic is not None:
                self._riders.append(traffic)
        return count

    # ----------------------------------------------------------------- average

    def read_headers(self, headers: torch.Tensor) -> Senders:
        """The K senders' flags and quorum times (``headers``: (K, HEADER_BYTES))."""
        rows = headers.cpu()
        return Senders(rows[:, 0].tolist(), from_bytes(rows[:, 1:], torch.float32).view(-1).tolist())

    def average(
        self, out: torch.Tensor, rows: torch.Tensor, senders: Senders, codec: Codec, payloads: torch.Tensor
    ) -> Averaged:
        """``out`` ← the codec's mean over the contributing rows of ``rows`` (K, m), decoded from
        ``payloads`` (K, bytes), bitwise the same on every replica; zeros if none contributes."""
        chosen = [j for j, f in enumerate(senders.flags) if f == 1]
        averaged = Averaged(len(chosen), senders.quorum_seconds)
        if not chosen:
            out.zero_()
            return averaged
        if len(chosen) < rows.shape[0]:
            rows, payloads = rows[chosen], payloads[chosen]
        weights = None if self.weights is None else [self.weights[j] for j in chosen]
        codec.mean_into(out, rows, payloads, weights)
        return averaged
