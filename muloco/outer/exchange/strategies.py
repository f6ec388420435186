"""How the replicas combine one bucket: all-reduce, all-gather or reduce-scatter.

Each strategy is a torchtitan ``Configurable`` (chosen by its own config class; on the
command line ``--outer.exchange.strategy allreduce|allgather|reduce_scatter``) whose
``run(sync, job)`` is a generator over one bucket: it encodes, issues a collective and
yields it; when the pipeline resumes it (the collective done), it decodes and writes the
bucket's average into ``job.out``. ``bucket_bytes`` gives, from the wire format alone,
what one bucket carries: what the pipeline counts from its buffers (the tests compare).

* ``allreduce`` (dense codecs only: payloads are summed as numbers): one all-reduce per
  bucket in the codec's dtype (float32 in place, in Δ's buffer: no copy), and one
  one-element all-reduce of the flags per sync that counts contributors. Ring traffic
  2(K−1)/K × the buffer each way.
* ``allgather``: every replica receives every payload, decodes the K of them in one call
  and averages the contributors'. Exact with respect to the payloads; (K−1)× the payload.
* ``reduce_scatter``: the bucket is cut into K owner ranges; range j of every payload goes
  to replica j (all-to-all), which decodes, averages and re-encodes it; a second
  all-to-all, issued as soon as the first completes, hands every replica each owner's
  re-encoded range. About 2(K−1)/K × the payload each way whatever K is; the re-encoding
  adds a second, un-fed-back quantization of the average (as MuLoCo simulates). Sparse
  codecs (top-k) are refused: re-encoding the average of K selections keeps one selection's
  worth of coordinates and drops the rest.

A replica that does not contribute (it has just healed) sends zeros with flag 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Iterator

import torch
import tyro
from torchtitan.config import Configurable

from muloco.compress import Codec, Dense, Pieces
from muloco.compress.packing import from_bytes
from muloco.outer.exchange import collectives
from muloco.outer.exchange.layout import ranges
from muloco.outer.exchange.pipeline import HEADER_BYTES, record_bytes

if TYPE_CHECKING:
    from muloco.outer.exchange.pipeline import Job, Sync


class Strategy(Configurable):
    name = "strategy"

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __init__(self, config: Config):
        self.config = config

    def check_codec(self, codec: Codec) -> None:
        """Raise ValueError if this strategy cannot carry ``codec``'s payloads."""

    def run(self, sync: "Sync", job: "Job") -> Iterator:
        raise NotImplementedError

    def rounds(self, k: int) -> int:
        """Latency hops one of this strategy's collectives waits in sequence (``link.py``)."""
        raise NotImplementedError

    def bucket_phases(self, k: int, codec: Codec, numel: int, rank: int = 0) -> list[dict[str, float]]:
        """One bucket of ``numel`` elements, collective by collective (in issue order): this
        replica's payload, and the bytes each collective sends to and receives from the others."""
        raise NotImplementedError

    def bucket_bytes(self, k: int, codec: Codec, numel: int, rank: int = 0) -> dict[str, float]:
        """One bucket of ``numel`` elements: this replica's payload, and the bytes its
        collectives send to and receive from the other replicas."""
        total = {"payload": 0.0, "sent": 0.0, "received": 0.0}
        for phase in self.bucket_phases(k, codec, numel, rank):
            for key, value in phase.items():
                total[key] += value
        return total

    def sync_bytes(self, k: int, rank: int = 0, records: bool = False, weighted: bool = False) -> dict[str, float]:
        """What a sync carries once, beyond its buckets (``records``: the work records; ``weighted``:
        the average weighs them)."""
        if records or weighted:
            return record_bytes(k)
        return {"payload": 0, "sent": 0, "received": 0}


class AllReduce(Strategy):
    name = "allreduce"

    @dataclass(kw_only=True, slots=True)
    class Config(Strategy.Config):
        pass

    def check_codec(self, codec: Codec) -> None:
        if not isinstance(codec, Dense):
            raise ValueError(
                f"allreduce sums payloads as numbers, which only the dense codec's are; "
                f"use allgather or reduce_scatter with {codec.name}"
            )

    def run(self, sync, job):
        """A lossless (float32) bucket is summed in place, in Δ's own buffer; a lossy one is
        encoded (with error feedback) first. Contributors are counted once per sync, by a
        one-element all-reduce of the flags issued with the first bucket; a weighted sync has
        them from its work records, and scales its own Δ by its weight before the sum (lossless
        codecs only: ``Exchange.Config`` refuses a lossy one)."""
        in_place = job.codec.lossless and job.feedback is None
        weights = sync.weights if sync.weighted else None
        with sync.timer("encode"):
            if in_place:
                if not sync.contributes:  # a healed replica adds nothing
                    job.delta.zero_()
                elif weights is not None and weights[sync.rank] != 1.0:
                    job.delta.mul_(weights[sync.rank])
                buf = job.delta
            else:
                buf = sync.tally.track(from_bytes(sync.encode(job, job.codec), job.codec.dtype))
            counter = None if sync.weighted else self._contributor_count(sync)
        work = collectives.all_reduce(sync.manager, buf)
        nbytes = buf.numel() * buf.element_size()
        ring = 2 * (sync.k - 1) / sync.k * nbytes
        sync.count(payload=nbytes, sent=ring, received=ring)
        yield work
        if sync.failed():
            return
        with sync.timer("decode"):
            if counter is not None:
                sync.contributors = counter.value()
            # the contributors, or their weights' sum (exact: see pipeline.work_weights); zeros stay zeros
            total = max(sync.contributors, 1) if weights is None else (sum(weights) or 1.0)
            if in_place:
                job.out.div_(total)
            else:
                job.out.copy_(buf).div_(total)

    @staticmethod
    def _contributor_count(sync) -> "_Count":
        """The sync's contributor count, all-reduced once (with the first bucket that asks)."""
        counter = sync.contributor_count
        if counter is None:
            flag = torch.full((1,), 1.0 if sync.contributes else 0.0, device=sync.device)
            counter = sync.contributor_count = _Count(flag, collectives.all_reduce(sync.manager, flag))
            ring = 2 * (sync.k - 1) / sync.k * 4
            sync.count(payload=4, sent=ring, received=ring)
        return counter

    def rounds(self, k):
        return 2 * (k - 1)

    def bucket_phases(self, k, codec, numel, rank=0):
        payload = codec.payload_bytes(numel)
        ring = 2 * (k - 1) / k * payload
        return [{"payload": payload, "sent": ring, "received": ring}]

    def sync_bytes(self, k, rank=0, records=False, weighted=False):
        once = super().sync_bytes(k, rank, records, weighted)
        if weighted:  # the work records count the contributors
            return once
        ring = 2 * (k - 1) / k * 4
        return {key: value + {"payload": 4, "sent": ring, "received": ring}[key] for key, value in once.items()}


class _Count:
    """A one-element all-reduce of the contributor flags; ``value`` waits for it."""

    def __init__(self, flag: torch.Tensor, work):
        self.flag, self.work = flag, work

    def value(self) -> int:
        self.work.wait()
        return int(self.flag.round().item())


class AllGather(Strategy):
    name = "allgather"

    @dataclass(kw_only=True, slots=True)
    class Config(Strategy.Config):
        pass

    def run(self, sync, job):
        with sync.timer("encode"):
            buf = torch.cat([sync.header(), sync.encode(job, job.codec)])
            gathered = sync.tally.track(buf.new_empty(sync.k, buf.numel()))
        fut = collectives.all_gather(sync.manager, gathered, buf)
        sync.count(payload=buf.numel(), sent=(sync.k - 1) * buf.numel(), received=(sync.k - 1) * buf.numel())
        yield fut
        if sync.failed():
            return
        with sync.timer("decode"):
            flags = sync.read_headers(gathered[:, :HEADER_BYTES])
            rows = sync.tally.track(job.codec.decode(gathered[:, HEADER_BYTES:], job.numel))
            sync.average_into(job.out, rows, flags, job.codec, gathered[:, HEADER_BYTES:])

    def rounds(self, k):
        return k - 1

    def bucket_phases(self, k, codec, numel, rank=0):
        payload = HEADER_BYTES + codec.payload_bytes(numel)
        return [{"payload": payload, "sent": (k - 1) * payload, "received": (k - 1) * payload}]


class ReduceScatter(Strategy):
    name = "reduce_scatter"

    @dataclass(kw_only=True, slots=True)
    class Config(Strategy.Config):
        pass

    def check_codec(self, codec: Codec) -> None:
        if codec.per_tensor:
            raise ValueError(
                f"reduce_scatter cuts each bucket into owner ranges, and {codec.describe()} quantizes "
                "whole tensors (one table per tensor); use --outer.exchange.strategy allgather"
            )
        if codec.sparse:
            raise ValueError(
                f"reduce_scatter re-encodes each owner's averaged range with the codec, and the average "
                f"of K {codec.name} payloads holds up to K times the coordinates one payload can carry: "
                f"the re-encode would drop about half of them at K=2, with nothing fed back; use "
                f"--outer.exchange.strategy allgather with {codec.name}"
            )

    def run(self, sync, job):
        k, me, codec = sync.k, sync.rank, job.codec
        ranged = Pieces(codec, ranges(job.numel, k, codec.alignment))  # error feedback sees what is sent
        with sync.timer("encode"):
            header = sync.header()
            pieces = [torch.cat([header, p]) for p in sync.encode(job, ranged).split(ranged.sizes)]
            send_splits = [p.numel() for p in pieces]
            send = sync.tally.track(torch.cat(pieces))
            del pieces
        recv, fut = collectives.all_to_all(sync.manager, send, send_splits, [send_splits[me]] * k)
        sync.tally.track(recv)
        sync.count(payload=send.numel(), sent=send.numel() - send_splits[me], received=recv.numel() - send_splits[me])
        yield fut
        if sync.failed():
            return
        (a, b) = ranged.bounds[me]
        with sync.timer("decode"):
            mine = recv.view(k, -1)
            flags = sync.read_headers(mine[:, :HEADER_BYTES])
            rows = sync.tally.track(codec.decode(mine[:, HEADER_BYTES:], b - a))
            average = sync.tally.track(torch.empty(b - a, dtype=torch.float32, device=rows.device))
            sync.average_into(average, rows, flags, codec, mine[:, HEADER_BYTES:])
            del rows, recv, mine, send
        with sync.timer("encode"):
            chunk = sync.tally.track(codec.encode(average))
            del average
        send2 = sync.tally.track(chunk.repeat(k))
        recv2, fut2 = collectives.all_to_all(sync.manager, send2, [chunk.numel()] * k, ranged.sizes)
        sync.tally.track(recv2)
        sync.count(sent=send2.numel() - chunk.numel(), received=recv2.numel() - ranged.sizes[me])
        del send2
        yield fut2
        if sync.failed():
            return
        with sync.timer("decode"):
            for piece, (a, b) in zip(recv2.split(ranged.sizes), ranged.bounds):
                if b > a:
                    job.out[a:b].copy_(codec.decode(piece, b - a))

    @staticmethod
    def _first_phase_bytes(k: int, sizes: list[int], me: int) -> dict[str, float]:
        pieces = [HEADER_BYTES + s for s in sizes]
        return {
            "payload": sum(pieces),
            "sent": sum(p for j, p in enumerate(pieces) if j != me),
            "received": (k - 1) * pieces[me],
        }

    @staticmethod
    def _second_phase_bytes(k: int, sizes: list[int], me: int) -> dict[str, float]:
        return {"sent": (k - 1) * sizes[me], "received": sum(s for j, s in enumerate(sizes) if j != me)}

    def rounds(self, k):
        return 1 if k > 1 else 0

    def bucket_phases(self, k, codec, numel, rank=0):
        sizes = [codec.payload_bytes(b - a) for a, b in ranges(numel, k, codec.alignment)]
        return [self._first_phase_bytes(k, sizes, rank), self._second_phase_bytes(k, sizes, rank)]


StrategyConfig = (
    Annotated[AllReduce.Config, tyro.conf.subcommand(AllReduce.name)]
    | Annotated[AllGather.Config, tyro.conf.subcommand(AllGather.name)]
    | Annotated[ReduceScatter.Config, tyro.conf.subcommand(ReduceScatter.name)]
)
"""One strategy's config; the command line picks it by name (``--outer.exchange.strategy reduce_scatter``)."""

STRATEGIES: tuple[type[Strategy], ...] = (AllReduce, AllGather, ReduceScatter)
