"""Top-k sparsification with a fixed k per chunk, so every replica sends the same bytes.

A global top-k would give each replica a different index spread and, with any
entropy-coded index, a different size. Here the tensor is cut into chunks of
``chunk_size`` (≤ 65536) elements and each chunk keeps exactly
``k = max(1, round(fraction · chunk))`` entries, its largest magnitudes, so the payload is
a formula of numel: ``[values][indices]``. Indices are chunk-local, 16 bits each (stored as
int16 bit patterns, read back with ``& 0xFFFF``). Values are bfloat16, float16 or float32,
or quantized to ``value_bits`` = 8, 4 or 2 bits with a per-chunk absmax scale (the
``absmax`` quantizer with one block per chunk). A tensor smaller than a chunk is one chunk
of its own size; a last partial chunk is zero-padded (the padding can only be picked when
the chunk has fewer than k non-zeros, and decodes to zeros that are cut off).

Decode scatters the values into zeros, for any number of leading batch dimensions. Indices
of a corrupt payload (buffers left by a failed collective) are clamped into their chunk, so
decoding garbage never indexes out of bounds (on a GPU: a device-side assert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec import Codec
from .dense import dtype_name, resolve_dtype
from .packing import as_bytes, from_bytes
from .quantize import Quantizer

MAX_CHUNK = 65536  # chunk-local indices must fit 16 bits
VALUE_BITS = (0, 2, 4, 8)  # 0: values in value_dtype


class TopK(Codec):
    name = "topk"

    @dataclass(kw_only=True, slots=True)
    class Config(Codec.Config):
        fraction: float = 0.1
        """Fraction of each chunk kept, in (0, 1]."""
        chunk_size: int = 4096
        """Elements per chunk (≤ 65536: indices are chunk-local, 16 bits)."""
        value_dtype: str = "bfloat16"
        """Dtype of kept values (float32 | bfloat16 | float16) unless ``value_bits``."""
        value_bits: int = 0
        """Quantize kept values to 2 | 4 | 8 bits (per-chunk absmax; 0 = send them in ``value_dtype``)."""

        def validate(self) -> None:
            if not 0 < self.fraction <= 1:  # also rejects NaN
                raise ValueError(f"fraction must be in (0, 1], got {self.fraction!r}")
            if not 1 <= self.chunk_size <= MAX_CHUNK or self.chunk_size != int(self.chunk_size):
                raise ValueError(f"chunk_size must be an integer in [1, {MAX_CHUNK}] (16-bit indices), "
                                 f"got {self.chunk_size!r}")
            resolve_dtype(self.value_dtype, "value_dtype")
            if self.value_bits not in VALUE_BITS:
                raise ValueError(f"value_bits must be one of {VALUE_BITS} (0: values in value_dtype), "
                                 f"got {self.value_bits!r}")

    def __init__(self, config: Config, *, compiled: bool = False):
        super().__init__(config, compiled=compiled)
        self.fraction = float(config.fraction)
        self.chunk_size = int(config.chunk_size)
        self.value_dtype = resolve_dtype(config.value_dtype, "value_dtype")
        self.value_bits = config.value_bits

    # ------------------------------------------------------------------ layout

    @property
    def alignment(self) -> int:
        return self.chunk_size

    def chunks(self, numel: int) -> tuple[int, int, int]:
        """(number of chunks, chunk length, k) for a tensor of ``numel`` elements."""
        if numel == 0:
            return 0, 0, 0
        chunk = min(self.chunk_size, numel)
        return -(-numel // chunk), chunk, max(1, round(self.fraction * chunk))

    def _values_codec(self, k: int) -> Quantizer | None:
        if not self.value_bits:
            return None
        return Quantizer.Config(bits=self.value_bits, scheme="absmax", block_size=max(k, 1)).build(
            compiled=self.compiled)

    def _value_bytes(self, nc: int, k: int) -> int:
        quantizer = self._values_codec(k)
        if quantizer is None:
            return nc * k * self.value_dtype.itemsize
        return quantizer.payload_bytes(nc * k)

    def payload_bytes(self, numel: int) -> int:
        nc, _, k = self.chunks(numel)
        return self._value_bytes(nc, k) + 2 * nc * k

    def describe(self) -> str:
        values = f"{self.value_bits}b absmax" if self.value_bits else dtype_name(self.value_dtype)
        return f"topk({self.fraction:g}, chunk {self.chunk_size}, {values})"

    # ------------------------------------------------------------------ encode / decode

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().reshape(-1)
        nc, chunk, k = self.chunks(x.numel())
        if nc == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        values, index16 = self._kernel(_select)(x, nc, chunk, k)
        quantizer = self._values_codec(k)
        value_bytes = as_bytes(values.to(self.value_dtype)) if quantizer is None else quantizer.encode(values)
        return torch.cat([value_bytes, as_bytes(index16)])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        size = self.check_payload(payload, numel)
        lead = payload.shape[:-1]
        nc, chunk, k = self.chunks(numel)
        if nc == 0:
            return torch.zeros(*lead, 0, device=payload.device)
        rows = payload.reshape(-1, size)
        split = self._value_bytes(nc, k)
        quantizer = self._values_codec(k)
        if quantizer is None:
            values = from_bytes(rows[:, :split], self.value_dtype).float()
        else:
            values = quantizer.decode(rows[:, :split], nc * k)
        index = from_bytes(rows[:, split:], torch.int16)
        out = self._kernel(_scatter)(values.reshape(rows.shape[0], nc, k), index.reshape(rows.shape[0], nc, k), chunk)
        out = out.view(rows.shape[0], nc * chunk)
        if nc * chunk != numel:
            out = out[:, :numel].contiguous()
        return out.reshape(*lead, numel)


def _select(x: torch.Tensor, nc: int, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest magnitudes of each chunk: (values float32 (nc, k), chunk-local indices
    as int16 bit patterns (nc, k)). A last partial chunk is zero-padded."""
    pad = nc * chunk - x.numel()
    xc = (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(nc, chunk)
    index = xc.abs().topk(k, dim=1, sorted=False).indices
    values = xc.gather(1, index).float()
    # chunk-local index i < 65536 as the int16 with the same low 16 bits
    return values, ((index + 32768) & 0xFFFF).sub_(32768).to(torch.int16)


def _scatter(values: torch.Tensor, index16: torch.Tensor, chunk: int) -> torch.Tensor:
    """``(b, nc, k)`` values into zeros ``(b, nc, chunk)`` at their chunk-local indices.

    A valid payload never points past its chunk (of ``chunk`` elements: shorter than
    ``chunk_size`` for a tensor smaller than one chunk); a corrupt one is clamped there.
    """
    index = (index16.to(torch.int64) & 0xFFFF).clamp_(max=chunk - 1)
    out = torch.zeros(*values.shape[:-1], chunk, dtype=torch.float32, device=values.device)
    return out.scatter_(-1, index, values)
