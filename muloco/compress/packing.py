"""Bit packing: 1-, 2- or 4-bit codes, several to a byte, low bits first.

Code ``i`` of a group of ``8 // bits`` codes lands in bits ``[i*bits, (i+1)*bits)`` of its
byte, so four 2-bit codes ``c0..c3`` make the byte ``c0 | c1<<2 | c2<<4 | c3<<6``. A length
that is not a multiple of ``8 // bits`` is padded with zero codes; ``unpack`` takes the
real length back. 8-bit codes are stored as they are.

Why the word tricks: a per-column loop (``c[:, 0] | c[:, 1] << 2 | ...``) makes ``8 // bits``
strided passes over the codes. Here the ``8 // bits`` code bytes of one output byte are
read as one machine word (int16 / int32 / int64, little-endian), and a short cascade of
shift-or steps on whole words slides every code down next to its neighbours (and
``unpack`` slides them back up, then masks). That is two or three shifts per word, on a
tensor ``8 // bits`` times shorter than the codes, whatever the device.
"""

from __future__ import annotations

import sys

import torch

BITS = (1, 2, 4, 8)

if sys.byteorder != "little":  # the word views below assume byte 0 is the low byte
    raise ImportError("muloco.compress.packing assumes a little-endian machine")

# bits -> (word dtype holding the 8 // bits code bytes of one packed byte, shifts, mask)
_WORDS = {
    1: (torch.int64, (7, 14, 28), 0x0101010101010101),
    2: (torch.int32, (6, 12), 0x03030303),
    4: (torch.int16, (4,), 0x0F0F),
}


def check_bits(bits: int, setting: str = "bits") -> int:
    if bits not in BITS:
        raise ValueError(f"{setting} must be one of {BITS}, got {bits!r}")
    return bits


def packed_bytes(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits occupy (the last byte zero-padded)."""
    return (n * bits + 7) // 8


def pack(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(..., n)`` uint8 codes, each ``< 2**bits`` -> ``(..., packed_bytes(n, bits))`` uint8.

    Codes must already be in range: a larger value would spill into its neighbours (the
    quantizers produce clamped codes, so nothing is masked here). ``out``, if given,
    receives the bytes (e.g. a slice of a payload), which saves a copy.
    """
    check_bits(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.clone() if out is None else out.copy_(codes)
    per = 8 // bits
    n = codes.shape[-1]
    if n % per or not codes.is_contiguous():
        pad = (-n) % per
        codes = torch.nn.functional.pad(codes, (0, pad)) if pad else codes.contiguous()
    word_dtype, shifts, _ = _WORDS[bits]
    v = codes.view(word_dtype)
    for shift in shifts:
        shifted = v >> shift
        shifted |= v
        v = shifted
    if out is None:
        return v.to(torch.uint8)  # the low byte holds the packed codes
    return out.copy_(v)


def unpack(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """``(..., nbytes)`` uint8 -> ``(..., n)`` uint8 codes; the exact inverse of ``pack``."""
    check_bits(bits)
    if data.dtype != torch.uint8:
        raise ValueError(f"packed data must be uint8, got {data.dtype}")
    if data.shape[-1] != packed_bytes(n, bits):
        raise ValueError(f"{n} codes of {bits} bits need {packed_bytes(n, bits)} bytes, got {data.shape[-1]}")
    if bits == 8:
        return data
    word_dtype, shifts, mask = _WORDS[bits]
    v = data.to(word_dtype)  # one word per packed byte, the byte in the low bits
    for shift in reversed(shifts):
        v |= v << shift
    v &= mask
    codes = v.view(torch.uint8)
    return codes if codes.shape[-1] == n else codes[..., :n]


INDEX_BITS = (12, 16)


def index_bytes(n: int, bits: int) -> int:
    """Bytes of ``n`` indices of ``bits`` bits: 16-bit ones two bytes each, 12-bit ones three
    bytes per pair (an odd count is padded with one zero index)."""
    return 2 * n if bits == 16 else 3 * ((n + 1) // 2)


def pack_indices(index: torch.Tensor, bits: int) -> torch.Tensor:
    """``(..., n)`` integer indices, each ``< 2**bits`` -> ``(..., index_bytes(n, bits))`` uint8.

    16 bits: little-endian pairs of bytes. 12 bits: indices ``a, b`` of a pair become the
    three bytes ``a & 0xFF``, ``a >> 8 | (b & 0xF) << 4``, ``b >> 4``: whole-column shifts,
    no loop over elements.
    """
    if bits not in INDEX_BITS:
        raise ValueError(f"index bits must be one of {INDEX_BITS}, got {bits!r}")
    if bits == 16:  # i < 65536 as the int16 with the same low 16 bits, read as its two bytes
        index16 = ((index.to(torch.int32) + 32768) & 0xFFFF).sub_(32768).to(torch.int16)
        return index16.contiguous().view(torch.uint8)
    index = index.to(torch.int32)
    if index.shape[-1] % 2:
        index = torch.nn.functional.pad(index, (0, 1))
    a, b = index[..., 0::2], index[..., 1::2]
    out = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=-1)
    return out.to(torch.uint8).flatten(-2)


def unpack_indices(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_indices`: ``(..., index_bytes(n, bits))`` uint8 -> ``(..., n)`` int64."""
    if data.shape[-1] != index_bytes(n, bits):
        raise ValueError(f"{n} indices of {bits} bits need {index_bytes(n, bits)} bytes, got {data.shape[-1]}")
    if bits == 16:
        return from_bytes(data, torch.int16).to(torch.int64) & 0xFFFF
    triples = data.to(torch.int64).unflatten(-1, (-1, 3))
    a = triples[..., 0] | ((triples[..., 1] & 0xF) << 8)
    b = (triples[..., 1] >> 4) | (triples[..., 2] << 4)
    return torch.stack([a, b], dim=-1).flatten(-2)[..., :n]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (native byte order; every replica shares it)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(..., nbytes)`` uint8 read as ``(..., nbytes // itemsize)`` of ``dtype``.

    A view where the layout allows one; a slice of a batch of payloads whose row length
    or offset is not a multiple of the item size (a metadata section, say) is copied
    first, which is cheap because such sections are small.
    """
    if data.numel() == 0:
        return torch.empty(*data.shape[:-1], 0, dtype=dtype, device=data.device)
    try:
        return data.view(dtype)
    except RuntimeError:  # .contiguous() would keep the odd stride of a size-1 dimension
        return torch.empty(data.shape, dtype=torch.uint8, device=data.device).copy_(data).view(dtype)


def pack_columns(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack`` written as shifts of whole columns: the same bytes, in a form
    ``torch.compile`` fuses into one kernel (it cannot fuse the word views above).
    ``(..., n)`` uint8 codes with ``n`` a multiple of ``8 // bits``."""
    if bits == 8:
        return codes
    per = 8 // bits
    columns = codes.reshape(*codes.shape[:-1], -1, per).to(torch.int32)
    out = columns[..., 0]
    for i in range(1, per):
        out = out | (columns[..., i] << (i * bits))
    return out.to(torch.uint8)


def unpack_columns(data: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_columns`: ``(..., nbytes)`` -> ``(..., nbytes * 8 // bits)``
    uint8 codes (padding codes included), as column shifts ``torch.compile`` can fuse."""
    if bits == 8:
        return data
    per = 8 // bits
    words = data.to(torch.int32).unsqueeze(-1)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=data.device)
    codes = (words >> shifts) & (2**bits - 1)
    return codes.to(torch.uint8).reshape(*data.shape[:-1], data.shape[-1] * per)
