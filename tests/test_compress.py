"""Codecs and error feedback: exact sizes, round trips, error bounds, batching, state."""

from __future__ import annotations

import io

import pytest
import torch

from muloco.compress import Dense, ErrorFeedback, Quantizer, TopK, pack, packed_bytes, unpack
from muloco.compress.packing import index_bytes, pack_indices, unpack_indices
from muloco.compress.quantize import _lookup, _lookup_pairs, segment_sum
from muloco.outer.exchange.pipeline import work_weights

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

CODECS = [
    *[("quantize", {"scheme": s, "bits": b}) for s in ("statistical", "absmax", "minmax") for b in (1, 2, 4, 8)],
    ("quantize", {"scheme": "statistical", "bits": 2, "block_size": 7}),  # odd blocks: the one-code lookup
    ("quantize", {"scheme": "minmax", "bits": 4, "block_size": 100}),
    ("topk", {"fraction": 0.01}),
    ("topk", {"fraction": 0.1, "value_dtype": "float32"}),
    ("topk", {"fraction": 0.1, "value_dtype": "float16", "chunk_size": 1000}),
    *[("topk", {"fraction": 0.1, "value_bits": b}) for b in (2, 4, 8)],
    ("topk", {"fraction": 1.0, "chunk_size": 64}),
    (
        "topk",
        {
            "fraction": 64 / 4096,
            "value_bits": 2,
            "value_scheme": "statistical",
            "value_block_chunks": 64,
            "index_bits": 12,
            "mean_over_selectors": True,
        },
    ),  # diloco/sparseloco's codec
    ("topk", {"fraction": 0.3, "chunk_size": 7, "index_bits": 12}),  # odd index counts: a padded pair
    *[("dense", {"dtype": d}) for d in ("float32", "bfloat16", "float16")],
]
KINDS = {"quantize": Quantizer, "topk": TopK, "dense": Dense}


def make_codec(kind: str, **settings):
    return KINDS[kind].Config(**settings).build()


def feedback(**settings) -> ErrorFeedback:
    return ErrorFeedback(ErrorFeedback.Config(**settings))


IDS = [f"{k}-{'-'.join(f'{v}' for v in s.values())}" for k, s in CODECS]
SIZES = [0, 1, 7, 4097, 10000]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gaussian(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=gen(seed))


def student_t(n: int, df: int = 3, seed: int = 0) -> torch.Tensor:
    g = gen(seed)
    z = torch.randn(n, generator=g)
    chi2 = torch.randn(df, n, generator=g).square().sum(0)
    return z / (chi2 / df).sqrt()


def laplace(n: int, seed: int = 0) -> torch.Tensor:
    u = torch.rand(n, generator=gen(seed)) - 0.5
    return -u.sign() * torch.log1p(-2 * u.abs())


def rel_error(codec, x: torch.Tensor) -> float:
    return ((codec.decode(codec.encode(x), x.numel()) - x).norm() / x.norm()).item()


# ---------------------------------------------------------------------- packing


def _reference_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    out = [0] * packed_bytes(codes.numel(), bits)
    for i, c in enumerate(codes.tolist()):
        out[i * bits // 8] |= c << (i * bits % 8)
    return torch.tensor(out, dtype=torch.uint8)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 33, 4097])
def test_pack_is_exact_and_low_bits_first(bits, n):
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8, generator=gen(n))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_bytes(n, bits)
    assert torch.equal(packed, _reference_pack(codes, bits))
    assert torch.equal(unpack(packed, bits, n), codes)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_unpack_is_batched_and_pack_writes_into_out(bits):
    codes = torch.randint(0, 2**bits, (3, 2, 45), dtype=torch.uint8, generator=gen())
    packed = torch.stack([torch.stack([pack(c, bits) for c in row]) for row in codes])
    assert torch.equal(unpack(packed, bits, 45), codes)
    out = torch.zeros(packed_bytes(45, bits) + 3, dtype=torch.uint8)
    pack(codes[0, 0], bits, out=out[3:])
    assert torch.equal(out[3:], packed[0, 0]) and not out[:3].any()


def test_packing_rejects_bad_bits_and_sizes():
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(8, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="bytes"):
        unpack(torch.zeros(3, dtype=torch.uint8), 2, 7)


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,settings", CODECS, ids=IDS)
def test_round_trip_shapes_sizes_dtypes(kind, settings, device):
    codec = make_codec(kind, **settings)
    for n in SIZES:
        for dtype in (torch.float32, torch.bfloat16):
            x = gaussian(n, seed=n).to(device=device, dtype=dtype)
            payload = codec.encode(x)
            assert payload.dtype == torch.uint8 and payload.dim() == 1 and payload.device == x.device
            assert payload.numel() == codec.payload_bytes(n)
            y = codec.decode(payload, n)
            assert y.shape == (n,) and y.dtype == torch.float32 and y.device == x.device
            assert torch.isfinite(y).all()
    # a 2-D input is flattened; the payload size never depends on the values
    x = gaussian(4097).view(17, 241).to(device)
    assert codec.encode(x).numel() == codec.encode(torch.zeros(4097, device=device)).numel()
    assert codec.decode(codec.encode(torch.zeros(4097, device=device)), 4097).abs().max() == 0


@pytest.mark.parametrize("kind,settings", CODECS, ids=IDS)
def test_batched_decode_equals_per_payload_decode(kind, settings):
    codec = make_codec(kind, **settings)
    n = 10000
    payloads = torch.stack([codec.encode(gaussian(n, seed=s)) for s in range(3)])
    each = torch.stack([codec.decode(p, n) for p in payloads])
    assert torch.equal(codec.decode(payloads, n), each)
    assert torch.equal(codec.decode(payloads.view(1, 3, -1), n), each.view(1, 3, n))
    with pytest.raises(ValueError, match="payload"):
        codec.decode(payloads[:, 1:], n)


def test_identity_is_lossless_and_never_aliases():
    x = gaussian(1000)
    original = x.clone()
    codec = make_codec("dense", dtype="float32")
    payload = codec.encode(x)
    x.add_(1.0)  # the payload is a copy
    y = codec.decode(payload, 1000)
    assert torch.equal(y, original)
    payload.zero_()  # so is the decoded tensor
    assert y.abs().sum() > 0
    assert codec.bits_per_element(1000) == 32 and make_codec("dense", dtype="bfloat16").bits_per_element(1000) == 16


def test_constant_blocks_are_exact():
    """Zero spread: no division by zero, and the block decodes exactly (absmax: zeros)."""
    for scheme in ("statistical", "absmax", "minmax"):
        for bits in (1, 2, 4, 8):
            q = make_codec("quantize", bits=bits, scheme=scheme, block_size=64)
            constants = (torch.zeros(200),) if scheme == "absmax" else (torch.zeros(200), torch.full((200,), -0.375))
            for x in constants:
                assert torch.equal(q.decode(q.encode(x), 200), x), (scheme, bits)


def test_pair_lookup_equals_one_code_lookup():
    """The fast decode path (two codes per gather) against the plain one."""
    for bits in (1, 2, 4):
        for numel, block in ((10000, 4096), (4097, 4096), (9, 4), (1001, 10)):
            k, nb, n = 3, -(-numel // block), 2**bits
            codes = torch.randint(0, n, (k, numel), dtype=torch.uint8, generator=gen(numel))
            table = torch.randn(k * nb, n, generator=gen(bits))
            packed = torch.stack([pack(c, bits) for c in codes])
            plain = _lookup(codes, table, block)
            assert torch.equal(_lookup_pairs(packed, table, bits, numel, block)[:, :numel], plain[:, :numel])


@pytest.mark.parametrize("use_bincount", [True, False])
def test_segment_sum_both_branches(use_bincount):
    index = torch.randint(0, 50, (1000,), dtype=torch.int16, generator=gen())
    w = torch.randn(1000, generator=gen(1))
    ref_sum = torch.zeros(50, dtype=torch.float64).index_add_(0, index.long(), w.double())
    ref_count = torch.bincount(index.long(), minlength=50)
    assert torch.allclose(segment_sum(index, w, 50, use_bincount).double(), ref_sum, atol=1e-5)
    assert torch.equal(segment_sum(index, None, 50, use_bincount).long(), ref_count)


# ---------------------------------------------------------------------- error bounds

# Bounds on ‖x̂ − x‖/‖x‖ for 2**20 samples: the table in muloco/compress/quantize.py's
# docstring (measured values plus ~3%). Columns: Gaussian, Student-t(3), Laplace.
ERROR_BOUNDS = {
    ("statistical", 1): (0.62, 0.79, 0.73),
    ("statistical", 2): (0.35, 0.57, 0.44),
    ("statistical", 4): (0.108, 0.36, 0.176),
    ("statistical", 8): (0.0095, 0.26, 0.052),
    ("absmax", 1): (1.33, 8.2, 2.65),
    ("absmax", 2): (0.58, 3.9, 1.15),
    ("absmax", 4): (0.144, 0.76, 0.24),
    ("absmax", 8): (0.0090, 0.040, 0.0148),
    ("minmax", 1): (1.22, 3.95, 2.23),
    ("minmax", 2): (0.545, 1.9, 0.93),
    ("minmax", 4): (0.136, 0.49, 0.218),
    ("minmax", 8): (0.0085, 0.0305, 0.0136),
}


@pytest.fixture(scope="module")
def samples():
    n = 2**20
    return gaussian(n, seed=1), student_t(n, seed=2), laplace(n, seed=3)


@pytest.mark.parametrize("scheme,bits", list(ERROR_BOUNDS))
def test_error_within_documented_bounds(scheme, bits, samples):
    q = make_codec("quantize", bits=bits, scheme=scheme)
    errors = [rel_error(q, x) for x in samples]
    bounds = ERROR_BOUNDS[scheme, bits]
    assert all(e <= b for e, b in zip(errors, bounds)), (errors, bounds)


def test_two_bit_statistical_near_lloyd_max(samples):
    # the best 4-level scalar quantizer of a Gaussian has 0.3428; MuLoCo's R = 6σ has ~0.40
    assert rel_error(make_codec("quantize", bits=2, scheme="statistical"), samples[0]) <= 0.36
    assert rel_error(make_codec("quantize", bits=2, scheme="statistical", range_sigmas=6.0), samples[0]) > 0.38


# ---------------------------------------------------------------------- top-k


@pytest.mark.parametrize("numel,chunk,fraction", [(10000, 4096, 0.01), (10000, 1000, 0.1), (5, 4096, 0.5)])
def test_topk_keeps_exactly_the_largest_magnitudes_of_each_chunk(numel, chunk, fraction):
    codec = make_codec("topk", fraction=fraction, chunk_size=chunk, value_dtype="float32")
    x = gaussian(numel)
    y = codec.decode(codec.encode(x), numel)
    nc, chunk, k = codec.chunks(numel)
    for c in range(nc):
        xs, ys = x[c * chunk : (c + 1) * chunk], y[c * chunk : (c + 1) * chunk]
        kept = ys.nonzero().view(-1)
        assert torch.equal(ys[kept], xs[kept])  # float32 values are exact
        expected = xs.abs().topk(min(k, xs.numel())).indices
        assert torch.equal(kept.sort().values, expected.sort().values)


def test_topk_indices_cover_the_whole_16_bit_range():
    x = torch.zeros(65536)
    x[[0, 32767, 32768, 65535]] = torch.tensor([1.0, -2.0, 3.0, -4.0])
    codec = make_codec("topk", fraction=4 / 65536, chunk_size=65536, value_dtype="float32")
    assert torch.equal(codec.decode(codec.encode(x), x.numel()), x)


def test_topk_payload_is_a_formula_of_numel():
    codec = make_codec("topk", fraction=0.01, chunk_size=4096, value_dtype="bfloat16")
    assert codec.payload_bytes(3 * 4096) == 3 * 41 * (2 + 2)
    assert codec.payload_bytes(3 * 4096 + 1) == 4 * 41 * (2 + 2)
    assert codec.payload_bytes(100) == 1 * (2 + 2)
    q = make_codec("topk", fraction=0.1, chunk_size=4096, value_bits=4)
    assert q.payload_bytes(4096 * 2) == 2 * 4 + 410 * 2 * 4 // 8 + 2 * 410 * 2


@pytest.mark.parametrize("bits", [12, 16])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 64])
def test_indices_pack_to_their_formula_and_back(bits, n):
    index = torch.randint(0, 2**bits, (3, n), generator=gen(n))
    index[0, :2] = 2**bits - 1  # the top of the range survives
    data = pack_indices(index, bits)
    assert data.dtype == torch.uint8 and data.shape == (3, index_bytes(n, bits))
    assert index_bytes(n, bits) == (2 * n if bits == 16 else 3 * ((n + 1) // 2))
    assert torch.equal(unpack_indices(data, bits, n), index)


def test_sparseloco_payload_is_its_bits_per_parameter_formula():
    """diloco/sparseloco's codec keeps 64 of each 4096: 64 × (12-bit index + 2-bit value) per
    chunk and one 4-entry float32 table per 8 chunks = 912 bytes per 32768 parameters, 0.2227
    bits per parameter (SparseLoCo's 0.219 plus the tables)."""
    from muloco import compat

    compat.apply()  # before the config imports torchtitan's trainer
    from muloco.config import load_config

    codec = load_config("diloco/sparseloco").outer.exchange.codec.build()
    per_block = 8 * (64 * 12 // 8 + 64 * 2 // 8) + 4 * 4
    assert per_block == 912
    for blocks in (1, 3):
        assert codec.payload_bytes(blocks * 8 * 4096) == blocks * per_block
    assert codec.bits_per_element(8 * 4096) == pytest.approx(0.22266, abs=1e-5)
    for n in (1_300_000, 10**7, 150 * 10**6):  # tiny, small and 150M models: a partial last block
        assert codec.bits_per_element(n) <= 0.225
    assert codec.alignment == 8 * 4096


def test_mean_over_selectors_divides_each_coordinate_by_who_sent_it():
    plain = make_codec("topk", fraction=0.5, chunk_size=4, value_dtype="float32")
    selectors = make_codec("topk", fraction=0.5, chunk_size=4, value_dtype="float32", mean_over_selectors=True)
    sent = torch.tensor([[2.0, 0.0, 4.0, 0.0], [6.0, 0.0, 0.0, 0.5], [1.0, 0.0, 0.0, 3.0]])
    payloads = torch.stack([selectors.encode(row) for row in sent])
    rows = selectors.decode(payloads, 4)
    out = torch.empty(4)
    plain.mean_into(out, rows)
    assert torch.equal(out, torch.tensor([3.0, 0.0, 4 / 3, 7 / 6]))
    selectors.mean_into(out, rows, payloads)
    assert torch.equal(out, torch.tensor([3.0, 0.0, 4.0, 1.75]))


def test_work_weights_by_hand():
    """Work over the most a contributor did, on a 2⁻¹⁶ grid; non-contributors 0; equal work 1.0."""
    assert work_weights([1, 1, 1], [100.0, 200.0, 400.0]) == [0.25, 0.5, 1.0]
    assert work_weights([1, 0, 1], [300.0, 900.0, 300.0]) == [1.0, 0.0, 1.0]  # the idle one's work is not the max
    assert work_weights([1, 1], [1.0, 3.0]) == [round(65536 / 3) / 65536, 1.0]
    assert work_weights([1, 1], [1e-9, 1.0]) == [1 / 65536, 1.0]  # a contributor never rounds to nothing
    assert work_weights([1, 1], [0.0, 0.0]) == [1.0, 1.0]  # no work reported: the plain mean
    assert work_weights([0, 0], [5.0, 5.0]) == [0.0, 0.0]


@pytest.mark.parametrize("kind", ["dense", "quantize", "topk-selectors"])
def test_weighted_mean_matches_float64_and_weights_of_one_are_the_plain_mean_bitwise(kind):
    codec = {
        "dense": lambda: make_codec("dense"),
        "quantize": lambda: make_codec("quantize", bits=2, block_size=64),
        "topk-selectors": lambda: make_codec(
            "topk", fraction=0.25, chunk_size=64, value_dtype="float32", mean_over_selectors=True
        ),
    }[kind]()
    g = torch.Generator().manual_seed(3)
    payloads = torch.stack([codec.encode(torch.randn(256, generator=g)) for _ in range(3)])
    rows = codec.decode(payloads, 256)
    weights = work_weights([1, 1, 1], [1.0, 2.0, 4.0])
    out = torch.empty(256)
    codec.mean_into(out, rows, payloads, weights)
    w = torch.tensor(weights, dtype=torch.float64).view(-1, 1)
    if kind == "topk-selectors":
        chosen = codec.selection_counts(payloads, 256, weights).double()
        assert torch.equal(chosen, (w * (rows != 0)).sum(0))  # exact: the weights are on the grid
        want = (w * rows.double()).sum(0) / torch.where(chosen > 0, chosen, 1.0)
    else:
        want = (w * rows.double()).sum(0) / w.sum()
    torch.testing.assert_close(out, want.float(), rtol=1e-6, atol=1e-6)
    plain, ones = torch.empty(256), torch.empty(256)
    codec.mean_into(plain, rows, payloads)
    codec.mean_into(ones, rows, payloads, [1.0, 1.0, 1.0])
    assert torch.equal(plain, ones)


def test_a_selected_coordinate_counts_even_when_its_value_is_zero():
    """A replica that selected a coordinate counts in its mean, whatever value it sent: with
    fraction 1 both replicas select everything, so the mean is the plain one."""
    codec = make_codec("topk", fraction=1.0, chunk_size=4, value_dtype="float32", mean_over_selectors=True)
    a, b = torch.tensor([0.0, 1.0, 0.0, 3.0]), torch.tensor([2.0, 2.0, 0.0, 1.0])
    payloads = torch.stack([codec.encode(a), codec.encode(b)])
    assert torch.equal(codec.selection_counts(payloads, 4), torch.full((4,), 2.0))
    out = torch.empty(4)
    codec.mean_into(out, codec.decode(payloads, 4), payloads)
    assert torch.equal(out, torch.tensor([1.0, 1.5, 0.0, 2.0]))
    with pytest.raises(ValueError, match="needs the payloads"):
        codec.mean_into(out, codec.decode(payloads, 4))


def test_selection_counts_follow_the_indices_of_quantized_and_padded_payloads():
    """12-bit indices, 2-bit values and a zero-padded last chunk: the counts are the number of
    payloads whose index set holds each coordinate, nothing past numel."""
    codec = make_codec(
        "topk",
        fraction=0.25,
        chunk_size=64,
        value_bits=2,
        value_scheme="statistical",
        index_bits=12,
        mean_over_selectors=True,
    )
    n = 64 * 3 + 10
    xs = [gaussian(n, seed=s) for s in range(3)]
    payloads = torch.stack([codec.encode(x) for x in xs])
    expected = torch.zeros(n)
    for x in xs:
        for start in range(0, n, 64):
            piece = x[start : start + 64].abs()
            k = max(1, round(0.25 * 64))
            picked = piece.topk(min(k, piece.numel())).indices + start
            expected[picked] += 1
    assert torch.equal(codec.selection_counts(payloads, n), expected)


# ---------------------------------------------------------------------- error feedback


@pytest.mark.parametrize(
    "kind,settings", [c for c in CODECS if c[0] != "dense"], ids=[i for c, i in zip(CODECS, IDS) if c[0] != "dense"]
)
def test_error_feedback_round_identity(kind, settings):
    """The compressed configs' design (β 0.95, the residual is the outer momentum): in every
    round, what is sent plus what is kept equals what came in, decode(C(e)) + e' = β·e + Δ."""
    codec = make_codec(kind, **settings)
    ef = feedback(beta=0.95)
    n = 4097
    for t in range(4):
        delta = gaussian(n, seed=10 + t) * 0.5**t  # shrinking, as under a decaying learning rate
        before = ef.residual("k").clone() if ef.residual("k") is not None else torch.zeros(n)
        sent = codec.decode(ef.compress("k", delta, codec), n)
        torch.testing.assert_close(sent + ef.residual("k"), 0.95 * before + delta, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind,settings", CODECS, ids=IDS)
def test_error_feedback_loses_nothing(kind, settings):
    """β = 1: the decoded payloads of all rounds plus the residual sum to the deltas."""
    codec = make_codec(kind, **settings)
    ef = feedback(beta=1.0)
    n, sent, total = 4097, torch.zeros(4097, dtype=torch.float64), torch.zeros(4097, dtype=torch.float64)
    for r in range(5):
        delta = gaussian(n, seed=r).view(17, 241) * (r + 1)
        payload = ef.compress("w", delta, codec)
        assert payload.numel() == codec.payload_bytes(n)
        sent += codec.decode(payload, n).double()
        total += delta.reshape(-1).double()
    assert torch.allclose(sent + ef.residual("w").double(), total, atol=1e-4)


def test_error_feedback_decay_and_disabled():
    codec = make_codec("quantize", bits=2, scheme="statistical")
    ef, e = feedback(beta=0.5), torch.zeros(3000)
    for r in range(3):
        delta = gaussian(3000, seed=r)
        e = 0.5 * e + delta
        e = e - codec.decode(codec.encode(e), 3000)
        ef.compress("w", delta, codec)
    assert torch.allclose(ef.residual("w"), e, atol=1e-5)
    off = feedback(enabled=False)
    delta = gaussian(3000, seed=9)
    assert torch.equal(off.compress("w", delta, codec), codec.encode(delta)) and len(off) == 0


def test_error_feedback_can_fold_the_outer_lr_as_sparselocos_code_does():
    """``fold_outer_lr``: e ← β·e + η·Δ (the outer step then applies η again, as SparseLoCo's
    reference code); at η = 1 the payload is bitwise the unfolded one."""
    codec = make_codec("quantize", bits=2, scheme="statistical")
    folded = feedback(beta=0.95, fold_outer_lr=True)
    folded.delta_scale, e = 0.7, torch.zeros(3000)
    for r in range(3):
        delta = gaussian(3000, seed=r)
        e = 0.95 * e + 0.7 * delta
        e = e - codec.decode(codec.encode(e), 3000)
        folded.compress("w", delta, codec)
    assert torch.allclose(folded.residual("w"), e, atol=1e-5)
    plain, at_one = feedback(beta=0.95), feedback(beta=0.95, fold_outer_lr=True)
    delta = gaussian(3000, seed=5)
    assert torch.equal(plain.compress("w", delta, codec), at_one.compress("w", delta, codec))


def _sparseloco_values(kept: torch.Tensor, n_bins: int = 4, range_sigmas: float = 6.0):
    """SparseLoCo's reference quantizer (tplr ``_quantize`` / ``_dequantize``, as the paper's code
    and Templar's ``compress.py`` write it) on one tensor's kept values: mean shift, σ over N − 1,
    s = R·σ/n, code = round(c/s + n/2) clamped, each bin decoded to the mean of its members."""
    shift = kept.double().mean()
    centred = kept.double() - shift
    scale = range_sigmas * centred.norm() / (centred.numel() - 1) ** 0.5 / n_bins
    codes = (centred / scale + n_bins // 2).round().clamp(0, n_bins - 1).long()
    sums = torch.zeros(n_bins, dtype=torch.float64).scatter_add_(0, codes, centred)
    counts = torch.zeros(n_bins, dtype=torch.float64).scatter_add_(0, codes, torch.ones_like(centred))
    return (torch.where(counts > 0, sums / counts.clamp_min(1), 0.0)[codes] + shift).float(), codes


@pytest.mark.parametrize("statistics", ["float", "exact"])
@pytest.mark.parametrize("tails", ["gaussian", "student-t"])
def test_centred_values_with_sample_sigma_are_sparselocos_own(statistics, tails):
    """``mean_at centre`` and ``sample_sigma`` (``diloco/sparseloco_published``'s values) send the
    values SparseLoCo's formula gives, code for code, on one tensor's kept values (top-64 of each
    64×64 tile of a 256×512 tensor, one table); muloco's own grid (the mean a bin edge) does not."""
    g = torch.Generator().manual_seed(3)
    e = torch.randn(256, 512, generator=g)
    if tails == "student-t":  # 3 degrees of freedom: z / sqrt(χ²₃ / 3), from the same generator
        e = e / (torch.randn(3, 256, 512, generator=g).square().sum(0) / 3).sqrt()
    tiles = e.reshape(4, 64, 8, 64).permute(0, 2, 1, 3).reshape(32, 4096)
    kept = tiles.gather(1, tiles.abs().topk(64, dim=1).indices).reshape(-1)
    want, codes = _sparseloco_values(kept)
    ours = make_codec(
        "quantize",
        bits=2,
        scheme="statistical",
        block_size=kept.numel(),
        range_sigmas=6.0,
        statistics=statistics,
        mean_at="centre",
        sample_sigma=True,
    )
    got = ours.decode(ours.encode(kept), kept.numel())
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    levels = torch.unique(want)  # the same code everywhere: each value decodes to its own bin's level
    assert torch.equal(
        torch.bucketize(got, (levels[1:] + levels[:-1]) / 2), torch.bucketize(want, (levels[1:] + levels[:-1]) / 2)
    )
    edge = make_codec("quantize", bits=2, scheme="statistical", block_size=kept.numel(), range_sigmas=6.0)
    assert not torch.allclose(edge.decode(edge.encode(kept), kept.numel()), want, rtol=1e-3)


PUBLISHED_VALUES = dict(
    fraction=64 / 4096,
    chunk_size=4096,
    value_bits=2,
    value_scheme="statistical",
    value_block_chunks=0,
    value_range_sigmas=6.0,
    value_mean_at="centre",
    value_sample_sigma=True,
    index_bits=12,
    mean_over_selectors=True,
)
"""``diloco/sparseloco_published``'s codec: top-64 of each 4,096-element tile, one 2-bit table per tensor."""


def test_one_table_per_tensor_sends_sparselocos_values_tensor_by_tensor():
    """Two matrices of different scales in one bucket, stored tile by tile (64×64, as the exchange's
    ``tiles`` 64 lays them out): encoded tensor by tensor (``Pieces``, as the exchange encodes a
    per-tensor codec's bucket), each tensor's kept values decode to SparseLoCo's formula with that
    tensor's own table; one table over both (a fixed-size value block spanning them) would not."""
    from muloco.compress import Pieces
    from muloco.config import load_config

    assert load_config("diloco/sparseloco_published").outer.exchange.codec == TopK.Config(**PUBLISHED_VALUES)
    g = torch.Generator().manual_seed(5)
    small, large = torch.randn(128, 256, generator=g) * 0.01, torch.randn(256, 128, generator=g)
    tiled = [
        t.reshape(t.shape[0] // 64, 64, t.shape[1] // 64, 64).permute(0, 2, 1, 3).reshape(-1, 4096)
        for t in (small, large)
    ]
    codec = make_codec("topk", **PUBLISHED_VALUES)
    assert codec.per_tensor and "per tensor" in codec.describe()
    bucket = torch.cat([t.reshape(-1) for t in tiled])
    pieces = Pieces(codec, [(0, small.numel()), (small.numel(), bucket.numel())])
    got = pieces.decode(pieces.encode(bucket), bucket.numel())
    for t, (a, b) in zip(tiled, pieces.bounds):
        index = t.abs().topk(64, dim=1).indices
        want, _ = _sparseloco_values(t.gather(1, index).reshape(-1))
        sent = got[a:b].reshape(-1, 4096).gather(1, index).reshape(-1)
        assert torch.allclose(sent, want, rtol=1e-5, atol=1e-7)
        assert torch.count_nonzero(got[a:b]) <= index.numel()  # nothing but the kept coordinates
    shared = codec.decode(codec.encode(bucket), bucket.numel())  # the whole bucket as one tensor: one table
    assert not torch.allclose(shared[: small.numel()], got[: small.numel()], rtol=1e-3)
    assert pieces.payload_bytes(bucket.numel()) == sum(codec.payload_bytes(b - a) for a, b in pieces.bounds)


def test_pieces_average_each_tensor_over_its_own_selectors():
    """The mean over selectors of a ``Pieces`` bucket is, tensor by tensor, the base codec's mean."""
    from muloco.compress import Pieces

    codec = make_codec("topk", **{**PUBLISHED_VALUES, "chunk_size": 64, "fraction": 0.25, "index_bits": 12})
    bounds = [(0, 192), (192, 320)]
    pieces = Pieces(codec, bounds)
    rows = torch.stack([gaussian(320, seed=s) for s in range(3)])
    payloads = torch.stack([pieces.encode(r) for r in rows])
    decoded = pieces.decode(payloads, 320)
    out = torch.empty(320)
    pieces.mean_into(out, decoded, payloads)
    for a, b in bounds:
        want = torch.empty(b - a)
        part = torch.stack([codec.encode(r[a:b]) for r in rows])
        codec.mean_into(want, codec.decode(part, b - a), part)
        assert torch.equal(out[a:b], want)
    with pytest.raises(ValueError, match="covers 320 elements"):
        pieces.payload_bytes(321)


def test_error_feedback_state_dict_round_trip_and_reset():
    codec = make_codec("topk", fraction=0.05)
    ef = feedback()
    for r in range(2):
        ef.compress("a", gaussian(5000, seed=r), codec)
        ef.compress("b.weight", gaussian(300, seed=r + 10).to(torch.bfloat16), codec)
    buf = io.BytesIO()
    torch.save(ef.state_dict(), buf)
    buf.seek(0)
    restored = feedback()
    restored.load_state_dict(torch.load(buf, weights_only=True))
    assert set(restored.state_dict()) == {"a", "b.weight"}
    for name, t in ef.state_dict().items():
        assert t.dtype == torch.float32 and torch.equal(restored.residual(name), t)
    delta = gaussian(5000, seed=7)
    assert torch.equal(restored.compress("a", delta, codec), ef.compress("a", delta, codec))
    ef.reset()  # zeroed in place: the keys stay for a later checkpoint load
    assert len(ef) == 2 and all(t.abs().sum() == 0 for t in ef.state_dict().values())
    with pytest.raises(ValueError, match="elements"):
        restored.compress("a", gaussian(6000), codec)


def test_error_feedback_piece_by_piece_equals_whole_and_restores_exactly():
    """Compressing a stream in aligned pieces (offsets) gives the whole's payload values
    and residual; ``keep`` receives the replaced residual and ``restore`` puts it back."""
    codec = make_codec("quantize", bits=2, block_size=64)
    whole, pieces = feedback(beta=0.9), feedback(beta=0.9)
    for ef in (whole, pieces):
        ef.allocate("s", 1000, torch.device("cpu"))
    for r in range(3):
        delta = gaussian(1000, seed=r)
        full = codec.decode(whole.compress("s", delta, codec), 1000)
        before = pieces.residual("s").clone()
        kept = delta.clone()
        parts = [
            codec.decode(pieces.compress("s", kept[a:b], codec, offset=a, keep=kept[a:b]), b - a)
            for a, b in ((0, 640), (640, 1000))
        ]
        assert torch.equal(torch.cat(parts), full) and torch.equal(pieces.residual("s"), whole.residual("s"))
        assert torch.equal(kept, before)  # Δ's buffer now holds the replaced residual
    pieces.restore("s", kept[640:], offset=640)
    pieces.restore("s", kept[:640])
    assert torch.equal(pieces.residual("s"), kept)


# ---------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    "make,setting",
    [
        (lambda: Quantizer.Config(bits=3), "bits"),
        (lambda: Quantizer.Config(bits=2, block_size=-1), "block_size"),
        (lambda: Quantizer.Config(bits=2, scheme="lloyd"), "scheme"),
        (lambda: Quantizer.Config(bits=2, range_sigmas=-1.0), "range_sigmas"),
        (lambda: Quantizer.Config(bits=2, range_sigmas=float("nan")), "range_sigmas"),
        (lambda: Quantizer.Config(statistics="double"), "statistics"),
        (lambda: TopK.Config(fraction=0.0), "fraction"),
        (lambda: TopK.Config(fraction=1.5), "fraction"),
        (lambda: TopK.Config(chunk_size=0), "chunk_size"),
        (lambda: TopK.Config(chunk_size=65537), "chunk_size"),
        (lambda: TopK.Config(value_dtype="int8"), "value_dtype"),
        (lambda: TopK.Config(value_bits=1), "value_bits"),
        (lambda: TopK.Config(value_bits=2, value_scheme="minmax"), "value_scheme"),
        (lambda: TopK.Config(value_block_chunks=-1), "value_block_chunks"),
        (lambda: TopK.Config(index_bits=8), "index_bits"),
        (lambda: TopK.Config(chunk_size=8192, index_bits=12), "index_bits"),
        (lambda: Dense.Config(dtype="float64"), "dtype"),
        (lambda: ErrorFeedback.Config(beta=1.5), "beta"),
    ],
)
def test_bad_settings_name_the_setting(make, setting):
    with pytest.raises(ValueError, match=setting):
        make().build()


def test_each_codec_is_built_from_its_own_config():
    assert isinstance(Quantizer.Config(bits=4, scheme="absmax", block_size=256).build(), Quantizer)
    assert isinstance(TopK.Config(fraction=0.1, chunk_size=1024, value_dtype="float16").build(), TopK)
    assert isinstance(Dense.Config(dtype="bfloat16").build(), Dense)
    q = Quantizer.Config(bits=2).build()
    assert q.block_size == 4096 and q.alignment == 4096 and 2.0 <= q.bits_per_element(2**20) <= 2.05
    assert Dense.Config().build().lossless and not Dense.Config(dtype="bfloat16").build().lossless
    with pytest.raises(AttributeError):  # a setting of another codec does not exist on this one
        Quantizer.Config().fraction = 0.1  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- corrupt payloads


@pytest.mark.parametrize("numel", [100, 4096 + 100])  # shorter than a chunk; a last partial chunk
@pytest.mark.parametrize("values", [{"value_dtype": "bfloat16"}, {"value_bits": 4}])
def test_topk_decode_of_a_corrupt_payload_stays_in_bounds(numel, values):
    """Indices past their chunk (what a failed collective can leave) are clamped to the
    chunk's own last element, not to ``chunk_size - 1``, which is out of bounds for a
    tensor shorter than one chunk."""
    codec = make_codec("topk", fraction=0.1, chunk_size=4096, **values)
    payload = codec.encode(gaussian(numel))
    nc, chunk, k = codec.chunks(numel)
    index_bytes = 2 * nc * k
    payload[-index_bytes:] = 0xFF  # every index 65535
    out = codec.decode(payload, numel)
    assert out.shape == (numel,) and torch.isfinite(out).all()
    batch = codec.decode(torch.stack([payload, payload]), numel)
    assert torch.equal(batch[0], out)


# ---------------------------------------------------------------------- pieces and kernels


@pytest.mark.parametrize(
    "kind,settings",
    [
        ("quantize", {"bits": 2, "block_size": 64}),
        ("quantize", {"bits": 4, "scheme": "minmax", "block_size": 100}),
        ("topk", {"fraction": 0.1, "chunk_size": 64}),
    ],
    ids=["2bit", "minmax", "topk"],
)
def test_pieces_cut_at_the_alignment_encode_like_the_whole(kind, settings):
    """What lets the exchange work in buckets and owner ranges: pieces cut at multiples of
    the codec's alignment (a short tail joins the piece before it) decode to the whole's values."""
    from muloco.outer.exchange.layout import cut, ranges

    codec = make_codec(kind, **settings)
    for n in (1000, 64 * 7 + 5, 37):
        x = gaussian(n, seed=n)
        whole = codec.decode(codec.encode(x), n)
        for bounds in (cut(n, 130, codec.alignment), ranges(n, 3, codec.alignment), ranges(n, 5, codec.alignment)):
            got = torch.cat([codec.decode(codec.encode(x[a:b]), b - a) for a, b in bounds])
            assert torch.equal(got, whole), (n, bounds)


def test_exact_statistics_keep_the_error_bounds(samples):
    for bits in (1, 2, 4, 8):
        q = make_codec("quantize", bits=bits, statistics="exact")
        bounds = ERROR_BOUNDS["statistical", bits]
        assert all(rel_error(q, x) <= b for x, b in zip(samples, bounds)), bits


def test_kernel_choice_follows_the_setting():
    """Eager kernels unless compiled ones are asked for (auto is eager: faster on an H200 too);
    exact statistics wherever the kernels are compiled or the device is not a CPU (CUDA's eager
    path is then the fused one's reference)."""
    from muloco.compress.kernels import use_compiled
    from muloco.outer.exchange import Exchange

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not use_compiled("auto", cuda) and not use_compiled("auto", cpu)
    assert use_compiled("compiled", cpu) and not use_compiled("eager", cuda)
    on_gpu = Exchange.Config(codec=Quantizer.Config(bits=2)).build(device=cuda)
    assert not on_gpu.compiled and not on_gpu.codec.compiled and on_gpu.codec.exact_statistics(cuda)
    asked = Exchange.Config(codec=Quantizer.Config(bits=2), kernels="compiled").build(device=cuda)
    assert asked.compiled and asked.codec.compiled and asked.codec.exact_statistics(cuda)
    on_cpu = Exchange.Config(codec=Quantizer.Config(bits=2)).build(device=cpu)
    assert not on_cpu.codec.compiled and not on_cpu.codec.exact_statistics(cpu)
    assert make_codec("quantize", bits=2).exact_statistics(cuda)  # eager on a GPU: the reference
    with pytest.raises(ValueError, match="statistics 'float' runs only in eager kernels"):
        Quantizer.Config(statistics="float").build(compiled=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "kind,settings",
    [
        ("quantize", {"bits": 2, "statistics": "exact"}),
        ("quantize", {"bits": 4, "scheme": "minmax"}),
        ("topk", {"fraction": 0.1, "value_bits": 4}),  # its values go through the absmax quantizer
    ],
    ids=["2bit-statistical", "4bit-minmax", "topk-4bit-values"],
)
def test_compiled_kernels_give_the_eager_payloads_byte_for_byte(kind, settings):
    """The same entry points with ``compiled=True``: torch.compile of the codec's own
    functions (C++ here, Triton on a GPU). Bytes equal, and so are the decoded values,
    for a bucket, a partial last block and a tensor smaller than one block."""
    cls = KINDS[kind]
    eager, compiled = cls.Config(**settings).build(), cls.Config(**settings).build(compiled=True)
    for n in (3 * 4096 + 123, 1000):
        x = gaussian(n, seed=n) * 0.01
        p_eager, p_compiled = eager.encode(x), compiled.encode(x)
        assert torch.equal(p_eager, p_compiled), (n, int((p_eager != p_compiled).sum()))
        assert torch.equal(eager.decode(p_eager, n), compiled.decode(p_compiled, n))


def test_a_kernel_that_fails_to_compile_falls_back_to_eager_once():
    """A compiler failure costs one warning, not the run: the eager kernel (same payloads) takes over."""
    from muloco.compress import kernels

    calls = []

    def kernel(x):
        calls.append(x)
        return x + 1

    real = kernels.torch.compile
    try:
        kernels.torch.compile = lambda fn, **kwargs: lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no compiler"))
        run = kernels.compiled_kernel.__wrapped__(kernel)
        assert run(1) == 2 and run(2) == 3 and calls == [1, 2]
    finally:
        kernels.torch.compile = real
