"""Where one fragment's pseudo-gradient lives during a sync, and how it is cut into buckets.

A fragment's tensors form two flat *streams*: the compressed one (every tensor not
matched by ``skip_pattern``, encoded with the exchange's codec) and the dense one (the
skipped tensors, sent in ``skip_dtype``). Each stream has one flat float32 buffer per
sync, and the outer loop writes Δ = θ_g − θ_local straight into per-tensor views of it:
no concatenation, no second copy of the model.

Each stream is cut into *buckets* of at most ``bucket_numel`` elements, at multiples of
its codec's ``alignment`` (a quantization block, a top-k chunk). Codecs are local to their
blocks, so a bucket encodes to exactly the values the whole stream would: bucketing bounds
the memory of a sync without changing its result. A reduce-scatter further cuts each
bucket into K owner ranges, at the same alignment (:func:`ranges`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from muloco.compress import Codec

COMPRESSED, DENSE = "c", "d"


@dataclass(frozen=True)
class Bucket:
    stream: str
    """COMPRESSED or DENSE."""
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def _no_short_tail(bounds: list[tuple[int, int]], align: int) -> list[tuple[int, int]]:
    """A last non-empty piece shorter than ``align`` joins the piece before it: a codec treats
    a tensor shorter than its block as one block of its own size, but the same elements at
    the end of a longer tensor as a partial block. With this rule every piece is encoded
    exactly as those elements are within the whole."""
    nonempty = [i for i, (a, b) in enumerate(bounds) if b > a]
    if len(nonempty) >= 2:
        last, before = nonempty[-1], nonempty[-2]
        a, b = bounds[last]
        if b - a < align:
            bounds = list(bounds)
            bounds[before] = (bounds[before][0], b)
            bounds[last] = (b, b)
    return bounds


def ranges(numel: int, k: int, align: int) -> list[tuple[int, int]]:
    """K contiguous (start, end) ranges covering ``numel``, cut at multiples of ``align``
    (a short tail goes to the owner before it)."""
    per = -(-numel // k)
    per = -(-per // align) * align if numel else 0
    return _no_short_tail([(min(j * per, numel), min((j + 1) * per, numel)) for j in range(k)], align)


def cut(numel: int, bucket_numel: int, align: int) -> list[tuple[int, int]]:
    """``[0, numel)`` in consecutive pieces of at most ``bucket_numel`` elements (at least
    one ``align``; a short tail joins the last piece), each starting at a multiple of ``align``."""
    size = max(align, bucket_numel // align * align)
    pieces = _no_short_tail([(a, min(a + size, numel)) for a in range(0, numel, size)], align)
    return [p for p in pieces if p[1] > p[0]]


class FragmentLayout:
    """One fragment's streams: which tensor goes where, the flat buffers, the buckets."""

    def __init__(self, names: list[str], shapes: list[torch.Size], skip: re.Pattern | None):
        self.names = list(names)
        self.shapes = [torch.Size(s) for s in shapes]
        self.stream_of = [DENSE if skip and skip.search(n) else COMPRESSED for n in names]
        self.offsets: list[int] = []
        self.numel = {COMPRESSED: 0, DENSE: 0}
        for shape, stream in zip(self.shapes, self.stream_of):
            self.offsets.append(self.numel[stream])
            self.numel[stream] += shape.numel()
        self.key = "|".join((names[0], names[-1], str(len(names))))
        """The fragment's residual key, stable across runs (DCP flattens nested keys with dots)."""

    def new_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {s: torch.empty(n, dtype=torch.float32, device=device) for s, n in self.numel.items()}

    def views(self, buffers: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Per tensor, in the fragment's order, its place in the stream buffers."""
        return [buffers[s][o:o + shape.numel()].view(shape)
                for s, o, shape in zip(self.stream_of, self.offsets, self.shapes)]

    def buckets(self, codecs: dict[str, Codec], bucket_numel: int) -> list[Bucket]:
        """The dense stream first (small; it carries norms), then the compressed one."""
        return [Bucket(s, a, b) for s in (DENSE, COMPRESSED)
                for a, b in cut(self.numel[s], bucket_numel, codecs[s].alignment)]
