"""muloco.models: the flavor table, parameter counts, attention direction, sandwich block.

Counts are checked against models built on the meta device, so even the 15B
flavors cost no memory. Numerical tests use the tiny flavor on CPU in float32,
initialised the way torchtitan's trainer does (meta -> to_empty -> init_weights).
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

import pytest
import torch

import muloco.compat as compat

compat.apply()  # before torchtitan is imported (muloco.models imports it)

import torch.nn.functional as F  # noqa: E402

from muloco.models import ModelConfig, build_model_config, build_model_spec  # noqa: E402
from muloco.models import flavors as model_map  # noqa: E402
from muloco.models.attention import SwitchableSDPA  # noqa: E402
from muloco.models.block import SandwichBlock  # noqa: E402
from muloco.models.flavors import (  # noqa: E402
    LLAMA3_VOCAB,
    TOKENS_PER_PARAM,
    UnknownFlavorError,
    count_parameters,
    known_flavors,
    padded_vocab,
    parse_flavor,
    steps_for_batch,
)

TINY = "llama3-w64-d2-h2"
QK = "_qk_torch-rmsnorm"


def _meta_model(flavor: str, vocab_size: int = 2048, causal: bool = True):
    cfg = build_model_config(ModelConfig(flavor=flavor), vocab_size=vocab_size, causal=causal)
    with torch.device("meta"):
        return cfg.build()


def _n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _cpu_model(flavor: str, causal: bool = True, seed: int = 0, vocab_size: int = 256):
    """Initialised like torchtitan's trainer: build on meta, to_empty, init_weights."""
    torch.manual_seed(seed)
    model = _meta_model(flavor, vocab_size, causal)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.eval()


# ------------------------------------------------------------ parameter counts


def test_every_flavor_matches_closed_form_count():
    vocab = padded_vocab(2048, 64)
    slow = []
    for flavor in known_flavors():
        start = time.perf_counter()
        model = _meta_model(flavor, 2048)
        assert model.tok_embeddings.weight.is_meta
        assert _n_params(model) == count_parameters(flavor, vocab), flavor
        elapsed = time.perf_counter() - start
        if elapsed > 10.0:
            slow.append(f"{flavor}: {elapsed:.1f}s")
    assert not slow, f"building on meta should be fast: {slow}"


def test_known_flavors_cover_the_table():
    flavors = known_flavors()
    assert len(flavors) == 2 * len(model_map.SHAPES)
    for base in model_map.SHAPES:
        assert base in flavors and f"{base}{QK}_pa_pf" in flavors


@pytest.mark.parametrize(
    "flavor, documented",
    [
        ("llama3-w512-d6-h4", 150.6e6),
        (f"llama3-w512-d6-h4{QK}_pa_pf", 150.6e6),
        ("llama3-w1024-d12-h8", 416.9e6),
        (f"llama3-w1024-d12-h8{QK}_pa_pf", 416.9e6),
    ],
)
def test_llama3_vocab_counts_match_muloco_table(flavor, documented):
    assert padded_vocab(LLAMA3_VOCAB, 64) == LLAMA3_VOCAB
    built = _n_params(_meta_model(flavor, LLAMA3_VOCAB))
    assert built == count_parameters(flavor, LLAMA3_VOCAB)
    assert abs(built - documented) / documented < 1e-3, f"{flavor}: {built:,}"


def test_vocab_is_padded_to_multiple():
    assert padded_vocab(2048, 64) == 2048
    assert padded_vocab(2049, 64) == 2112
    assert padded_vocab(1, 64) == 64
    model = _meta_model(TINY, vocab_size=300)
    assert model.tok_embeddings.weight.shape == (320, 64)
    assert model.lm_head.weight.shape == (320, 64)
    # Embeddings are untied.
    assert model.tok_embeddings.weight is not model.lm_head.weight


def test_model_spec_carries_the_config():
    spec = build_model_spec(ModelConfig(flavor=TINY), vocab_size=256)
    assert spec.flavor == TINY
    assert spec.model.dim == 64 and len(spec.model.layers) == 2
    assert spec.model.vocab_size == 256


# ------------------------------------------------------------------- flavors


def test_unknown_flavor_names_close_matches():
    with pytest.raises(UnknownFlavorError, match="llama3-w512-d6-h4") as info:
        parse_flavor("llama3-w512-d6-h5")
    assert "Did you mean" in str(info.value)
    assert isinstance(info.value, ValueError)
    # Through the model builder too.
    with pytest.raises(UnknownFlavorError, match="Did you mean: .*llama3-w1024-d12-h8"):
        build_model_config(ModelConfig(flavor="llama3-w1024-d12-h9"), vocab_size=256)


def test_unknown_flavor_without_close_match_lists_shapes():
    with pytest.raises(UnknownFlavorError) as info:
        parse_flavor("gpt2")
    msg = str(info.value)
    assert "Did you mean" not in msg
    assert "llama3-w64-d2-h2" in msg and "_qk_torch-rmsnorm" in msg


@pytest.mark.parametrize(
    "bad", [f"{TINY}_pf_pa", f"{TINY}_pa{QK}", f"{TINY}_qk", f"{TINY}_pa_pa", f"{TINY} ", "llama3-w64-d2"]
)
def test_malformed_suffixes_are_rejected(bad):
    with pytest.raises(UnknownFlavorError):
        parse_flavor(bad)


@pytest.mark.parametrize(
    "suffix, qk, pa, pf",
    [
        ("", False, False, False),
        (QK, True, False, False),
        ("_pa", False, True, False),
        ("_pf", False, False, True),
        ("_pa_pf", False, True, True),
        (f"{QK}_pa", True, True, False),
        (f"{QK}_pf", True, False, True),
        (f"{QK}_pa_pf", True, True, True),
    ],
)
def test_suffixes_create_the_norms(suffix, qk, pa, pf):
    flavor = TINY + suffix
    parsed = parse_flavor(flavor)
    assert (parsed.qk_norm, parsed.post_attention_norm, parsed.post_ffn_norm) == (qk, pa, pf)

    model = _meta_model(flavor)
    names = {n for n, _ in model.named_parameters()}
    for i, block in model.layers.items():
        assert isinstance(block, SandwichBlock)
        assert (block.attention.q_norm is not None) is qk
        assert (block.attention.k_norm is not None) is qk
        assert (block.post_attention_norm is not None) is pa
        assert (block.post_ffn_norm is not None) is pf
        assert (f"layers.{i}.attention.q_norm.weight" in names) is qk
        assert (f"layers.{i}.attention.k_norm.weight" in names) is qk
        assert (f"layers.{i}.post_attention_norm.weight" in names) is pa
        assert (f"layers.{i}.post_ffn_norm.weight" in names) is pf
        if qk:
            # Per-head norm: its width is head_dim, not dim.
            assert block.attention.q_norm.weight.shape == (parsed.shape.head_dim,)
    # The closed form holds for every suffix combination, not only the listed ones.
    assert _n_params(model) == count_parameters(flavor, padded_vocab(2048, 64))


def test_shapes_follow_muloco():
    model = _meta_model("llama3-w1024-d12-h8")
    block = model.layers["0"]
    assert block.attention.n_heads == 8
    assert block.attention.qkv_linear.wk.weight.shape == (1024, 1024)  # no GQA
    assert block.feed_forward.w1.weight.shape == (int(2.75 * 1024), 1024)
    assert block.feed_forward.w1.bias is None  # no biases
    assert isinstance(block.attention.inner_attention, SwitchableSDPA)


# ------------------------------------------------------------ causal switch


def _pair(vocab: int = 256, seq: int = 12, batch: int = 2):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % vocab
    return x, y


def test_causal_and_bidirectional_attention():
    causal = _cpu_model(TINY, causal=True)
    bidir = _cpu_model(TINY, causal=False, seed=123)
    bidir.load_state_dict(causal.state_dict())
    assert causal.layers["0"].attention.inner_attention.is_causal is True
    assert bidir.layers["0"].attention.inner_attention.is_causal is False
    assert causal.tok_embeddings.weight.dtype == torch.float32

    x, y = _pair()
    with torch.no_grad():
        cx, cy = causal(x), causal(y)
        bx, by = bidir(x), bidir(y)

    # Causal: changing the last token cannot change any earlier position.
    assert torch.allclose(cx[:, :-1], cy[:, :-1], atol=1e-6, rtol=0)
    assert not torch.allclose(cx[:, -1], cy[:, -1], atol=1e-3)
    # Bidirectional: every position sees the last token.
    for pos in range(x.shape[1] - 1):
        assert not torch.allclose(bx[:, pos], by[:, pos], atol=1e-5), pos
    # Same weights: the last position sees the whole sequence either way (the
    # causal and full SDPA kernels round differently, hence the tolerance).
    assert torch.allclose(cx[:, -1], bx[:, -1], atol=1e-3, rtol=1e-3)
    assert not torch.allclose(cx[:, 0], bx[:, 0], atol=1e-5)


def test_init_is_deterministic_and_finite():
    a, b = _cpu_model(TINY, seed=7), _cpu_model(TINY, seed=7)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all(), name
    x, _ = _pair()
    with torch.no_grad():
        out = a(x)
    assert out.shape == (2, 12, 256) and torch.isfinite(out).all()


# ------------------------------------------------------------ sandwich block


def _rmsnorm(v: torch.Tensor, norm) -> torch.Tensor:
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def _swiglu(v: torch.Tensor, ffn) -> torch.Tensor:
    return ffn.w2(F.silu(ffn.w1(v)) * ffn.w3(v))


def _randomise_norms(model: torch.nn.Module) -> None:
    # Fresh RMSNorm weights are all ones, which would hide a swapped norm.
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))


def test_sandwich_block_matches_formula():
    model = _cpu_model(f"{TINY}_pa_pf")
    _randomise_norms(model)
    block = model.layers["1"]
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        attn_in = _rmsnorm(x, block.attention_norm)
        h = x + _rmsnorm(block.attention(attn_in, None, None), block.post_attention_norm)
        f = _swiglu(_rmsnorm(h, block.ffn_norm), block.feed_forward)
        expected = h + _rmsnorm(f, block.post_ffn_norm)
        got = block(x, None)
        # The pre-norm block (no post norms) gives something else.
        h_plain = x + block.attention(attn_in, None, None)
        plain = h_plain + _swiglu(_rmsnorm(h_plain, block.ffn_norm), block.feed_forward)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)


def test_block_without_post_norms_is_llama3_prenorm():
    model = _cpu_model(TINY)
    _randomise_norms(model)
    block = model.layers["0"]
    assert block.post_attention_norm is None and block.post_ffn_norm is None
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        h = x + block.attention(_rmsnorm(x, block.attention_norm), None, None)
        expected = h + _swiglu(_rmsnorm(h, block.ffn_norm), block.feed_forward)
        got = block(x, None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------- budgets


@pytest.mark.parametrize("flavor", ["llama3-w512-d6-h4", "llama3-w1024-d12-h8", TINY])
@pytest.mark.parametrize("global_batch, seq_len", [(512, 2048), (256, 2048), (7, 100), (1, 1)])
def test_steps_for_batch_spends_20_tokens_per_param(flavor, global_batch, seq_len):
    assert TOKENS_PER_PARAM == 20
    budget = 20 * count_parameters(flavor, LLAMA3_VOCAB)
    steps = steps_for_batch(flavor, global_batch, seq_len)
    tokens = global_batch * seq_len
    assert steps == math.ceil(Fraction(budget, tokens))
    assert steps * tokens >= budget > (steps - 1) * tokens


def test_steps_for_batch_uses_the_given_vocab():
    small = steps_for_batch(TINY, 4, 64, vocab_size=256)
    assert small == -(-20 * count_parameters(TINY, 256) // (4 * 64))
    assert small < steps_for_batch(TINY, 4, 64)


def test_steps_for_batch_known_value():
    # 150,608,384 params * 20 tokens / (512 * 2048 tokens per step) = 2872.6 -> 2873
    assert count_parameters("llama3-w512-d6-h4", LLAMA3_VOCAB) == 150_608_384
    assert steps_for_batch("llama3-w512-d6-h4", 512) == 2873


@pytest.mark.parametrize("global_batch, seq_len", [(0, 2048), (-1, 2048), (8, 0), (8, -5)])
def test_steps_for_batch_rejects_non_positive(global_batch, seq_len):
    with pytest.raises(ValueError, match="positive"):
        steps_for_batch(TINY, global_batch, seq_len)
