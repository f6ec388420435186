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
bucket into K owner ranges, at the same alignment (:func:`ranges`). A codec whose blocks are
whole tensors (``Codec.per_tensor``: SparseLoCo's value table per tensor) is cut between tensors
instead: its buckets hold whole tensors (:func:`whole_tensors`; a tensor larger than
``bucket_numel`` is a bucket of its own, which then bounds the sync's memory) and list each
tensor's bounds, which the bucket is encoded by (``compress.Pieces``).

With ``tile`` > 0 (SparseLoCo's layout), each matrix of the compressed stream is stored
tile by tile instead of row by row: cut into tiles of h × w elements (h, w the largest
divisors of its two dimensions up to ``tile``; 64 × 64 for the usual shapes), each tile's
elements consecutive, tiles in row-major order of the tile grid (the reference's
``(y h) (x w) -> y x h w``). A codec whose block is ``tile²`` elements then works tile by tile.
Δ is written row by row as always and permuted into tiles in place (a bucket's worth of
rows at a time); the average is permuted back before the outer step reads it.
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
    pieces: tuple[tuple[int, int], ...] = ()
    """Its tensors' bounds within it, for a codec whose blocks are whole tensors (else empty)."""

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


def whole_tensors(sizes: list[int], bucket_numel: int) -> list[tuple[int, int, tuple[tuple[int, int], ...]]]:
    """Consecutive tensors of ``sizes`` elements packed into buckets of at most ``bucket_numel``
    (a larger tensor alone): (start, end, each tensor's bounds within the bucket); empty tensors
    are left out."""
    out, start, bounds = [], 0, []
    offset = 0
    for n in sizes:
        if n and bounds and offset + n - start > bucket_numel:
            out.append((start, offset, tuple(bounds)))
            start, bounds = offset, []
        if n:
            bounds.append((offset - start, offset + n - start))
        offset += n
    if bounds:
        out.append((start, offset, tuple(bounds)))
    return out


def tile_side(n: int, tile: int) -> int:
    """The largest divisor of ``n`` that is at most ``tile`` (SparseLoCo's ``_get_smaller_split``)."""
    return max(d for d in range(1, min(n, tile) + 1) if n % d == 0)


@dataclass(frozen=True)
class Tiled:
    """A matrix stored tile by tile in the compressed stream."""

    offset: int
    rows: int
    cols: int
    h: int
    w: int

    def _pieces(self, buffer: torch.Tensor, max_numel: int):
        """(row-major view, tile-major view) pairs of consecutive tile rows, each at most
        ``max_numel`` elements (at least one tile row): the same memory seen both ways."""
        band = self.h * self.cols
        per = max(1, max_numel // band)
        for y in range(0, self.rows // self.h, per):
            n = min(per, self.rows // self.h - y)
            flat = buffer[self.offset + y * band : self.offset + (y + n) * band]
            yield flat.view(n, self.h, self.cols // self.w, self.w), flat.view(n, self.cols // self.w, self.h, self.w)

    def to_tiles(self, buffer: torch.Tensor, max_numel: int) -> None:
        for rows, tiles in self._pieces(buffer, max_numel):
            tiles.copy_(rows.permute(0, 2, 1, 3).clone())

    def from_tiles(self, buffer: torch.Tensor, max_numel: int) -> None:
        for rows, tiles in self._pieces(buffer, max_numel):
            rows.copy_(tiles.permute(0, 2, 1, 3).clone())


class FragmentLayout:
    """One fragment's streams: which tensor goes where, the flat buffers, the buckets."""

    def __init__(self, names: list[str], shapes: list[torch.Size], skip: re.Pattern | None, tile: int = 0):
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
        self.tiled = [
            Tiled(o, s[0], s[1], tile_side(s[0], tile), tile_side(s[1], tile))
            for o, s, stream in zip(self.offsets, self.shapes, self.stream_of)
            if tile and stream == COMPRESSED and len(s) == 2 and s.numel()
        ]
        """The compressed stream's matrices, stored tile by tile (``tile`` > 0)."""

    def to_tiles(self, buffers: dict[str, torch.Tensor], max_numel: int) -> None:
        """Δ as written (row by row) → tile by tile, in place."""
        for t in self.tiled:
            t.to_tiles(buffers[COMPRESSED], max_numel)

    def from_tiles(self, buffers: dict[str, torch.Tensor], max_numel: int) -> None:
        """The average (tile by tile) → row by row, in place, as the outer step reads it."""
        for t in self.tiled:
            t.from_tiles(buffers[COMPRESSED], max_numel)

    def irregular_tiles(self, tile: int) -> list[str]:
        """The matrices whose tiles are smaller than ``tile`` × ``tile`` (a dimension ``tile``
        does not divide): a codec block of ``tile²`` elements then spans several of their tiles."""
        by_offset = {o: n for n, o, s in zip(self.names, self.offsets, self.stream_of) if s == COMPRESSED}
        return [by_offset[t.offset] for t in self.tiled if (t.h, t.w) != (tile, tile)]

    def new_buffers(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {s: torch.empty(n, dtype=torch.float32, device=device) for s, n in self.numel.items()}

    def views(self, buffers: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """Per tensor, in the fragment's order, its place in the stream buffers."""
        return [
            buffers[s][o : o + shape.numel()].view(shape)
            for s, o, shape in zip(self.stream_of, self.offsets, self.shapes)
        ]

    def sizes(self, stream: str) -> list[int]:
        """The elements of each tensor of ``stream``, in stream order."""
        return [shape.numel() for shape, s in zip(self.shapes, self.stream_of) if s == stream]

    def buckets(self, codecs: dict[str, Codec], bucket_numel: int) -> list[Bucket]:
        """The dense stream first (small; it carries norms), then the compressed one."""
        return [
            bucket
            for s in (DENSE, COMPRESSED)
            for bucket in stream_buckets(s, self.numel[s], self.sizes(s), codecs[s], bucket_numel)
        ]


def stream_buckets(stream: str, numel: int, sizes: list[int], codec: Codec, bucket_numel: int) -> list[Bucket]:
    """One stream's buckets: cut at the codec's alignment, or of whole tensors for a codec whose
    blocks are tensors (``sizes``: its tensors' elements, summing to ``numel``)."""
    if codec.per_tensor:
        return [Bucket(stream, a, b, pieces) for a, b, pieces in whole_tensors(sizes, bucket_numel)]
    return [Bucket(stream, a, b) for a, b in cut(numel, bucket_numel, codec.alignment)]
