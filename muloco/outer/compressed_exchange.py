"""Compressed pseudo-gradient exchange with error feedback: all-gather or reduce-scatter.

Per fragment, this replica's Δ tensors form two flat streams: the *compressed* stream
(every tensor not matched by ``skip_pattern``) and the *dense* stream (the skipped ones,
sent in ``dtype``). Compression runs on the concatenated stream: quantization blocks and
top-k chunks are local, so only the few blocks that straddle two tensors mix them.
Error feedback (e ← β·e + Δ; payload = C(e); e ← e − D(payload)) runs per stream on
this replica; the outer lr is applied once, later, by the outer optimizer.

Strategies (every payload size is a formula of the element count, so buffers agree on
every replica without a size exchange; one flag byte per payload says whether the
sender contributes — a replica that just healed sends zeros and flag 0):

* ``allgather``: all-gather the payloads, decode the K payloads in one batched call and
  average the contributors'. Exact with respect to the payloads; each replica receives
  (K−1)× the payload.
* ``reduce_scatter``: each stream is cut into K ranges; range j of every replica's
  payload goes to replica j (all-to-all), which decodes, averages and re-encodes it;
  a second all-to-all hands every replica each re-encoded range. Each replica sends
  and receives about 2(K−1)/K × the payload whatever K is. The re-encoding adds a
  second, un-fed-back quantization of the average (as MuLoCo simulates).

Wire accounting: ``bytes_sent``/``bytes_received`` are the bytes this replica's
collectives carry to/from the *other* replicas (all-gather (K−1)·B each way; all-to-all
the splits for other ranks), with ``payload_bytes`` the size of this replica's encoded
Δ. :func:`wire_bytes` gives the same figures from the formulas, for any K.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
import torch

from muloco.compress.build import make_codec
from muloco.compress.codec import Codec
from muloco.compress.error_feedback import ErrorFeedback
from muloco.outer import collectives
from muloco.outer.exchange import EXCHANGE_DTYPES, Exchange, PendingExchange

FLAG_BYTES = 1


@dataclass
class _Streams:
    """Where each Δ tensor sits in the two flat streams."""

    shapes: list[torch.Size]
    skipped: list[bool]

    def split(self, deltas: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        device = deltas[0].device
        pick = lambda skip: [d.reshape(-1).float() for d, s in zip(deltas, self.skipped) if s == skip]  # noqa: E731
        comp, dense = pick(False), pick(True)
        empty = torch.zeros(0, device=device)
        return (torch.cat(comp) if comp else empty), (torch.cat(dense) if dense else empty)

    def join(self, comp: torch.Tensor, dense: torch.Tensor) -> list[torch.Tensor]:
        sizes = [s.numel() for s in self.shapes]
        parts = {False: iter(comp.split([n for n, s in zip(sizes, self.skipped) if not s])),
                 True: iter(dense.split([n for n, s in zip(sizes, self.skipped) if s]))}
        return [next(parts[s]).view(shape) for shape, s in zip(self.shapes, self.skipped)]


def ranges(numel: int, k: int, align: int) -> list[tuple[int, int]]:
    """K contiguous (start, end) ranges covering ``numel``, cut at multiples of ``align``."""
    per = -(-numel // k)
    per = -(-per // align) * align if numel else 0
    return [(min(j * per, numel), min((j + 1) * per, numel)) for j in range(k)]


def range_alignment(codec: Codec) -> int:
    """Cut reduce-scatter ranges at block/chunk boundaries, so no block straddles two owners."""
    return getattr(codec, "block_size", None) or getattr(codec, "chunk_size", None) or 1


class _RangeCodec(Codec):
    """A codec applied range by range (for reduce-scatter), so error feedback sees the
    exact payload that is sent."""

    def __init__(self, base: Codec, bounds: list[tuple[int, int]]):
        self.base, self.bounds = base, bounds
        self.sizes = [base.payload_bytes(b - a) for a, b in bounds]

    def payload_bytes(self, numel: int) -> int:
        return sum(self.sizes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.base.encode(x[a:b]) for a, b in self.bounds])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        pieces = payload.split(self.sizes, dim=-1)
        return torch.cat([self.base.decode(p, b - a) for p, (a, b) in zip(pieces, self.bounds)], dim=-1)


class CompressedExchange(Exchange):
    def __init__(self, config: Exchange.Config):
        config.validate()
        super().__init__(config)
        self.codec = config.make_codec()
        self.dense = make_codec("identity", dtype=config.dtype)
        self.skip = re.compile(config.skip_pattern) if config.skip_pattern else None
        self.feedback = ErrorFeedback(beta=config.ef_beta, enabled=config.error_feedback)
        self.dense_feedback = ErrorFeedback(beta=config.ef_beta,
                                            enabled=config.error_feedback and config.dtype != "float32")

    # ------------------------------------------------------------------- state
    def allocate(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """Zero residuals for one fragment, so a checkpoint load (DCP loads in place)
        finds them before the first sync."""
        streams = self._streams(names, tensors)
        n_comp = sum(t.numel() for t, s in zip(tensors, streams.skipped) if not s)
        n_dense = sum(t.numel() for t, s in zip(tensors, streams.skipped) if s)
        device = tensors[0].device
        key = _key(names)
        for feedback, suffix, n in ((self.feedback, "/c", n_comp), (self.dense_feedback, "/d", n_dense)):
            if feedback.enabled and n:
                feedback.load_state_dict({**feedback.state_dict(), key + suffix: torch.zeros(n, device=device)})

    def state_dict(self) -> dict[str, Any]:
        """Residuals under this rank's key: under FSDP each rank's residuals cover its own
        shards, and distinct keys keep DCP from treating them as one replicated tensor."""
        return {_rank_key(): {"c": self.feedback.state_dict(), "d": self.dense_feedback.state_dict()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = state.get(_rank_key())
        if mine is None:
            raise ValueError(f"the checkpoint has no error-feedback residuals for {_rank_key()}")
        self.feedback.load_state_dict(mine["c"])
        self.dense_feedback.load_state_dict(mine["d"])

    def reset(self) -> None:
        """Zero the residuals (after healing from a peer: they describe a trajectory this
        replica no longer follows). Zeroed, not dropped, so a checkpoint taken before the
        next sync still has every key a later load expects."""
        for feedback in (self.feedback, self.dense_feedback):
            for residual in feedback.state_dict().values():
                residual.zero_()

    # ---------------------------------------------------------------- encoding
    def _streams(self, names: list[str], deltas: list[torch.Tensor]) -> _Streams:
        skipped = [bool(self.skip and self.skip.search(n)) for n in names]
        return _Streams([d.shape for d in deltas], skipped)

    def _payload(self, key: str, x: torch.Tensor, codec: Codec, feedback: ErrorFeedback, contributes: bool):
        if not x.numel():
            return torch.zeros(0, dtype=torch.uint8, device=x.device)
        if not contributes:  # a healed replica adds nothing and must not feed its buffer
            return codec.encode(torch.zeros_like(x))
        return feedback.compress(key, x, codec)

    def start(self, manager, names, deltas, contributes):
        streams = self._streams(names, deltas)
        comp, dense = streams.split(deltas)
        key = _key(names)
        k = collectives.group_size(manager)
        if self.config.strategy == "allgather" or k == 1:
            pending = self._all_gather(manager, key, streams, comp, dense, contributes)
        else:
            pending = self._reduce_scatter(manager, key, streams, comp, dense, contributes, k)
        pending.dense_fp32_bytes = 2 * (k - 1) / k * 4 * (comp.numel() + dense.numel())
        return pending

    # --------------------------------------------------------------- all-gather
    def _all_gather(self, manager, key, streams, comp, dense, contributes):
        undo = _Rollback([self.feedback, self.dense_feedback], key)
        flag = torch.tensor([1 if contributes else 0], dtype=torch.uint8, device=comp.device)
        buf = torch.cat([
            flag,
            self._payload(key + "/c", comp, self.codec, self.feedback, contributes),
            self._payload(key + "/d", dense, self.dense, self.dense_feedback, contributes),
        ])
        outputs, fut = collectives.all_gather(manager, buf)
        return _PendingAllGather(self, manager, streams, comp.numel(), dense.numel(), buf, outputs, fut, undo)

    # ----------------------------------------------------------- reduce-scatter
    def _reduce_scatter(self, manager, key, streams, comp, dense, contributes, k):
        me = collectives.group_rank(manager)
        align = range_alignment(self.codec)
        rc = _RangeCodec(self.codec, ranges(comp.numel(), k, align))
        rd = _RangeCodec(self.dense, ranges(dense.numel(), k, 1))
        undo = _Rollback([self.feedback, self.dense_feedback], key)
        pc = self._payload(key + "/c", comp, rc, self.feedback, contributes)
        pd = self._payload(key + "/d", dense, rd, self.dense_feedback, contributes)
        flag = torch.tensor([1 if contributes else 0], dtype=torch.uint8, device=comp.device)
        pieces = [torch.cat([flag, c, d]) for c, d in zip(pc.split(rc.sizes), pd.split(rd.sizes))]
        send_splits = [p.numel() for p in pieces]
        recv_splits = [send_splits[me]] * k
        recv, fut = collectives.all_to_all(manager, torch.cat(pieces), send_splits, recv_splits)
        return _PendingReduceScatter(self, manager, streams, rc, rd, me, k, recv, fut, send_splits, undo)


def _key(names: list[str]) -> str:
    """One fragment's residual key, stable across runs (DCP flattens nested keys with dots)."""
    return "|".join((names[0], names[-1], str(len(names))))


def _rank_key() -> str:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return f"rank_{rank}"


def _split_payload(buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(buf.split(sizes, dim=-1))


def _average(decoded: torch.Tensor, flags: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean over contributing rows of ``decoded`` (K, n); zeros if none contributes.
    (A weighted sum, not a matmul: TF32 matmuls would round fp32 values.)"""
    weights = (flags == 1).to(decoded.dtype)
    count = int(weights.sum())
    return (decoded * weights[:, None]).sum(0) / max(count, 1), count


def _zeros_like_streams(streams: _Streams, device) -> list[torch.Tensor]:
    """The result after a failed collective: never applied (``should_commit`` fails)."""
    return [torch.zeros(s, device=device) for s in streams.shapes]


class _Rollback:
    """Residuals as they were before this sync's compression: a sync that does not commit
    drops its Δ, so its error-feedback update must go too."""

    def __init__(self, feedback: list[ErrorFeedback], key: str):
        names = (key + "/c", key + "/d")
        self.saved = [(fb, name, t.clone()) for fb in feedback for name, t in fb.state_dict().items()
                      if name in names]

    def restore(self) -> None:
        for fb, name, t in self.saved:
            fb.state_dict()[name].copy_(t)


class _PendingAllGather(PendingExchange):
    def __init__(self, ex: CompressedExchange, manager, streams, n_comp, n_dense, buf, outputs, fut, undo):
        self.ex, self.manager, self.streams, self.n_comp, self.n_dense = ex, manager, streams, n_comp, n_dense
        self.outputs, self.fut, self.undo = outputs, fut, undo
        k = len(outputs)
        self.payload_bytes = buf.numel()
        self.bytes_sent = self.bytes_received = (k - 1) * buf.numel()

    def rollback(self) -> None:
        self.undo.restore()

    def wait(self) -> list[torch.Tensor]:
        self.fut.wait()
        if self.manager.errored():  # the buffers hold garbage; nothing will be committed
            return _zeros_like_streams(self.streams, self.outputs[0].device)
        gathered = torch.stack(self.outputs)
        sizes = [FLAG_BYTES, self.ex.codec.payload_bytes(self.n_comp), self.ex.dense.payload_bytes(self.n_dense)]
        flags, pc, pd = _split_payload(gathered, sizes)
        comp, self.contributors = _average(self.ex.codec.decode(pc, self.n_comp), flags[:, 0])
        dense, _ = _average(self.ex.dense.decode(pd, self.n_dense), flags[:, 0])
        return self.streams.join(comp, dense)


class _PendingReduceScatter(PendingExchange):
    def __init__(self, ex, manager, streams, rc, rd, me, k, recv, fut, send_splits, undo):
        self.ex, self.manager, self.streams, self.undo = ex, manager, streams, undo
        self.rc, self.rd, self.me, self.k, self.recv, self.fut = rc, rd, me, k, recv, fut
        self.payload_bytes = sum(send_splits)
        self.bytes_sent = sum(s for j, s in enumerate(send_splits) if j != me)
        self.bytes_received = (k - 1) * send_splits[me]

    def _chunk_sizes(self) -> list[int]:
        """Bytes of owner j's re-encoded range (flag byte excluded: counts travel in phase 1)."""
        return [c + d for c, d in zip(self.rc.sizes, self.rd.sizes)]

    def rollback(self) -> None:
        self.undo.restore()

    def wait(self) -> list[torch.Tensor]:
        """Phase 2 runs here, at perform time: τ overlaps only phase 1. A replica whose
        phase 1 failed skips phase 2; its peers then fail phase 2 at the group timeout."""
        self.fut.wait()
        if self.manager.errored():
            return _zeros_like_streams(self.streams, self.recv.device)
        me, k = self.me, self.k
        (ca, cb), (da, db) = self.rc.bounds[me], self.rd.bounds[me]
        mine = self.recv.view(k, -1)
        flags, pc, pd = _split_payload(mine, [FLAG_BYTES, self.rc.sizes[me], self.rd.sizes[me]])
        comp, self.contributors = _average(self.ex.codec.decode(pc, cb - ca), flags[:, 0])
        dense, _ = _average(self.ex.dense.decode(pd, db - da), flags[:, 0])
        # Phase 2: every replica gets each owner's re-encoded average of its range.
        chunk = torch.cat([self.ex.codec.encode(comp), self.ex.dense.encode(dense)])
        sizes = self._chunk_sizes()
        recv, fut = collectives.all_to_all(self.manager, chunk.repeat(k), [chunk.numel()] * k, sizes)
        self.bytes_sent += (k - 1) * chunk.numel()
        self.bytes_received += sum(s for j, s in enumerate(sizes) if j != me)
        fut.wait()
        if self.manager.errored():
            return _zeros_like_streams(self.streams, recv.device)
        comps, denses = [], []
        for j, piece in enumerate(recv.split(sizes)):
            (a, b), (c, d) = self.rc.bounds[j], self.rd.bounds[j]
            pc, pd = piece.split([self.rc.sizes[j], self.rd.sizes[j]])
            comps.append(self.ex.codec.decode(pc, b - a))
            denses.append(self.ex.dense.decode(pd, d - c))
        return self.streams.join(torch.cat(comps), torch.cat(denses))


def wire_bytes(strategy: str, k: int, codec: Codec, n_comp: int, n_dense: int = 0,
               dense_dtype: str = "float32", rank: int = 0) -> dict[str, int]:
    """Bytes replica ``rank`` sends and receives in one sync, and its payload, from the
    wire format alone (what the exchanges above count from their buffers), for any K."""
    dense = make_codec("identity", dtype=dense_dtype)
    if strategy == "allgather" or k == 1:
        payload = FLAG_BYTES + codec.payload_bytes(n_comp) + dense.payload_bytes(n_dense)
        return {"payload": payload, "sent": (k - 1) * payload, "received": (k - 1) * payload}
    if strategy != "reduce_scatter":
        raise ValueError(f"unknown strategy {strategy!r}")
    align = range_alignment(codec)
    cs = [codec.payload_bytes(b - a) for a, b in ranges(n_comp, k, align)]
    ds = [dense.payload_bytes(b - a) for a, b in ranges(n_dense, k, 1)]
    pieces = [FLAG_BYTES + c + d for c, d in zip(cs, ds)]
    chunks = [c + d for c, d in zip(cs, ds)]
    others = [j for j in range(k) if j != rank]
    return {
        "payload": sum(pieces),
        "sent": sum(pieces[j] for j in others) + (k - 1) * chunks[rank],
        "received": (k - 1) * pieces[rank] + sum(chunks[j] for j in others),
    }


__all__ = ["CompressedExchange", "EXCHANGE_DTYPES", "ranges", "wire_bytes"]
