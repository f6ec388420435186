"""SFT rows (the prompt is never masked or scored) and the conditional log-likelihood scorer."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model

from muloco import compat

compat.apply()

from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402

from muloco.data.corpus import DataError  # noqa: E402
from muloco.data.loader import PackedTextDataLoader, check_readable  # noqa: E402
from muloco.data.sft import sft_row  # noqa: E402
from muloco.data.sources import SftRows  # noqa: E402
from muloco.data.tokenizer import MulocoTokenizer  # noqa: E402
from muloco.objectives import MaskedDiffusion, NoiseKey, SpecialTokens  # noqa: E402
from muloco.objectives.likelihood import autoregressive_nll, diffusion_nll  # noqa: E402

EXAMPLES = [
    {"prompt": "Q: what does len do?\nA:", "response": " it counts the items"},
    {"messages": [{"role": "user", "content": "name a module"}, {"role": "assistant", "content": "os"}]},
    {"prompt": "x = 1 +", "response": " 2"},
] * 8


def _loader(tmp_path, next_token: bool, seq_len=32, lines=EXAMPLES):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    cfg = PackedTextDataLoader.Config(
        source=SftRows(dataset_path=str(path), val_percent=0.0), next_token=next_token, shuffle_documents=False
    )
    return cfg, cfg.build(dp_world_size=1, dp_rank=0, tokenizer=MulocoTokenizer(), seq_len=seq_len, local_batch_size=4)


def test_diffusion_sft_rows_score_the_answer_and_its_one_eos_and_pad_with_unscored_masks(tmp_path):
    """The loader tells the real end of an answer from padding: the response and one EOS are
    targets; the padding is mask tokens that are never scored (no runs of EOS to learn), so the
    row looks like a sampling canvas and the EOS must be predicted from the text."""
    tok = MulocoTokenizer()
    _, loader = _loader(tmp_path, next_token=False)
    inputs, labels = next(iter(loader))
    x = inputs["input"]
    prompt = [tok.bos_id, *tok.encode(EXAMPLES[0]["prompt"])]
    response = tok.encode(EXAMPLES[0]["response"])
    assert x[0, : len(prompt)].tolist() == prompt and (labels[0, : len(prompt)] == IGNORE_INDEX).all()
    tail, scored = x[0, len(prompt) :].tolist(), labels[0, len(prompt) :].tolist()
    end = len(response) + 1
    assert tail[:end] == [*response, tok.eos_id] and scored[:end] == tail[:end]  # the answer and its EOS
    assert set(tail[end:]) == {tok.mask_id} and set(scored[end:]) == {IGNORE_INDEX}  # padding: never a target
    assert (labels == tok.eos_id).sum(dim=1).tolist() == [1, 1, 1, 1]  # one EOS target per row
    chat = tok.decode(x[1, 1:].tolist())
    assert chat.startswith("<|user|>\nname a module\n<|assistant|>\nos")
    objective = MaskedDiffusion.Config(eps=0.95, normaliser="sequence", truncate_probability=0.0).build(
        tokens=SpecialTokens(bos=tok.bos_id, eos=tok.eos_id, mask=tok.mask_id), rows_per_step=4
    )
    eos_masked = 0
    for step in range(4):
        batch = objective.prepare(x, labels, NoiseKey(0, step, 0, 0, 1))
        masked = batch.extra["masked"]
        assert not masked[labels == IGNORE_INDEX].any() and masked.any()
        assert torch.equal(batch.inputs[labels == IGNORE_INDEX], x[labels == IGNORE_INDEX])
        eos_masked += int(masked[labels == tok.eos_id].sum())
    assert eos_masked > 0  # the real EOS is masked and scored


def test_autoregressive_sft_rows_score_only_the_response_and_its_eos(tmp_path):
    tok = MulocoTokenizer()
    _, loader = _loader(tmp_path, next_token=True)
    inputs, labels = next(iter(loader))
    prompt = tok.encode(EXAMPLES[0]["prompt"])
    response = tok.encode(EXAMPLES[0]["response"])
    scored = labels[0][labels[0] != IGNORE_INDEX].tolist()
    assert scored == [*response, tok.eos_id]
    assert inputs["input"][0, : len(prompt) + 1].tolist() == [tok.bos_id, *prompt]


class _Ids:
    bos_id, eos_id, mask_id = 98, 99, 97


def test_rows_cut_long_responses_and_skip_prompts_that_fill_the_row():
    assert sft_row(list(range(10)), [1, 2], 8, _Ids, next_token=False) is None
    inputs, labels = sft_row([5, 6], list(range(20, 40)), 8, _Ids, next_token=False)
    assert inputs == [98, 5, 6, 20, 21, 22, 23, 24] and labels == [IGNORE_INDEX] * 3 + inputs[3:]  # cut: no EOS
    inputs, labels = sft_row([5], [20, 21], 8, _Ids, next_token=False)
    assert (
        inputs == [98, 5, 20, 21, 99, 97, 97, 97] and labels == [IGNORE_INDEX] * 2 + [20, 21, 99] + [IGNORE_INDEX] * 3
    )


def test_a_bad_sft_line_is_named_before_training(tmp_path):
    cfg, _ = _loader(tmp_path, next_token=False, lines=[{"question": "no fields"}])
    with pytest.raises(DataError, match=r"sft.jsonl:1: an SFT line needs string fields 'prompt' and 'response'"):
        check_readable(cfg)
    cfg, _ = _loader(tmp_path, next_token=False, lines=[{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match="must end with the assistant's answer"):
        check_readable(cfg)


def _model(causal: bool):
    return tiny_model(causal, seed=1).double()


def test_diffusion_scorer_estimates_the_exact_bound_over_the_target_tokens():
    """Σ_l (1/l)·mean over l-subsets S of the target of Σ_{i∈S} CE_i, enumerated, against the estimator."""
    model, mask = _model(causal=False), 31
    prompt, target = [29, 4, 5, 6], [7, 8, 9, 10]
    x = torch.tensor([prompt + target])
    exact = 0.0
    for n in range(1, len(target) + 1):
        terms = []
        for subset in itertools.combinations(range(len(prompt), len(x[0])), n):
            where = torch.zeros_like(x, dtype=torch.bool)
            where[0, list(subset)] = True
            with torch.no_grad():
                logits = model(x.masked_fill(where, mask)).float()
            logits[..., mask] = -float("inf")
            terms.append(F.cross_entropy(logits[where], x[where], reduction="sum").item())
        exact += sum(terms) / len(terms) / n
    estimates = [
        diffusion_nll(
            model,
            prompt,
            target,
            mask,
            samples=256,
            batch=64,
            generator=torch.Generator().manual_seed(s),
            device=torch.device("cpu"),
        )
        for s in range(6)
    ]
    mean = sum(estimates) / len(estimates)
    se = (sum((e - mean) ** 2 for e in estimates) / (len(estimates) - 1) / len(estimates)) ** 0.5
    assert abs(mean - exact) < 4 * se + 1e-6 and se < 0.02 * exact, (mean, se, exact)


def test_autoregressive_scorer_is_the_chain_rule():
    model = _model(causal=True)
    prompt, target = [29, 4], [7, 8, 9]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + target])).double(), -1)[0]
    want = -sum(logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(target))
    assert autoregressive_nll(model, prompt, target, torch.device("cpu")) == pytest.approx(want, rel=1e-6)
