"""A codec applied piece by piece over a flat tensor cut at given bounds.

The payload is the concatenation of the base codec's payloads of the pieces, each piece encoded
as a tensor of its own (its own blocks, its own chunks, its own tables); decoding and averaging
go piece by piece too, so a codec whose mean reads its payloads (top-k's mean over the replicas
that selected a coordinate) reads each piece's own indices. Two uses:

- a reduce-scatter's owner ranges: each owner decodes, averages and re-encodes its own range,
  and error feedback sees the exact payload that is sent;
- codecs whose blocks are whole parameter tensors (``Codec.per_tensor``: SparseLoCo's one 2-bit
  value table per tensor, as its authors compute it): the exchange hands such a codec buckets of
  whole tensors (``layout.whole_tensors``) with each tensor's bounds.
"""

from __future__ import annotations

import torch

from .codec import Codec


class Pieces(Codec):
    """``base`` applied to each ``bounds`` piece (consecutive ``(start, end)``, covering
    ``[0, numel)``); a view of a built codec, with no config of its own."""

    def __init__(self, base: Codec, bounds: list[tuple[int, int]]):  # not Codec.__init__: no config to validate
        self.base, self.bounds = base, [(int(a), int(b)) for a, b in bounds]
        if any(a != b0 for (_, b0), (a, _) in zip(self.bounds, self.bounds[1:])) or (self.bounds and self.bounds[0][0]):
            raise ValueError(f"pieces must be consecutive from 0, got {self.bounds}")
        self.numel = self.bounds[-1][1] if self.bounds else 0
        self.sizes = [base.payload_bytes(b - a) for a, b in self.bounds]
        self.config, self.compiled = base.config, base.compiled
        self.name, self.lossless, self.sparse = base.name, base.lossless, base.sparse

    @property
    def alignment(self) -> int:
        return self.base.alignment

    def payload_bytes(self, numel: int) -> int:
        if numel != self.numel:
            raise ValueError(f"{self.describe()} covers {self.numel} elements, not {numel}")
        return sum(self.sizes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1)
        if x.numel() != self.numel:
            raise ValueError(f"{self.describe()} covers {self.numel} elements, got {x.numel()}")
        if not self.bounds:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        return torch.cat([self.base.encode(x[a:b]) for a, b in self.bounds])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        self.check_payload(payload, numel)
        if not self.bounds:
            return torch.zeros(*payload.shape[:-1], 0, device=payload.device)
        if len(self.bounds) == 1:  # one tensor: no concatenated copy of the (K, numel) rows
            return self.base.decode(payload, numel)
        parts = payload.split(self.sizes, dim=-1)
        return torch.cat([self.base.decode(p, b - a) for p, (a, b) in zip(parts, self.bounds)], dim=-1)

    def mean_into(
        self,
        out: torch.Tensor,
        rows: torch.Tensor,
        payloads: torch.Tensor | None = None,
        weights: list[float] | None = None,
    ) -> None:
        if payloads is not None:
            self.check_payload(payloads, self.numel)
        parts = payloads.split(self.sizes, dim=-1) if payloads is not None else [None] * len(self.bounds)
        for part, (a, b) in zip(parts, self.bounds):
            self.base.mean_into(out[a:b], rows[:, a:b], part, weights)

    def describe(self) -> str:
        return f"{self.base.describe()} over {len(self.bounds)} piece(s)"
