"""The codec interface: what a pseudo-gradient compressor must provide.

A codec turns a flat float tensor into a flat ``uint8`` payload whose size depends only
on the number of elements (``payload_bytes(numel)``), never on the values: every replica
then hands a collective buffers of the same size, so payloads can be all-gathered or
exchanged all-to-all without a size round trip, and the bytes on the wire follow a
formula that tests check. Encoding and decoding are vectorised torch on the tensor's own
device; ``decode`` takes any number of leading batch dimensions (one payload per replica)
so a receiver decodes K payloads in one call. Zero elements is a valid size (an empty
payload), so callers need no special case for an empty stream or range.

Each codec is a torchtitan ``Configurable``: its own ``Config`` holds only its own
settings (``Dense.Config(dtype=...)``, ``Quantizer.Config(bits=...)``,
``TopK.Config(fraction=...)``) and ``build()`` makes the codec. ``compiled=True`` (a build
argument: the exchange decides it from the device, see ``kernels.py``) runs the codec's
kernels through ``torch.compile``; payloads are byte-identical to the eager ones.

``alignment`` is the element granularity of the codec's layout (a quantization block, a
top-k chunk): a tensor cut at multiples of it and encoded piece by piece gives exactly
the values of encoding it whole, which is what lets the exchange work in buckets.
A codec that is ``per_tensor`` is cut only between tensors instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.config import Configurable

from .kernels import compiled_kernel


class Codec(Configurable):
    name: str = "codec"
    lossless: bool = False
    """Decoding gives back exactly what was encoded (error feedback has nothing to carry)."""
    sparse: bool = False
    """A payload carries a chosen subset of the coordinates (top-k): re-encoding an average of
    several payloads drops coordinates, which the reduce-scatter strategy cannot feed back."""
    per_tensor: bool = False
    """Its blocks are whole parameter tensors (one table per tensor, as SparseLoCo's authors
    quantize): the exchange hands it buckets of whole tensors, encoded tensor by tensor
    (``pieces.Pieces``), never cut at ``alignment``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        def validate(self) -> None:
            """Raise ValueError naming the bad setting (the exchange adds the codec's name)."""

        # What a run records of its codec (``runs/facts.py``) and how runs are named after it
        # (``runs/names.py``): each codec says it of itself, so those modules know no codec by name.
        def wire_bits(self) -> float:
            """Bits per element on the wire, before metadata (scales, tables)."""
            raise NotImplementedError

        def keeps_everything(self) -> bool:
            """Decoding gives back what was encoded (the component's ``lossless``, known before it is
            built): error feedback has nothing to carry."""
            return False

        def method_tag(self) -> str:
            """What a method's name adds for this codec (``2bit`` in ``muloco-2bit``; "": nothing)."""
            return ""

        def name_detail(self) -> str:
            """What a run folder's name adds that the method's name does not say (top-k's fraction)."""
            return ""

        def facts(self) -> dict[str, Any]:
            """The codec's name, bits per element, tag and detail, lossless or not, and its settings."""
            settings = {
                f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init and not f.name.startswith("_")
            }
            facts = {"name": type(self)._owner.name, "bits": self.wire_bits(), "tag": self.method_tag()}
            facts.update(detail=self.name_detail(), lossless=self.keeps_everything())
            return {**facts, **settings}

    def __init__(self, config: Config, *, compiled: bool = False):
        config.validate()
        self.config = config
        self.compiled = compiled

    @property
    def alignment(self) -> int:
        """Cut streams only at multiples of this many elements (blocks, chunks)."""
        return 1

    def payload_bytes(self, numel: int) -> int:
        """Exact size of ``encode(x)`` for a tensor of ``numel`` elements."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Flat float tensor (any float dtype) -> ``uint8`` tensor of ``payload_bytes(x.numel())``."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """``(..., payload_bytes(numel))`` uint8 -> ``(..., numel)`` float32."""
        raise NotImplementedError

    def mean_into(
        self,
        out: torch.Tensor,
        rows: torch.Tensor,
        payloads: torch.Tensor | None = None,
        weights: list[float] | None = None,
    ) -> None:
        """``out`` ← the mean of the decoded payloads ``rows`` (c, m), c ≥ 1, added in row
        order so every replica gets the same bits whatever its bucket sizes. ``payloads``
        (c, payload_bytes(m)) are the encoded rows, for a codec whose mean needs more than
        the decoded values (top-k's mean over the replicas that selected a coordinate).
        ``weights`` (one per row, see :func:`weighted`): Σ w_j·row_j / Σ w_j instead; all 1.0
        is the plain mean, bit for bit."""
        weights = weighted(weights)
        self._sum_rows(out, rows, weights)
        if weights is not None:
            out.div_(sum(weights))
        elif rows.shape[0] > 1:
            out.div_(rows.shape[0])

    @staticmethod
    def _sum_rows(out: torch.Tensor, rows: torch.Tensor, weights: list[float] | None) -> None:
        """``out`` ← Σ_j w_j·rows[j], added one row at a time in row order, so that every
        replica gets the same bits whatever its bucket sizes (a reduction kernel would not
        promise the order). ``weights`` None: the plain sum."""
        out.copy_(rows[0])
        if weights is None:
            for row in rows[1:]:
                out.add_(row)
            return
        out.mul_(weights[0])
        for row, w in zip(rows[1:], weights[1:]):
            out.add_(row, alpha=w)

    def _kernel(self, fn):
        """``fn`` as this codec runs it: through ``torch.compile`` if ``compiled``, else as it is."""
        return compiled_kernel(fn) if self.compiled else fn

    def check_payload(self, payload: torch.Tensor, numel: int) -> int:
        """The payload size for ``numel``; a clear error if ``payload`` is not ``(..., size)`` uint8."""
        size = self.payload_bytes(numel)
        if payload.dtype != torch.uint8 or payload.shape[-1:] != (size,):
            raise ValueError(
                f"{self.describe()} expects (..., {size}) uint8 payloads for {numel} elements, "
                f"got {tuple(payload.shape)} {payload.dtype}"
            )
        return size

    def bits_per_element(self, numel: int) -> float:
        return 8.0 * self.payload_bytes(numel) / max(numel, 1)

    def describe(self) -> str:
        """Short human-readable settings, for logs and benchmark tables."""
        return self.name


def weighted(weights: list[float] | None) -> list[float] | None:
    """The weights of a weighted mean, or None where it is the plain mean (none given, or all
    1.0). They are multiples of 2⁻¹⁶ in (0, 1] (``pipeline.work_weights``), so any sum of up to
    256 of them is exact in float32 and the same whatever order a kernel adds them in."""
    if weights is None or all(w == 1.0 for w in weights):
        return None
    if sum(weights) <= 0:
        raise ValueError(f"a weighted mean needs a positive total weight, got {weights}")
    return [float(w) for w in weights]
