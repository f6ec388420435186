"""Blockwise scalar quantization to 1, 2, 4 or 8 bits per element.

The tensor is cut into blocks of ``block_size`` elements. A tensor smaller than a block is
one block of its own size, so tiny tensors do not pay for a whole block; a last partial
block is padded by repeating its own elements, so its statistics are those of its real
elements (the padding is not sent). Each element becomes a ``bits``-bit code, packed
several to a byte (``packing``), and each block carries a little float32 metadata from
which the decoder builds the block's table of ``2**bits`` reconstruction values. Payload =
``[metadata: nblocks x m float32][packed codes]``, so its size is a formula of numel.

Schemes (``n = 2**bits`` bins):

- ``statistical`` (MuLoCo's): per block mean μ and σ = std(x − μ); ``n`` uniform bins of
  width ``s = R·σ/n`` centred on μ, ``q = clamp(floor((x − μ)/s + n/2), 0, n − 1)`` (``n``
  is even, so μ is a bin edge and the bins are symmetric about it). Decode
  ``x̂ = μ + LUT[q]`` with ``LUT[j]`` the mean of ``x − μ`` over the block's elements in
  bin ``j`` (one Lloyd step: the data's own centroid; an empty bin gets its centre). μ is
  folded into the table, so the metadata is the ``n`` centroids ``μ + LUT[j]`` (m = n).
  The default range R per bit width minimises the error on Gaussian data given those
  centroids (computed from the Gaussian's truncated moments): 2 bits R = 3.93 (edges at
  0, ±0.98σ: Lloyd–Max's 4-level quantizer, bound 0.343), 4 bits R = 5.12 (step 0.32σ;
  bound 0.104), 8 bits R = 7.57 (step 0.030σ; bound 0.009). At 1 bit the only edge is μ
  and R only places the empty-bin fallback; R = 4·sqrt(2/π) makes that ±0.80σ, the
  Gaussian half-means. Metadata is n float32 per block, so the default block grows with
  the bit width to keep it at ≤ 0.125 bits per element: 4096 (1 and 2 bits: 0.016 and
  0.031), 16384 (4 bits: 0.031), 65536 (8 bits: 0.125).
- ``absmax`` (naive baseline, also the top-k value quantizer): a = max|x| per block,
  ``n`` equal bins over [−a, a] decoded to their midpoints (m = 1). Default block 4096.
- ``minmax``: ``n`` equal bins over [min, max] decoded to their midpoints (m = 2: min and
  step). Default block 4096.

Measured relative error ‖x̂ − x‖/‖x‖ with the default blocks and ranges, on 2**20 samples
(fixed seeds; Student-t with 3 degrees of freedom), and the bound ``tests/test_compress.py``
asserts (the measurement plus ~3%):

    scheme       bits   Gaussian          Student-t(3)      Laplace
                        measured  bound   measured  bound   measured  bound
    statistical    1    0.602     0.62    0.763     0.79    0.707     0.73
    statistical    2    0.343     0.35    0.548     0.57    0.423     0.44
    statistical    4    0.104     0.108   0.348     0.36    0.171     0.176
    statistical    8    0.0091    0.0095  0.248     0.26    0.050     0.052
    absmax         1    1.287     1.33    7.97      8.2     2.57      2.65
    absmax         2    0.560     0.58    3.75      3.9     1.11      1.15
    absmax         4    0.139     0.144   0.736     0.76    0.234     0.24
    absmax         8    0.0087    0.0090  0.0385    0.040   0.0143    0.0148
    minmax         1    1.183     1.22    3.83      3.95    2.17      2.23
    minmax         2    0.528     0.545   1.85      1.9     0.900     0.93
    minmax         4    0.132     0.136   0.471     0.49    0.211     0.218
    minmax         8    0.0083    0.0085  0.0296    0.0305  0.0132    0.0136

The statistical scheme is at the Gaussian bounds above (0.343 against Lloyd–Max's 0.3428
at 2 bits; MuLoCo's setting R = 6σ gives 0.40 here). Heavy tails are its weak side:
everything beyond ±R/2·σ falls in the two outer bins and decodes to their centroid, so a
few far outliers dominate the error (at 8 bits absmax, whose range reaches the largest
value, does better on Student-t). Error feedback carries what is clipped to the next
round; ``range_sigmas`` widens the range. absmax and minmax spend their levels on the
block's extremes, which is why they are the naive baselines at 1 and 2 bits.

Statistics (``statistics``): the statistical scheme's per-block sums can be taken two ways.
``float`` sums float32 values (one pass each for Σx and ‖x‖, a serial ``bincount`` for the
centroids: the fastest on a CPU). ``exact`` sums integers: each element as a 30-bit fixed
point number scaled by its block's absolute maximum (a power of two, so the scaling is
exact), accumulated in int64. Integer sums do not depend on the order of the additions,
so the result is the same bit for bit on every device, in any kernel, with atomics or
without: the compiled kernels (``compiled=True``) reproduce the eager
payloads byte for byte, and a GPU's eager path (whose float ``index_add_`` is atomic, hence
run-to-run different) becomes reproducible. The fixed point keeps 30 bits of Σx and 22 of
Σx² relative to the block maximum, far below the grid's own resolution. ``auto`` takes
``float`` for eager kernels on a CPU and ``exact`` everywhere else. absmax and minmax need
no sums (max and min are exact in any order): their payloads are identical either way.

Everything is vectorised torch on the input's device; ``decode`` takes any leading batch
dimensions. Inputs must be finite.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .codec import Codec
from .packing import as_bytes, check_bits, from_bytes, pack, pack_columns, packed_bytes, unpack, unpack_columns

SCHEMES = ("statistical", "absmax", "minmax")
STATISTICS = ("auto", "exact", "float")
MEAN_AT = ("edge", "centre")
DEFAULT_RANGE_SIGMAS = {1: 4.0 * math.sqrt(2.0 / math.pi), 2: 3.93, 4: 5.12, 8: 7.57}
DEFAULT_BLOCK_SIZE = {
    "statistical": {1: 4096, 2: 4096, 4: 16384, 8: 65536},
    "absmax": {1: 4096, 2: 4096, 4: 4096, 8: 4096},
    "minmax": {1: 4096, 2: 4096, 4: 4096, 8: 4096},
}
METADATA_FLOATS = {"statistical": None, "absmax": 1, "minmax": 2}  # None: one per bin
FIXED_POINT_BITS = 30
"""Exact statistics: |x| / 2**e < 1 becomes an int32 with this many fraction bits."""


class Quantizer(Codec):
    name = "quantize"

    @dataclass(kw_only=True, slots=True)
    class Config(Codec.Config):
        bits: int = 2
        """Bits per element: 1 | 2 | 4 | 8."""
        scheme: str = "statistical"
        """statistical (mean, σ-range bins, centroid table) | absmax | minmax (uniform per block)."""
        block_size: int = 0
        """Elements per block of statistics / scales (0 = the default for ``bits``: 4096, larger
        at 4 and 8 bits so the statistical tables stay ≤ 0.125 bits/element)."""
        range_sigmas: float = 0.0
        """statistical: bin range in σ (0 = the default for ``bits``, near Lloyd–Max)."""
        statistics: str = "auto"
        """statistical: auto | exact (integer sums: bitwise the same on every device and
        kernel) | float (float32 sums: fastest on a CPU). auto = float for eager kernels on
        a CPU, exact otherwise."""
        mean_at: str = "edge"
        """statistical: where the block's mean sits on the grid: edge (symmetric bins about it,
        q = floor((x − μ)/s + n/2): muloco's) | centre (a bin's centre, q = round((x − μ)/s + n/2):
        SparseLoCo's reference code)."""
        sample_sigma: bool = False
        """statistical: σ over N − 1 (torch.std's, SparseLoCo's) instead of N."""

        def validate(self) -> None:
            check_bits(self.bits)
            if self.scheme not in SCHEMES:
                raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
            if self.block_size < 0 or self.block_size != int(self.block_size):
                raise ValueError(f"block_size must be > 0 (0: the default), got {self.block_size!r}")
            if not self.range_sigmas >= 0:  # also rejects NaN
                raise ValueError(f"range_sigmas must be > 0 (0: the default), got {self.range_sigmas!r}")
            if self.statistics not in STATISTICS:
                raise ValueError(f"statistics must be one of {STATISTICS}, got {self.statistics!r}")
            if self.mean_at not in MEAN_AT:
                raise ValueError(f"mean_at must be one of {MEAN_AT}, got {self.mean_at!r}")

        def wire_bits(self) -> float:
            return self.bits

        def method_tag(self) -> str:
            return f"{self.bits}bit"

    def __init__(self, config: Config, *, compiled: bool = False):
        super().__init__(config, compiled=compiled)
        if compiled and config.statistics == "float":
            raise ValueError(
                "statistics 'float' runs only in eager kernels (float sums are not reproducible "
                "by compiled ones); use statistics 'exact' or 'auto'"
            )
        self.bits = config.bits
        self.scheme = config.scheme
        self.block_size = config.block_size or DEFAULT_BLOCK_SIZE[config.scheme][config.bits]
        self.range_sigmas = config.range_sigmas or DEFAULT_RANGE_SIGMAS[config.bits]
        self.n_bins = 2**config.bits
        self.meta_floats = METADATA_FLOATS[config.scheme] or self.n_bins
        self.centred = config.mean_at == "centre"

    # ------------------------------------------------------------------ layout

    @property
    def alignment(self) -> int:
        return self.block_size

    def blocks(self, numel: int) -> tuple[int, int]:
        """(number of blocks, block length) for a tensor of ``numel`` elements."""
        if numel == 0:
            return 0, 0
        block = min(self.block_size, numel)
        return -(-numel // block), block

    def payload_bytes(self, numel: int) -> int:
        nb, block = self.blocks(numel)
        return 4 * nb * self.meta_floats + packed_bytes(numel, self.bits)

    def describe(self) -> str:
        extra = f", R {self.range_sigmas:.2f}σ" if self.scheme == "statistical" else ""
        if self.scheme == "statistical":
            extra += (", mean at a bin's centre" if self.centred else "") + (
                ", σ over N−1" if self.config.sample_sigma else ""
            )
        return f"quantize({self.scheme}, {self.bits}b, block {self.block_size}{extra})"

    def exact_statistics(self, device: torch.device) -> bool:
        """Whether the statistical scheme sums integers on ``device`` (see the module docstring)."""
        if self.config.statistics != "auto":
            return self.config.statistics == "exact"
        return self.compiled or device.type != "cpu"

    # ------------------------------------------------------------------ encode

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().reshape(-1)
        numel = x.numel()
        nb, block = self.blocks(numel)
        payload = torch.empty(self.payload_bytes(numel), dtype=torch.uint8, device=x.device)
        if nb == 0:
            return payload
        xb = _blocks(x, nb, block)
        split = 4 * nb * self.meta_floats
        if self.scheme != "statistical":
            meta, packed = self._encode_extremes(xb, payload[split:], numel)
        elif self.exact_statistics(x.device):
            meta, packed = self._encode_exact(xb, numel)
        else:
            meta, packed = self._encode_float(xb, payload[split:], numel)
        if packed is not None:
            payload[split:] = packed
        payload[:split] = as_bytes(meta)
        return payload

    def _encode_float(self, xb: torch.Tensor, out: torch.Tensor, numel: int):
        """float32 statistics, packed straight into ``out`` (the eager CPU path)."""
        mu, step = _float_moments(xb, self._width_per_sigma(xb.shape[1]))
        codes = _codes(xb, *_statistical_grid(mu, step, self.n_bins, self.centred), self.n_bins)
        packed = pack(codes.view(-1)[:numel], self.bits, out=out)  # padding is not sent
        sums, counts = _bin_sums(xb, codes, packed, self.bits)
        return _centroids(sums, counts, mu, step, self.n_bins, centred=self.centred), None

    def _width_per_sigma(self, block: int) -> float:
        """A bin's width in σ of the block (with ``sample_sigma``, σ over N − 1)."""
        width = self.range_sigmas / self.n_bins
        return width * math.sqrt(block / (block - 1)) if self.config.sample_sigma and block > 1 else width

    def _encode_exact(self, xb: torch.Tensor, numel: int):
        """Integer statistics (see the module docstring): two kernels around a little
        per-block arithmetic that both paths share."""
        nb, block = xb.shape
        shift = _square_shift(block)
        exponent, sum_q, sum_sq = self._kernel(_exact_moments)(xb, shift)
        unit = torch.ldexp(torch.ones_like(sum_q, dtype=torch.float64), exponent.long() - FIXED_POINT_BITS)
        mu64 = sum_q.double() * unit / block
        mean_square = sum_sq.double() * (unit * 2.0**shift).square() / block
        sigma = (mean_square - mu64 * mu64).clamp_min(0).sqrt()
        mu, step = mu64.float(), (sigma * self._width_per_sigma(block)).float()
        edge, inv = _statistical_grid(mu, step, self.n_bins, self.centred)
        packed, sums, counts = self._kernel(_codes_and_bin_sums)(xb, edge, inv, exponent, self.bits, numel)
        means = (sums.double() * unit / counts.clamp_min(1)).float()
        return _centroids(means, counts, mu, step, self.n_bins, already_means=True, centred=self.centred), packed

    def _encode_extremes(self, xb: torch.Tensor, out: torch.Tensor, numel: int):
        """absmax / minmax: exact maxima and minima, so one path serves every kernel (eager
        kernels pack straight into ``out``)."""
        lo, hi = self._kernel(_extremes)(xb)
        n = self.n_bins
        if self.scheme == "absmax":
            absmax = torch.maximum(hi, lo.neg())
            meta, edge, inv = absmax, absmax.neg(), _reciprocal(absmax) * (n / 2)
        else:
            step = (hi - lo) / n
            meta, edge, inv = torch.cat([lo, step], dim=1), lo, _reciprocal(step)
        if not self.compiled:
            pack(_codes(xb, edge, inv, n).view(-1)[:numel], self.bits, out=out)
            return meta, None
        return meta, self._kernel(_codes_packed)(xb, edge, inv, self.bits, numel)

    # ------------------------------------------------------------------ decode

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        size = self.check_payload(payload, numel)
        lead = payload.shape[:-1]
        nb, block = self.blocks(numel)
        if nb == 0:
            return torch.zeros(*lead, 0, device=payload.device)
        rows = payload.reshape(-1, size)
        k = rows.shape[0]
        split = 4 * nb * self.meta_floats
        meta = from_bytes(rows[:, :split], torch.float32).reshape(k * nb, self.meta_floats)
        table = self._table(meta).contiguous()  # (k * nb, n): the value of every code
        codes = rows[:, split:]
        if self.compiled:
            out = self._kernel(_lookup_columns)(codes, table, self.bits, block)
        elif self.bits < 8 and block % 2 == 0 and 16 * self.n_bins**2 <= block:  # pair table ≤ 1/8 of out
            out = _lookup_pairs(codes, table, self.bits, numel, block)
        else:
            out = _lookup(unpack(codes, self.bits, numel), table, block)
        if out.shape[1] != numel:
            out = out[:, :numel].contiguous()
        return out.reshape(*lead, numel)

    def _table(self, meta: torch.Tensor) -> torch.Tensor:
        if self.scheme == "statistical":
            return meta
        n = self.n_bins
        j = torch.arange(n, dtype=torch.float32, device=meta.device)
        if self.scheme == "absmax":  # midpoints of n equal bins over [-a, a]
            return meta * ((2 * j + 1 - n) / n)
        lo, step = meta[:, :1], meta[:, 1:]
        return torch.addcmul(lo, step, j + 0.5)


# ------------------------------------------------------------------- statistics


def _float_moments(xb: torch.Tensor, width_per_sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (μ, bin width), float32.

    σ² = E[x²] − μ²: one pass each for Σx and ‖x‖ (torch.var_mean is ~20x slower on CPU).
    It loses precision only where |μ| ≫ σ (|μ|/σ ≳ 1e3), which costs accuracy of the bin
    width, never correctness: the centroids are exact means.
    """
    block = xb.shape[1]
    mu = xb.sum(1, keepdim=True) / block
    var = torch.linalg.vector_norm(xb, dim=1, keepdim=True).square_().div_(block).sub_(mu * mu)
    return mu, var.clamp_min_(0).sqrt_().mul_(width_per_sigma)


def _statistical_grid(
    mu: torch.Tensor, step: torch.Tensor, n: int, centred: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block (lowest bin edge, 1 / bin width): bin = floor((x − edge) / width). The edge is
    μ − R·σ/2 (μ a bin edge), or half a bin lower with ``centred`` (μ a bin's centre: floor of
    (x − μ)/s + n/2 + 1/2, which is round((x − μ)/s + n/2))."""
    return mu - step * (n / 2 + (0.5 if centred else 0.0)), _reciprocal(step)


def _centroids(sums, counts, mu, step, n: int, already_means: bool = False, centred: bool = False) -> torch.Tensor:
    """Each bin's mean (``sums / counts``), or its centre where it is empty: ``(nb, n)`` float32."""
    offset = (0.0 if centred else 0.5) - n / 2
    centres = torch.addcmul(mu, step, torch.arange(n, dtype=torch.float32, device=mu.device) + offset)
    means = sums if already_means else sums / counts.clamp_min(1)
    return torch.where(counts > 0, means, centres)


def _square_shift(block: int) -> int:
    """Right shift of the 30-bit fixed point before squaring, so a block's Σq² fits int64."""
    room = (62 - max(block - 1, 1).bit_length()) // 2  # bits per value with block · 2^(2·room) < 2^62
    return max(0, FIXED_POINT_BITS - min(room, 22))


def _scale_exponent(xb: torch.Tensor) -> torch.Tensor:
    """Per block e with max|x| < 2**e, from the float32 bits of the maximum (clamped so
    2**(30 − e) stays a normal float32): ``(nb, 1)`` int32."""
    absmax = xb.abs().amax(1, keepdim=True)
    biased = (absmax.view(torch.int32) >> 23) & 0xFF
    return (biased - 126).clamp(-96, 128)


def _fixed_point(xb: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """x · 2**(30 − e) truncated to int32 (|·| < 2**30): the scaling is a power of two, so exact."""
    scale = ((FIXED_POINT_BITS + 127 - exponent) << 23).view(torch.float32)
    return (xb * scale).to(torch.int32)


def _exact_moments(xb: torch.Tensor, shift: int):
    """Per block (e, Σq, Σ(q >> shift)²): integers, the same in any summation order."""
    exponent = _scale_exponent(xb)
    q = _fixed_point(xb, exponent)
    coarse = (q >> shift).to(torch.int64)
    return exponent, q.sum(1, keepdim=True, dtype=torch.int64), (coarse * coarse).sum(1, keepdim=True)


def _codes_and_bin_sums(xb, edge, inv, exponent, bits: int, numel: int):
    """Packed codes, and per block and bin the integer Σq and the count: ``(nb, n)`` int64 each."""
    nb, block = xb.shape
    n = 2**bits
    codes = _codes(xb, edge, inv, n)
    index = (codes.to(torch.int64) + torch.arange(0, nb * n, n, device=xb.device).view(nb, 1)).view(-1)
    q = _fixed_point(xb, exponent).to(torch.int64).view(-1)
    sums = torch.zeros(nb * n, dtype=torch.int64, device=xb.device).index_add_(0, index, q)
    counts = torch.zeros(nb * n, dtype=torch.int64, device=xb.device).index_add_(0, index, torch.ones_like(q))
    return _pack_flat(codes, bits, numel), sums.view(nb, n), counts.view(nb, n)


def _extremes(xb: torch.Tensor):
    return xb.amin(1, keepdim=True), xb.amax(1, keepdim=True)


def _codes_packed(xb, edge, inv, bits: int, numel: int) -> torch.Tensor:
    return _pack_flat(_codes(xb, edge, inv, 2**bits), bits, numel)


def _pack_flat(codes: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` codes (a last block's padding is not sent), packed: by word
    views in eager mode (fewer passes on a CPU), by column shifts when compiled."""
    flat = codes.reshape(-1)[:numel]
    if not torch.compiler.is_compiling():
        return pack(flat, bits)
    pad = (-numel) % (8 // bits)
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return pack_columns(flat, bits)


def _lookup_columns(packed: torch.Tensor, table: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Decode for compiled kernels: unpack by column shifts, then one gather per code."""
    codes = unpack_columns(packed, bits)
    return _lookup(codes, table, block)


# ---------------------------------------------------------------------- helpers


def _blocks(x: torch.Tensor, nb: int, block: int) -> torch.Tensor:
    """``(nb, block)`` float32 view of x; a partial last block repeats its own elements."""
    x = x.float()
    pad = nb * block - x.numel()
    if pad:
        tail = x[(nb - 1) * block :]
        x = torch.cat([x, tail.repeat(-(-pad // tail.numel()))[:pad]])
    return x.view(nb, block)


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """t padded with zeros along its last dimension to ``length``."""
    return t if t.shape[-1] == length else torch.nn.functional.pad(t, (0, length - t.shape[-1]))


def _reciprocal(t: torch.Tensor) -> torch.Tensor:
    """1/t, with 0 where that is not finite (a constant block: every code decodes alike)."""
    r = t.reciprocal()
    return torch.where(torch.isfinite(r), r, torch.zeros_like(r))


def _codes(xb: torch.Tensor, edge: torch.Tensor, inv_width: torch.Tensor, n: int) -> torch.Tensor:
    """floor(clamp((x − edge) · inv_width, 0, n − 1)) as uint8: four passes over the block.

    Each op broadcasts one per-block operand, which keeps torch's CPU loops vectorised
    (``addcmul`` with two broadcast operands is ~3x slower). Conversion truncates toward
    zero, which is floor on the clamped (non-negative) values; int8 converts faster than
    uint8 on CPU and holds codes up to 127.
    """
    z = xb - edge
    z *= inv_width
    z.clamp_(0, n - 1)
    return z.to(torch.int8).view(torch.uint8) if n <= 128 else z.to(torch.uint8)


def _lookup(codes: torch.Tensor, table: torch.Tensor, block: int) -> torch.Tensor:
    """``(k, numel)`` codes, ``(k * nb, n)`` tables -> ``(k, nb * block)`` values: one gather."""
    rows, n = table.shape
    index = _pad(codes, rows // codes.shape[0] * block).to(torch.int32).view(rows, block)
    index += torch.arange(0, rows * n, n, dtype=torch.int32, device=table.device).view(-1, 1)
    return table.view(-1).index_select(0, index.view(-1)).view(codes.shape[0], -1)


def _lookup_pairs(packed: torch.Tensor, table: torch.Tensor, bits: int, numel: int, block: int) -> torch.Tensor:
    """``_lookup`` two codes at a time, from the packed bytes.

    Two neighbouring codes read together are one ``2 * bits``-bit code (low code first,
    as packed), which indexes a per-block table of all ``n²`` pairs of values, each pair
    one float64. Half the indices to build and gather, and no unpacking at all at 4 bits
    (a byte is a pair); the gather is the dominant cost of decoding. Needs an even block.
    """
    rows, n = table.shape
    k = packed.shape[0]
    pairs = unpack(packed, 2 * bits, (numel + 1) // 2)  # the last pair may hold a padding code
    index = _pad(pairs, rows // k * block // 2).to(torch.int32).view(rows, block // 2)
    index += torch.arange(0, rows * n * n, n * n, dtype=torch.int32, device=table.device).view(-1, 1)
    low, high = table.view(rows, 1, n).expand(rows, n, n), table.view(rows, n, 1).expand(rows, n, n)
    pair_table = torch.stack([low, high], dim=-1)  # [r, h, l] = (value of l, value of h): pair code l + n·h
    out = pair_table.view(torch.float64).view(-1).index_select(0, index.view(-1))
    return out.view(torch.float32).view(k, -1)


def _bin_sums(xb: torch.Tensor, codes: torch.Tensor, packed: torch.Tensor, bits: int):
    """Per block and bin: the sum of x and the number of elements, each ``(nb, n)`` float32.

    The sums are one segmented sum over (block, bin) indices, for every bin of every
    block at once. The counts come from the packed bytes where whole blocks were packed:
    a histogram of byte values per block (``8 // bits`` times fewer elements) times a
    256 x n table of how often each code occurs in each byte value.
    """
    nb, block = xb.shape
    n = 2**bits
    # int16 streams half the bytes through bincount (CPU); index_add_ needs int32
    index_dtype = torch.int16 if xb.device.type == "cpu" and nb * n <= 2**15 else torch.int32
    index = codes.to(index_dtype)
    index += torch.arange(0, nb * n, n, dtype=index_dtype, device=xb.device).view(nb, 1)
    index = index.view(-1)
    sums = segment_sum(index, xb.reshape(-1), nb * n).view(nb, n)
    if bits == 8 or packed.numel() * 8 != nb * block * bits or block * bits % 8:
        return sums, segment_sum(index, None, nb * n).view(nb, n).float()
    per_block = block * bits // 8
    byte_index = packed.view(nb, per_block).to(torch.int32)
    byte_index += torch.arange(0, nb * 256, 256, dtype=torch.int32, device=xb.device).view(nb, 1)
    histogram = segment_sum(byte_index.view(-1), None, nb * 256).view(nb, 256).float()
    # float64: exact counts whatever the matmul precision setting (TF32 would round them)
    return sums, (histogram.double() @ _code_counts(bits, xb.device).double()).float()


@functools.lru_cache(maxsize=None)
def _code_counts(bits: int, device: torch.device) -> torch.Tensor:
    """``(256, 2**bits)``: how many times each code occurs in each byte value."""
    n = 2**bits
    shifts = torch.arange(0, 8, bits, device=device)
    codes = (torch.arange(256, device=device).view(256, 1) >> shifts) & (n - 1)  # (256, 8 // bits)
    return (codes.unsqueeze(-1) == torch.arange(n, device=device)).sum(1).float()


def segment_sum(
    index: torch.Tensor, weights: torch.Tensor | None, size: int, use_bincount: bool | None = None
) -> torch.Tensor:
    """Sum of ``weights`` (or the count, if None) per value of ``index`` in ``[0, size)``.

    CPU: ``bincount`` (about twice as fast as ``index_add_`` there). Other devices:
    ``index_add_``, which needs no host synchronisation (``bincount`` reads the maximum).
    """
    if use_bincount is None:
        use_bincount = index.device.type == "cpu"
    if use_bincount:
        out = torch.bincount(index, weights=weights, minlength=size)
        return out if weights is None else out.to(torch.float32)
    if index.dtype not in (torch.int32, torch.int64):
        index = index.to(torch.int32)
    if weights is None:
        ones = torch.ones((), dtype=torch.int32, device=index.device).expand(index.numel())
        return torch.zeros(size, dtype=torch.int32, device=index.device).index_add_(0, index, ones)
    return torch.zeros(size, dtype=torch.float32, device=index.device).index_add_(0, index, weights)
