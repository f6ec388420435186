"""How the replicas combine one bucket: all-reduce, all-gather or reduce-scatter.

Each strategy is a torchtitan ``Configurable`` (chosen by its own config class; on the
command line ``--outer.exchange.strategy allreduce|allgather|reduce_scatter``) whose
``run(bucket)`` is a generator over one bucket: it encodes, issues a collective and
yields it; when the pipeline resumes it (the collective done), it decodes, writes the
bucket's average into ``bucket.out`` and returns what it learned of the quorum. It sees the
sync only through its ``bucket.BucketContext`` (encode, issue, count, average), whose
collectives carry their own bytes: the pipeline counts them and records what is returned.
``bucket_bytes`` gives, from the wire format alone, what one bucket carries: what the
pipeline counts from its buffers (the tests compare).

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
from typing import Annotated, Generator

import torch
import tyro
from torchtitan.config import Configurable

from muloco.compress import Codec, Dense, Pieces
from muloco.compress.packing import from_bytes
from muloco.outer.exchange.bucket import HEADER_BYTES, Averaged, BucketContext, Collective
from muloco.outer.exchange.layout import ranges


class Strategy(Configurable):
    name = "strategy"

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __init__(self, config: Config):
        self.config = config

    def check_codec(self, codec: Codec) -> None:
        """Raise ValueError if this strategy cannot carry ``codec``'s payloads."""

    def run(self, bucket: BucketContext) -> Generator[Collective, None, Averaged | None]:
        """Yield each collective as it is issued; return what the bucket learned (None if the
        quorum failed before it learned anything)."""
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

    def sync_bytes(self, k: int, rank: int = 0, weighted: bool = False) -> dict[str, float]:
        """What this strategy carries once per sync, beyond its buckets and the work records
        (``weighted``: the average weighs each Δ by its record)."""
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

    def run(self, bucket):
        """A lossless (float32) bucket is summed in place, in Δ's own buffer; a lossy one is
        encoded (with error feedback) first. Contributors are counted once per sync, by a
        one-element all-reduce of the flags issued with the first bucket; a weighted sync has
        them from its work records, and scales its own Δ by its weight before the sum (lossless
        codecs only: ``Exchange.Config`` refuses a lossy one)."""
        in_place = bucket.codec.lossless and not bucket.fed
        with bucket.timer("encode"):
            if in_place:
                buf = bucket.summand()
            else:
                buf = bucket.track(from_bytes(bucket.encode(), bucket.codec.dtype))
            count = bucket.contributor_count()
        yield bucket.all_reduce(buf)
        if bucket.failed():
            return None
        with bucket.timer("decode"):
            contributors = None if count is None else count.value()
            # the contributors, or their weights' sum (exact: see pipeline.work_weights); zeros stay zeros
            weights = bucket.weights
            total = max(contributors, 1) if weights is None else (sum(weights) or 1.0)
            if in_place:
                bucket.out.div_(total)
            else:
                bucket.out.copy_(buf).div_(total)
        return Averaged(contributors)

    def rounds(self, k):
        return 2 * (k - 1)

    def bucket_phases(self, k, codec, numel, rank=0):
        payload = codec.payload_bytes(numel)
        ring = 2 * (k - 1) / k * payload
        return [{"payload": payload, "sent": ring, "received": ring}]

    def sync_bytes(self, k, rank=0, weighted=False):
        if weighted:  # the work records count the contributors
            return super().sync_bytes(k, rank, weighted)
        ring = 2 * (k - 1) / k * 4
        return {"payload": 4, "sent": ring, "received": ring}


class AllGather(Strategy):
    name = "allgather"

    @dataclass(kw_only=True, slots=True)
    class Config(Strategy.Config):
        pass

    def run(self, bucket):
        with bucket.timer("encode"):
            buf = torch.cat([bucket.header(), bucket.encode()])
        gathered, collective = bucket.all_gather(buf)
        yield collective
        if bucket.failed():
            return None
        with bucket.timer("decode"):
            senders = bucket.read_headers(gathered[:, :HEADER_BYTES])
            rows = bucket.track(bucket.codec.decode(gathered[:, HEADER_BYTES:], bucket.numel))
            averaged = bucket.average(bucket.out, rows, senders, bucket.codec, gathered[:, HEADER_BYTES:])
        return averaged

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

    def run(self, bucket):
        """The first phase's average is what the bucket learned; a failure in the second phase
        still reports it."""
        k, me, codec = bucket.k, bucket.rank, bucket.codec
        ranged = Pieces(codec, ranges(bucket.numel, k, codec.alignment))  # error feedback sees what is sent
        with bucket.timer("encode"):
            header = bucket.header()
            pieces = [torch.cat([header, p]) for p in bucket.encode(ranged).split(ranged.sizes)]
            send_splits = [p.numel() for p in pieces]
            send = bucket.track(torch.cat(pieces))
            del pieces
        recv, first = bucket.all_to_all(send, send_splits, [send_splits[me]] * k, payload=True)
        yield first
        if bucket.failed():
            return None
        (a, b) = ranged.bounds[me]
        with bucket.timer("decode"):
            mine = recv.view(k, -1)
            senders = bucket.read_headers(mine[:, :HEADER_BYTES])
            rows = bucket.track(codec.decode(mine[:, HEADER_BYTES:], b - a))
            average = bucket.track(torch.empty(b - a, dtype=torch.float32, device=rows.device))
            averaged = bucket.average(average, rows, senders, codec, mine[:, HEADER_BYTES:])
            del rows, recv, mine, send
        with bucket.timer("encode"):
            chunk = bucket.track(codec.encode(average))
            del average
        send2 = bucket.track(chunk.repeat(k))
        recv2, second = bucket.all_to_all(send2, [chunk.numel()] * k, ranged.sizes, payload=False)
        del send2
        yield second
        if bucket.failed():
            return averaged
        with bucket.timer("decode"):
            for piece, (a, b) in zip(recv2.split(ranged.sizes), ranged.bounds):
                if b > a:
                    bucket.out[a:b].copy_(codec.decode(piece, b - a))
        return averaged

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
