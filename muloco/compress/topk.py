"""Top-k sparsification with a fixed k per chunk, so every replica sends the same bytes.

A global top-k would give each replica a different index spread and, with any
entropy-coded index, a different size. Here the tensor is cut into chunks of
``chunk_size`` (≤ 65536) elements and each chunk keeps exactly
``k = max(1, round(fraction · chunk))`` entries, its largest magnitudes, so the payload is
a formula of numel: ``[values][indices]``. Indices are chunk-local, ``index_bits`` = 16
(two bytes each) or 12 (three bytes per pair; chunks of at most 4096). Values are bfloat16,
float16 or float32, or quantized to ``value_bits`` = 8, 4 or 2 bits by the ``value_scheme``
quantizer, one block per ``value_block_chunks`` chunks' kept values, or with
``value_block_chunks`` 0 one block per parameter tensor (SparseLoCo's authors' table per tensor;
the exchange then encodes tensor by tensor): ``absmax`` (a scale per block) or ``statistical``
(mean shift, σ-range bins, per-bin means: SparseLoCo's and MuLoCo's value quantizer). A tensor smaller than a chunk is
one chunk of its own size; a last partial
chunk is zero-padded (the padding can only be picked when the chunk has fewer than k
non-zeros, and decodes to zeros that are cut off).

The average of K top-k payloads is, by default, their sum over the contributing replicas
divided by their number (the paper's 1/K); ``mean_over_selectors`` divides each coordinate
by the number of replicas that selected it instead (SparseLoCo's reference code), so a
coordinate one replica found important is not shrunk by the K − 1 that did not send it.

Decode scatters the values into zeros, for any number of leading batch dimensions. Indices
of a corrupt payload (buffers left by a failed collective) are clamped into their chunk, so
decoding garbage never indexes out of bounds (on a GPU: a device-side assert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec import Codec, weighted
from .dense import dtype_name, resolve_dtype
from .packing import INDEX_BITS, as_bytes, from_bytes, index_bytes, pack_indices, unpack_indices
from .quantize import Quantizer

MAX_CHUNK = 65536  # chunk-local indices must fit 16 bits
VALUE_BITS = (0, 2, 4, 8)  # 0: values in value_dtype
VALUE_SCHEMES = ("absmax", "statistical")


class TopK(Codec):
    name = "topk"
    sparse = True

    @dataclass(kw_only=True, slots=True)
    class Config(Codec.Config):
        fraction: float = 0.1
        """Fraction of each chunk kept, in (0, 1]."""
        chunk_size: int = 4096
        """Elements per chunk (≤ 65536: indices are chunk-local, 16 bits)."""
        value_dtype: str = "bfloat16"
        """Dtype of kept values (float32 | bfloat16 | float16) unless ``value_bits``."""
        value_bits: int = 0
        """Quantize kept values to 2 | 4 | 8 bits (0 = send them in ``value_dtype``)."""
        value_scheme: str = "absmax"
        """Quantizer of the kept values: absmax | statistical (mean, σ-range bins, per-bin means)."""
        value_block_chunks: int = 1
        """Chunks whose kept values form one quantization block (one scale or one table); 0: one
        block per parameter tensor (all its chunks' kept values), as SparseLoCo's authors quantize."""
        value_range_sigmas: float = 0.0
        """The statistical value quantizer's bin range in σ (0: its default for the bits, near
        Lloyd–Max; SparseLoCo's reference code uses 6)."""
        value_mean_at: str = "edge"
        """The statistical value quantizer's grid: edge (the mean a bin edge) | centre (a bin's
        centre: SparseLoCo's rounding)."""
        value_sample_sigma: bool = False
        """The statistical value quantizer's σ over N − 1 (SparseLoCo's) instead of N."""
        index_bits: int = 16
        """Bits per chunk-local index: 16, or 12 for chunks of at most 4096 elements."""
        mean_over_selectors: bool = False
        """Average each coordinate over the replicas that selected it, not over all contributors."""

        def validate(self) -> None:
            if not 0 < self.fraction <= 1:  # also rejects NaN
                raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
            if not 1 <= self.chunk_size <= MAX_CHUNK or self.chunk_size != int(self.chunk_size):
                raise ValueError(
                    f"chunk_size must be an integer in [1, {MAX_CHUNK}] (16-bit indices), got {self.chunk_size!r}"
                )
            resolve_dtype(self.value_dtype, "value_dtype")
            if self.value_bits not in VALUE_BITS:
                raise ValueError(
                    f"value_bits must be one of {VALUE_BITS} (0: values in value_dtype), got {self.value_bits!r}"
                )
            if self.value_scheme not in VALUE_SCHEMES:
                raise ValueError(f"value_scheme must be one of {VALUE_SCHEMES}, got {self.value_scheme!r}")
            if self.value_mean_at not in ("edge", "centre"):
                raise ValueError(f"value_mean_at must be edge or centre, got {self.value_mean_at!r}")
            if self.value_block_chunks < 0 or self.value_block_chunks != int(self.value_block_chunks):
                raise ValueError(
                    f"value_block_chunks must be an integer >= 1, or 0 (one block per parameter "
                    f"tensor), got {self.value_block_chunks!r}"
                )
            if not (self.value_range_sigmas >= 0 and self.value_range_sigmas < float("inf")):
                raise ValueError(f"value_range_sigmas must be >= 0 (0: the default), got {self.value_range_sigmas!r}")
            if self.index_bits not in INDEX_BITS:
                raise ValueError(f"index_bits must be one of {INDEX_BITS}, got {self.index_bits!r}")
            if self.chunk_size > 2**self.index_bits:
                raise ValueError(
                    f"chunk_size {self.chunk_size} needs more than index_bits {self.index_bits}; "
                    f"use chunk_size <= {2**self.index_bits} or index_bits 16"
                )

        def wire_bits(self) -> float:
            """Each kept value and its index."""
            value_bits = self.value_bits or (32 if self.value_dtype == "float32" else 16)
            return self.fraction * (value_bits + self.index_bits)

        def method_tag(self) -> str:
            return "topk"

        def name_detail(self) -> str:
            return f"top{self.fraction:g}"

    def __init__(self, config: Config, *, compiled: bool = False):
        super().__init__(config, compiled=compiled)
        self.fraction = float(config.fraction)
        self.chunk_size = int(config.chunk_size)
        self.value_dtype = resolve_dtype(config.value_dtype, "value_dtype")
        self.value_bits = config.value_bits
        self.index_bits = config.index_bits
        self.mean_over_selectors = bool(config.mean_over_selectors)
        self.block_chunks = int(config.value_block_chunks) if config.value_bits else 1

    # ------------------------------------------------------------------ layout

    @property
    def per_tensor(self) -> bool:
        """Quantized values in one block per tensor (``value_block_chunks`` 0)."""
        return bool(self.value_bits) and self.block_chunks == 0

    @property
    def alignment(self) -> int:
        """A value block spans ``value_block_chunks`` chunks: cut only between blocks (a block per
        tensor: whole tensors only, see ``per_tensor``; chunks are the unit within one)."""
        return self.chunk_size * max(self.block_chunks, 1)

    def chunks(self, numel: int) -> tuple[int, int, int]:
        """(number of chunks, chunk length, k) for a tensor of ``numel`` elements."""
        if numel == 0:
            return 0, 0, 0
        chunk = min(self.chunk_size, numel)
        return -(-numel // chunk), chunk, max(1, round(self.fraction * chunk))

    def _values_codec(self, nc: int, k: int) -> Quantizer | None:
        """The quantizer of ``nc`` chunks' ``k`` kept values each (None: values sent as they are)."""
        if not self.value_bits:
            return None
        return Quantizer.Config(
            bits=self.value_bits,
            scheme=self.config.value_scheme,
            block_size=max(k, 1) * (self.block_chunks or max(nc, 1)),
            range_sigmas=self.config.value_range_sigmas,
            mean_at=self.config.value_mean_at,
            sample_sigma=self.config.value_sample_sigma,
        ).build(compiled=self.compiled)

    def _value_bytes(self, nc: int, k: int) -> int:
        quantizer = self._values_codec(nc, k)
        if quantizer is None:
            return nc * k * self.value_dtype.itemsize
        return quantizer.payload_bytes(nc * k)

    def payload_bytes(self, numel: int) -> int:
        nc, _, k = self.chunks(numel)
        return self._value_bytes(nc, k) + index_bytes(nc * k, self.index_bits)

    def describe(self) -> str:
        values = dtype_name(self.value_dtype)
        if self.value_bits:
            values = f"{self.value_bits}b {self.config.value_scheme}"
            values += f" ±{self.config.value_range_sigmas / 2:g}σ" if self.config.value_range_sigmas else ""
            values += " centred" if self.config.value_mean_at == "centre" else ""
            values += f" per {self.block_chunks} chunks" if self.block_chunks > 1 else ""
            values += " per tensor" if self.per_tensor else ""
        mean = ", mean over selectors" if self.mean_over_selectors else ""
        return f"topk({self.fraction:g}, chunk {self.chunk_size}, {values}, {self.index_bits}-bit indices{mean})"

    def mean_into(
        self,
        out: torch.Tensor,
        rows: torch.Tensor,
        payloads: torch.Tensor | None = None,
        weights: list[float] | None = None,
    ) -> None:
        """``out`` ← the average of the decoded payloads ``rows`` (c, m): their sum, added in
        row order (bitwise the same on every replica), over c or, with
        ``mean_over_selectors``, over the rows that *selected* each coordinate: read from the
        payloads' indices, not from the decoded values, since a selected value may decode to
        zero (a zero coordinate, or a quantized value in a bin whose mean is 0). ``weights``:
        the rows' weighted sum over the selectors' summed weights."""
        if not self.mean_over_selectors:
            return super().mean_into(out, rows, weights=weights)
        if payloads is None:
            raise ValueError(f"{self.describe()}: the mean over selectors needs the payloads (their indices)")
        weights = weighted(weights)
        count = self.selection_counts(payloads, rows.shape[-1], weights)
        self._sum_rows(out, rows, weights)
        out.div_(count.masked_fill_(count == 0, 1.0))  # a coordinate no one selected sums to 0

    def selection_counts(self, payloads: torch.Tensor, numel: int, weights: list[float] | None = None) -> torch.Tensor:
        """How many of the payloads ``(c, payload_bytes(numel))`` selected each coordinate:
        float32 ``(numel,)``, one scatter-add of their indices (exact: small integers; with
        ``weights``, the selectors' summed weights, exact too: multiples of 2⁻¹⁶)."""
        self.check_payload(payloads, numel)
        nc, chunk, k = self.chunks(numel)
        c = payloads.shape[0]
        if nc == 0:
            return torch.zeros(0, device=payloads.device)
        index = unpack_indices(payloads[:, self._value_bytes(nc, k) :], self.index_bits, nc * k)
        index = index.reshape(c, nc, k).clamp(max=chunk - 1).permute(1, 0, 2).reshape(nc, c * k)
        if weights is None:
            ones = torch.ones(index.shape, dtype=torch.float32, device=payloads.device)
        else:  # row j's k indices per chunk carry its weight
            ones = (
                torch.tensor(weights, dtype=torch.float32, device=payloads.device)
                .repeat_interleave(k)
                .expand(nc, c * k)
            )
        counts = torch.zeros(nc, chunk, dtype=torch.float32, device=payloads.device)
        counts.scatter_add_(1, index, ones)
        return counts.view(-1)[:numel]

    # ------------------------------------------------------------------ encode / decode

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().reshape(-1)
        nc, chunk, k = self.chunks(x.numel())
        if nc == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        values, index = self._kernel(_select)(x, nc, chunk, k)
        quantizer = self._values_codec(nc, k)
        value_bytes = as_bytes(values.to(self.value_dtype)) if quantizer is None else quantizer.encode(values)
        return torch.cat([value_bytes, pack_indices(index.reshape(-1), self.index_bits)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        size = self.check_payload(payload, numel)
        lead = payload.shape[:-1]
        nc, chunk, k = self.chunks(numel)
        if nc == 0:
            return torch.zeros(*lead, 0, device=payload.device)
        rows = payload.reshape(-1, size)
        split = self._value_bytes(nc, k)
        quantizer = self._values_codec(nc, k)
        if quantizer is None:
            values = from_bytes(rows[:, :split], self.value_dtype).float()
        else:
            values = quantizer.decode(rows[:, :split], nc * k)
        index = unpack_indices(rows[:, split:], self.index_bits, nc * k)
        out = self._kernel(_scatter)(values.reshape(rows.shape[0], nc, k), index.reshape(rows.shape[0], nc, k), chunk)
        out = out.view(rows.shape[0], nc * chunk)
        if nc * chunk != numel:
            out = out[:, :numel].contiguous()
        return out.reshape(*lead, numel)


def sparseloco_codec() -> TopK.Config:
    """SparseLoCo's codec as ``diloco/sparseloco`` ships it (one definition for the config and the
    link planner, which reads it without loading a trainer config): the 64 largest of every
    4,096-element chunk (1.56%), 12-bit chunk-local indices, 2-bit statistical values with one
    table per 8 chunks, each coordinate averaged over the replicas that selected it."""
    return TopK.Config(
        fraction=64 / 4096,
        chunk_size=4096,
        value_bits=2,
        value_scheme="statistical",
        value_block_chunks=8,
        index_bits=12,
        mean_over_selectors=True,
    )


def _select(x: torch.Tensor, nc: int, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest magnitudes of each chunk: (values float32 (nc, k), chunk-local indices
    int64 (nc, k)). A last partial chunk is zero-padded."""
    pad = nc * chunk - x.numel()
    xc = (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(nc, chunk)
    index = xc.abs().topk(k, dim=1, sorted=False).indices
    return xc.gather(1, index).float(), index


def _scatter(values: torch.Tensor, index: torch.Tensor, chunk: int) -> torch.Tensor:
    """``(b, nc, k)`` values into zeros ``(b, nc, chunk)`` at their chunk-local indices.

    A valid payload never points past its chunk (of ``chunk`` elements: shorter than
    ``chunk_size`` for a tensor smaller than one chunk); a corrupt one is clamped there.
    """
    index = index.clamp(max=chunk - 1)
    out = torch.zeros(*values.shape[:-1], chunk, dtype=torch.float32, device=values.device)
    return out.scatter_(-1, index, values)
