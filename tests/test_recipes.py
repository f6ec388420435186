"""AR-to-diffusion recipes (``--objective.recipe full|dream|block``): each loss against the paper's
public code written out by hand (dllm's MDLM trainer with ``right_shift_logits`` for Dream's
shift; BD3-LM's three-part mask over ``[x_t ‖ x_0]`` for block-wise), DiffuLLaMA's annealing,
Efficient-DLM's position-dependent masking, the block sampler's exact cache against the whole
canvas, and runs of each recipe from the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, run_train

from muloco import compat

compat.apply()

from muloco.models import ModelConfig, init_model  # noqa: E402
from muloco.objectives.diffusion import MaskedDiffusion  # noqa: E402
from muloco.objectives.documents import evaluate_mask  # noqa: E402
from muloco.objectives.objective import NoiseKey, SpecialTokens  # noqa: E402
from muloco.objectives.recipes import BlockWise, Dream, Recipe, block_diffusion_mask  # noqa: E402
from muloco.objectives.sampling import DiffusionSampling, sample_block_diffusion, sample_diffusion_batch  # noqa: E402

TOKENS = SpecialTokens(bos=2045, eos=2046, mask=2047)
KEY = NoiseKey(replica=0, step=3, micro=0, rank=0, world=1)


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return init_model(ModelConfig(flavor="llama3-w64-d2-h2"), 2048, causal=False).eval()


def _rows(rows: int = 3, length: int = 32, seed: int = 1) -> torch.Tensor:
    x = torch.randint(0, 2000, (rows, length), generator=torch.Generator().manual_seed(seed))
    x[:, 0] = TOKENS.bos
    return x


def _objective(recipe, **kwargs) -> MaskedDiffusion:
    return MaskedDiffusion.Config(recipe=recipe, document_mask=False, truncate_probability=0.0, **kwargs).build(
        tokens=TOKENS
    )


@pytest.mark.parametrize("masked_only_head", [False, True])
def test_dream_loss_is_dllm_mdlm_with_right_shifted_logits(masked_only_head):
    """dllm's MDLMTrainer(right_shift_logits=True): logits ← [logits[:, :1], logits[:, :-1]],
    Σ CE(logits, x0)·(1/t)·masked over the maskable tokens; by hand, token i scored by the output
    at i − 1. The first token (no output before it) is never masked. As everywhere in muloco the
    mask token's logit is −∞ (dllm leaves it in the softmax: 3e-5 apart here)."""
    model, x = _model(), _rows()
    objective = _objective(Dream.Config(), masked_only_head=masked_only_head)
    if masked_only_head:
        objective.lm_head = model.lm_head
    batch = objective.prepare(x, x.clone(), KEY)
    masked, t = batch.extra["masked"], batch.extra["t"]
    assert not masked[:, 0].any() and masked.any()
    normaliser = torch.tensor(float(x[:, 1:].numel()))
    model._skip_lm_head = masked_only_head
    with torch.no_grad():
        ours = objective.loss(model(batch.inputs, **batch.model_kwargs), batch, normaliser)
        model._skip_lm_head = False
        logits = model(batch.inputs).float()
    logits[..., TOKENS.mask] = -math.inf  # muloco never predicts the mask token (its documented difference)
    shifted = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    nll = F.cross_entropy(shifted.transpose(1, 2), x, reduction="none") * (1 / t)[:, None] * masked
    dllm = nll.sum() / normaliser
    by_hand = sum(F.cross_entropy(logits[b, i - 1], x[b, i]) / t[b] for b, i in masked.nonzero().tolist()) / normaliser
    assert torch.allclose(ours, dllm, rtol=1e-5) and torch.allclose(ours, by_hand, rtol=1e-5)


def _bd3lm_mask(length: int, block: int) -> torch.Tensor:
    """BD3-LM's training mask, written from the paper: block-diagonal within each copy, x_t's
    blocks reading x_0's strictly earlier blocks, x_0 block-causal."""
    idx = torch.arange(2 * length)
    clean = idx >= length
    blk = (idx % length) // block
    q_clean, kv_clean, q_blk, kv_blk = clean[:, None], clean[None, :], blk[:, None], blk[None, :]
    diagonal = (q_blk == kv_blk) & (q_clean == kv_clean)
    offset_causal = (q_blk > kv_blk) & kv_clean & ~q_clean
    block_causal = (q_blk >= kv_blk) & kv_clean & q_clean
    return diagonal | offset_causal | block_causal


def test_the_block_mask_is_bd3lm_and_reads_as_drawn_for_two_blocks_of_two():
    ours = evaluate_mask(block_diffusion_mask(4, 2, None, None), 1, 8, 8, torch.device("cpu"), flex=False)[0, 0]
    # rows: queries x_t[0..3] then x_0[0..3]; columns: keys in the same order
    drawn = torch.tensor(
        [
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [0, 0, 1, 1, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 1, 1, 1, 1],
            [0, 0, 0, 0, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ours, drawn)
    assert torch.equal(
        evaluate_mask(block_diffusion_mask(32, 8, None, None), 1, 64, 64, torch.device("cpu"), flex=False)[0, 0],
        _bd3lm_mask(32, 8),
    )


@pytest.mark.parametrize("shift", [False, True])
def test_block_loss_is_bd3lm_on_the_noised_half_of_x_t_and_x_0(shift):
    """dllm's BD3LMTrainer: the model reads cat(x_t, x_0) at positions (0..L−1, 0..L−1) under
    BD3-LM's mask; CE of the first L outputs at the masked positions, weighted 1/t (and with
    ``shift``, Fast-dLLM v2's: the output at i − 1 scores token i, except that a block's first
    token is scored by the clean copy's output before it, as the sampler reads it)."""
    model, x = _model(), _rows(length=32)
    objective = _objective(BlockWise.Config(block_size=8, shift=shift), masked_only_head=False)
    batch = objective.prepare(x, x.clone(), KEY)
    masked, t = batch.extra["masked"], batch.extra["t"]
    normaliser = torch.tensor(float(masked.shape[1] * masked.shape[0]))
    with torch.no_grad():
        ours = objective.loss(model(batch.inputs, **batch.model_kwargs), batch, normaliser)
        xt = x.masked_fill(masked, TOKENS.mask)
        positions = torch.arange(32).repeat(2)[None]
        both = model(torch.cat([xt, x], 1), positions=positions, attention_masks=_bd3lm_mask(32, 8)[None, None]).float()
    both[..., TOKENS.mask] = -math.inf
    logits = both[:, :32]
    if shift:  # token i from the noised output at i − 1; a block's first from the clean block before it
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        for start in (8, 16, 24):
            logits[:, start] = both[:, 32 + start - 1]
    reference = (
        F.cross_entropy(logits[masked], x[masked], reduction="none") * (1 / t)[:, None].expand(masked.shape)[masked]
    ).sum() / normaliser
    assert torch.allclose(ours, reference, rtol=1e-5)
    assert not shift or not masked[:, 0].any()


def test_a_shifted_block_models_training_logits_at_a_block_start_are_the_samplers():
    """The first token of a block is predicted from the finished (clean) block before it: training
    reads the same logits there as the block sampler's exact cache does."""
    from muloco.models.attention import BlockKV, kv_cache

    model, x = _model(), _rows(rows=1, length=32)
    objective = _objective(BlockWise.Config(block_size=8, shift=True), masked_only_head=False)
    xt = x.masked_fill(torch.arange(32) >= 8, TOKENS.mask)  # block 0 finished, the rest masked
    with torch.no_grad():
        reading = objective._reading(xt, x, None)
        trained = objective.recipe.outputs(model(reading.inputs, **reading.kwargs), 32)[:, 8]
        with kv_cache(model, BlockKV(append=True)):
            sampled = model(x[:, :8], positions=torch.arange(8)[None])[:, -1]
    assert torch.allclose(trained, sampled, atol=1e-5)


def test_a_noised_block_reads_the_same_clean_context_whether_or_not_a_boundary_in_it_is_masked():
    """With documents, a noised block reads the clean context of the document open at its start,
    so masking the BOS inside it changes nothing its tokens can see outside the block."""
    length, block = 8, 4
    x0 = torch.tensor([[TOKENS.bos, 5, 6, 7, 8, TOKENS.bos, 9, 10]])
    from muloco.objectives.documents import document_ids

    views = []
    for masked_bos in (False, True):
        xt = x0.clone()
        xt[0, 6] = TOKENS.mask
        if masked_bos:
            xt[0, 5] = TOKENS.mask
        mask = evaluate_mask(
            block_diffusion_mask(length, block, document_ids(xt, TOKENS.bos), document_ids(x0, TOKENS.bos)),
            1,
            16,
            16,
            torch.device("cpu"),
            False,
        )
        views.append(mask[0, 0, 4:8, 8:16])  # the second noised block's view of the clean copy
    assert torch.equal(views[0], views[1])
    assert views[0][:, :4].all() and not views[0][:, 4:].any()  # the first clean block (document 1), no later one


def test_annealing_opens_the_causal_mask_linearly_and_evaluation_reads_full_attention():
    """DiffuLLaMA: the causal triangle OR a Bernoulli(step / anneal_steps) draw over the L×L mask,
    one draw per step shared by the rows; full attention once annealed and in evaluation."""
    objective = _objective(Recipe.Config(anneal_steps=100))
    x = _rows(length=64)

    def mask_at(step):
        return objective.prepare(x, x.clone(), NoiseKey(0, step, 0, 0, 1)).model_kwargs.get("attention_masks")

    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    assert torch.equal(mask_at(0)[0, 0], causal)
    half = mask_at(50)
    assert half.shape[0] == 1 and half[0, 0][causal].all()  # one draw for the rows; the triangle stays open
    opened = half[0, 0][~causal].float().mean().item()
    assert 0.4 < opened < 0.6, opened
    assert mask_at(100) is None and objective._reading(x, x, None).kwargs == {}


def test_position_dependent_masking_masks_later_tokens_of_a_block_more_and_keeps_the_share():
    recipe = BlockWise.Config(block_size=16, position_masking=0.1).build()
    t = torch.tensor([0.05, 0.3, 1.0 - 1e-6])
    p = recipe.token_probability(t, t, 32)
    assert p.shape == (3, 32) and torch.equal(p[:, :16], p[:, 16:])  # the same in every block
    assert (p[:2, 1:16] > p[:2, :15]).all()  # later tokens more, the more so the cleaner the row
    assert (p[0, 15] / p[0, 0]) > (p[1, 15] / p[1, 0]) > 1.0
    assert torch.allclose(p[2], torch.full((32,), t[2].item()), rtol=1e-4)  # t = 1: uniform
    assert torch.allclose(p[:2].mean(dim=1), t[:2], rtol=1e-5)  # no clipping here: the share is p
    ratio = math.exp(-math.log(0.1) / 16 * 15 * (1 - 0.05))
    assert math.isclose((p[0, 15] / p[0, 0]).item(), ratio, rel_tol=1e-5)


def test_the_block_bound_draws_each_blocks_mask_count_within_the_block():
    objective = _objective(BlockWise.Config(block_size=8), masked_only_head=False)
    model, x = _model(), _rows(rows=2, length=32)
    seen = []
    original = objective._rows

    def spy(units, rows, length):
        out = original(units, rows, length)
        if out.dtype == torch.bool:
            seen.append(out.reshape(rows, -1, 8).sum(dim=2))
        return out

    objective._rows = spy
    terms = objective.elbo_terms(model, x, x.clone(), 0)
    assert terms[1] == 64 and all(((c >= 1) & (c <= 8)).all() for c in seen)


class _OneAhead(torch.nn.Module):
    """A model whose output at i is ``inner``'s at i + 1: read with the shift, it is ``inner`` read without."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, **kwargs):
        out = self.inner(x, **kwargs)
        return torch.cat([out[:, 1:], out[:, -1:]], dim=1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_shifted_sampler_reads_the_output_one_position_before(temperature):
    model = _model()
    how = DiffusionSampling(length=16, steps=16, block_length=8, temperature=temperature)
    prompt = [[TOKENS.bos, 5, 6, 7]]
    plain = sample_diffusion_batch(
        model, prompt, TOKENS.mask, how, torch.Generator().manual_seed(3), torch.device("cpu")
    )
    shifted = sample_diffusion_batch(
        _OneAhead(model), prompt, TOKENS.mask, how, torch.Generator().manual_seed(3), torch.device("cpu"), shift=True
    )
    assert plain == shifted


@pytest.mark.parametrize(
    "shift, prompt_length, threshold", [(False, 5, None), (True, 5, None), (True, 8, None), (False, 11, 0.3)]
)
def test_the_block_samplers_exact_cache_gives_the_whole_canvas_text(shift, prompt_length, threshold):
    """The cache keeps the finished blocks' keys and values; the whole canvas under the
    block-causal mask computes the same function, so the text is the same."""
    model = _model()
    prompt = [TOKENS.bos, *range(10, 10 + prompt_length - 1)]
    texts = []
    for cache in ("block", "none"):
        how = DiffusionSampling(length=24, steps=12, block_length=8, cache=cache, threshold=threshold)
        texts.append(
            sample_block_diffusion(
                model,
                [prompt],
                TOKENS.mask,
                how,
                torch.Generator().manual_seed(0),
                torch.device("cpu"),
                block_size=8,
                shift=shift,
            )[0]
        )
    assert texts[0] == texts[1] and TOKENS.mask not in texts[0] and len(texts[0]) == 24


def test_a_block_model_samples_only_with_its_own_blocks_and_cache():
    how = DiffusionSampling(length=16, steps=16, block_length=4, cache="block")
    with pytest.raises(ValueError, match="trained with blocks of 8"):
        how.check_block_model(8)
    with pytest.raises(ValueError, match="--cache prefix: a block-wise model"):
        DiffusionSampling(length=16, steps=16, block_length=8, cache="prefix").check_block_model(8)
    with pytest.raises(ValueError, match="--cache block keeps the finished blocks"):
        DiffusionSampling(length=16, steps=16, block_length=8, cache="block").check()


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            ["--objective.recipe", "block", "--objective.recipe.block_size", "24"],
            "objective.recipe.block_size 24 does not divide training.seq_len 64",
        ),
        (
            ["--objective.recipe", "block", "--objective.recipe.anneal_steps", "10"],
            "block recipe's attention is block-causal",
        ),
        (["--objective.recipe", "block", "--objective.recipe.position_masking", "1.5"], "position_masking is 1.5"),
        (
            [
                "--objective.recipe",
                "block",
                "--objective.recipe.position_masking",
                "0.1",
                "--objective.complementary-masks",
            ],
            "complementary-masks pairs rows",
        ),
        (
            ["--objective.recipe", "full", "--objective.recipe.block_size", "8"],
            "objective.recipe is full, which has no",
        ),
        (["--objective.recipe", "dreamy"], "--objective.recipe must be one of full, dream, block"),
    ],
)
def test_a_bad_recipe_setting_is_one_error_before_anything_runs(tmp_path, flags, expected):
    proc = run_train(
        ["--config", "ddp/adamw", *TINY, "--objective", "mdlm", *flags, "--dump_folder", str(tmp_path / "r")]
    )
    assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "r").exists()


def test_dream_from_a_diffusion_models_folder_is_refused(tmp_path):
    """Its outputs predict their own position's token: shifting them would train another function."""
    from safetensors.torch import load_file, save_file
    from test_hf_families import save_family

    from muloco.data.tokenizer import MulocoTokenizer
    from muloco.hf.llada import to_llada_names

    llama, folder = tmp_path / "llama", tmp_path / "llada"
    save_family("llama", llama)
    folder.mkdir()
    config = json.loads((llama / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llada",
                "d_model": 64,
                "n_layers": 2,
                "n_heads": 4,
                "n_kv_heads": 2,
                "mlp_hidden_size": 96,
                "vocab_size": 2048,
                "embedding_size": 2048,
                "rms_norm_eps": config["rms_norm_eps"],
                "rope_theta": 10000.0,
                "include_bias": False,
                "activation_type": "silu",
                "layer_norm_type": "rms",
                "block_type": "llama",
                "rope": True,
                "alibi": False,
                "mask_token_id": MulocoTokenizer().mask_id,
                "max_sequence_length": 64,
            }
        )
    )
    save_file(to_llada_names(load_file(str(llama / "model.safetensors"))), str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_bytes((llama / "tokenizer.json").read_bytes())
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--objective",
            "mdlm",
            "--objective.recipe",
            "dream",
            "--model.flavor",
            f"hf:{folder}",
            "--tokenizer.path",
            str(folder),
            "--checkpoint.initial_load_path",
            str(folder),
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
            "--dump_folder",
            str(tmp_path / "r"),
        ]
    )
    assert proc.returncode != 0 and "is a masked-diffusion model whose output at i predicts token i" in proc.stderr


@pytest.mark.parametrize(
    "recipe",
    [
        ["--objective.recipe", "dream", "--objective.weight", "cart"],
        [
            "--objective.recipe",
            "block",
            "--objective.recipe.block_size",
            "16",
            "--objective.recipe.shift",
            "--objective.recipe.position_masking",
            "0.1",
        ],
        ["--objective.recipe", "full", "--objective.recipe.anneal_steps", "3"],
    ],
)
def test_each_recipe_trains_validates_records_itself_samples_and_exports_its_readout(tmp_path, recipe):
    from muloco.generate.__main__ import main as generate
    from muloco.trained_model import load_config

    run = tmp_path / "run"
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--objective",
            "mdlm",
            *recipe,
            "--training.steps",
            "4",
            "--validator.freq",
            "4",
            "--checkpoint.interval",
            "4",
            "--dump_folder",
            str(run),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert math.isfinite(summary["final_train_loss"]) and math.isfinite(summary["final_validation_loss"])
    facts = json.loads((run / "run.json").read_text())["facts"]
    assert facts["recipe"].startswith(recipe[1])
    assert generate(["--checkpoint", str(run), "--prompt", "def ", "--length", "32", "--json"]) == 0
    from muloco.evaluate.source import from_hf_folder, from_run
    from muloco.export.__main__ import main as export
    from muloco.objectives.recipes import readout_of

    readout = readout_of(load_config(run).objective)
    assert readout.shift == (recipe[1] == "dream" or "--objective.recipe.shift" in recipe)
    assert from_run(str(run), step=None, replica=None, device=torch.device("cpu")).readout == readout
    assert export([str(run), "--out", str(tmp_path / "hf")]) == 0
    assert from_hf_folder(tmp_path / "hf", torch.device("cpu")).readout == readout
    if not readout.block_size:  # scoring: the shifted bound for dream (block-wise scoring is refused)
        assert generate(["--checkpoint", str(run), "--prompt", "def ", "--score", "f(x):", "--mc-samples", "4"]) == 0
    else:  # a block model: multiple choice refused before any task runs, generation evaluated
        from muloco.evaluate.__main__ import main as evaluate

        tasks = ["--include-path", str(Path(__file__).parent / "data" / "lm_eval"), "--limit", "2"]
        assert evaluate([str(tmp_path / "hf"), "--tasks", "muloco_tiny_mc", *tasks]) == 2
        assert not (tmp_path / "hf" / "eval").exists()
        assert evaluate([str(tmp_path / "hf"), "--tasks", "muloco_tiny_gen", *tasks]) == 0
