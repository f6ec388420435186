"""The CUDA paths of masked diffusion, checked where they run on CPU: document masks through
FlexAttention against SDPA's dense mask, and the fixed-capacity gather of masked positions
against the exact one (loss, gradients, capacity never short)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from muloco import compat

compat.apply()

from torch.nn.attention.flex_attention import BlockMask, create_mask  # noqa: E402

from muloco.config.checks import check_config  # noqa: E402
from muloco.config.cli import parse_args  # noqa: E402
from muloco.config.loader import ConfigError  # noqa: E402
from muloco.objectives import Autoregressive, MaskedDiffusion, NoiseKey, SpecialTokens  # noqa: E402
from muloco.objectives.documents import document_block_mask, document_ids, document_mask  # noqa: E402
from muloco.objectives.gather import MaskedPositions, mask_capacity  # noqa: E402

V, BOS, EOS, MASK = 32, 29, 30, 31
TOKENS = SpecialTokens(bos=BOS, eos=EOS, mask=MASK)


def _rows(b=3, n=160, seed=0):
    """Packed rows of several documents, longer than one 128-token tile of a block mask."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 29, (b, n), generator=g)
    starts = torch.rand(b, n, generator=g) < 0.04
    x[starts] = BOS
    x[:, 0] = BOS
    return x


def _key(step=1, rank=0, world=1):
    return NoiseKey(replica=0, step=step, micro=0, rank=rank, world=world)


@pytest.mark.parametrize("causal", [False, True])
def test_the_block_mask_is_the_dense_document_mask(causal):
    doc = document_ids(_rows(), BOS)
    block = document_block_mask(doc, causal)
    assert isinstance(block, BlockMask)
    dense = create_mask(block.mask_mod, doc.shape[0], 1, doc.shape[1], doc.shape[1], device="cpu")
    assert torch.equal(dense, document_mask(doc, causal))


@pytest.mark.parametrize("causal", [False, True])
def test_flex_attention_gives_what_sdpa_gives_with_the_dense_mask(causal):
    model = tiny_model(causal, V, 0)
    make = Autoregressive.Config if causal else MaskedDiffusion.Config
    sdpa = make(document_mask=True, mask_kernel="sdpa").build(tokens=TOKENS)
    flex = make(document_mask=True, mask_kernel="flex").build(tokens=TOKENS)
    x = _rows()
    x[0, 40:60] = MASK  # a noised row: masked tokens, a masked BOS among them
    with torch.no_grad():
        kwargs = flex.attention_kwargs(x)
        assert isinstance(kwargs["attention_masks"], BlockMask)
        a = model(x, **sdpa.attention_kwargs(x))
        b = model(x, **kwargs)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_sdpa_is_the_default_auto_is_sdpa_off_cuda_and_flex_training_off_cuda_is_a_clear_error():
    x = _rows()
    assert MaskedDiffusion.Config().mask_kernel == "sdpa"  # faster than flex in a compiled model (docs/gpu.md)
    auto = MaskedDiffusion.Config(mask_kernel="auto").build(tokens=TOKENS)
    assert auto.attention_kwargs(x)["attention_masks"].dtype == torch.bool
    flex = MaskedDiffusion.Config(mask_kernel="flex").build(tokens=TOKENS)
    with pytest.raises(ValueError, match="objective.mask_kernel flex trains only on CUDA"):
        flex.attention_kwargs(x)


def test_a_bad_mask_kernel_is_one_clear_error():
    _, config = parse_args(["--config", "ddp/adamw", "--objective", "mdlm", "--objective.mask_kernel", "dense"])
    with pytest.raises(ConfigError, match="objective.mask_kernel must be one of auto, flex, sdpa; got 'dense'"):
        check_config(config)


def _padded(obj, batch, key, rows, length):
    """The batch as CUDA would prepare it: positions padded to the objective's capacity."""
    capacity = obj._capacity(key, rows, length, 0.0)
    batch.extra["positions"] = MaskedPositions.padded(batch.extra["masked"], capacity)
    return capacity


@pytest.mark.parametrize("masked_only_head", [True, False])
def test_the_fixed_capacity_gather_gives_the_exact_loss_and_gradients(masked_only_head):
    model = tiny_model(False, V, 0).double()
    obj = MaskedDiffusion.Config(masked_only_head=masked_only_head, truncate_probability=0.0).build(
        tokens=TOKENS, rows_per_step=3
    )
    if masked_only_head:
        model._skip_lm_head = True
        obj.lm_head = model.lm_head
    x = _rows()
    results = []
    for padded in (False, True):
        batch = obj.prepare(x, x.clone(), _key())
        if padded:
            capacity = _padded(obj, batch, _key(), *x.shape)
            assert int(batch.extra["masked"].sum()) < capacity <= x.numel()
            assert not batch.extra["positions"].valid.all()
        model.zero_grad()
        loss = obj.loss(model(batch.inputs, **batch.model_kwargs), batch, torch.tensor(x.numel()))
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (exact, g_exact), (padded, g_padded) = results
    torch.testing.assert_close(padded, exact, rtol=1e-12, atol=0)
    for a, b in zip(g_exact, g_padded):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("settings", [{}, {"schedule": "cosine"}, {"complementary_masks": True}, {"stratified": False}])
def test_the_capacity_holds_every_masked_token_of_every_rank(settings):
    obj = MaskedDiffusion.Config(truncate_probability=0.0, **settings).build(tokens=TOKENS, rows_per_step=8)
    x = _rows(b=2, n=64)
    for step in range(40):
        for rank in range(4):
            key = _key(step=step, rank=rank, world=4)
            batch = obj.prepare(x, x.clone(), key)
            capacity = obj._capacity(key, *x.shape, 0.0)
            masked = batch.extra["masked"]
            assert int(masked.sum()) <= capacity <= masked.numel()
            positions = MaskedPositions.padded(masked, capacity)
            assert torch.equal(positions.index[positions.valid], MaskedPositions.exact(masked).index)


def test_the_capacity_is_mean_plus_eight_sigma_rounded_up():
    p = torch.full((8,), 0.5)
    # mean 8·256·0.5 = 1024, σ = sqrt(8·256·0.25) = 22.6: 1024 + 181 + 48 = 1253 -> 1280
    assert mask_capacity(p, 256) == 1280
    assert mask_capacity(torch.ones(2), 100) == 200  # never more than every token
    assert mask_capacity(torch.zeros(4), 1000) == 64


def test_a_capacity_too_small_stops_instead_of_dropping_tokens():
    masked = torch.ones(2, 8, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="capacity"):
        MaskedPositions.padded(masked, 10)
