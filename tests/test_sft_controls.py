"""Transformer Lab's SFT controls: Dream's random response cuts per batch, a run's length in
epochs, and evaluation / checkpoint / log intervals as fractions of the run."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from muloco import compat

compat.apply()

from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402

from muloco.config.checks import check_config  # noqa: E402
from muloco.config.cli import parse_args  # noqa: E402
from muloco.config.loader import ConfigError  # noqa: E402
from muloco.config.run_length import count_rows, resolve_run_length  # noqa: E402
from muloco.data.loader import PackedTextDataLoader  # noqa: E402
from muloco.data.sft import ResponseCutoff, sft_row  # noqa: E402
from muloco.data.sources import SftRows  # noqa: E402
from muloco.data.tokenizer import MulocoTokenizer  # noqa: E402


class _Ids:
    bos_id, eos_id, mask_id = 98, 99, 97


# prompt lengths 1..4 (with BOS 2..5), response lengths 3, 6, 2, 5 (EOS included)
EXAMPLES = [([5], [20, 21]), ([5, 6], [20, 21, 22, 23, 24]), ([5, 6, 7], [20]), ([5, 6, 7, 8], [20, 21, 22, 23])]


def _batch(next_token: bool, seq_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [sft_row(p, r, seq_len, _Ids, next_token) for p, r in EXAMPLES]
    return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


class _Draw:
    """A generator whose draws the test chooses: ``integers`` returns ``pick`` (clipped to its
    range), ``random`` returns ``u``."""

    def __init__(self, pick: int, u: float = 0.0):
        self.pick, self.u, self.asked = pick, u, []

    def integers(self, low, high=None):
        low, high = (0, low) if high is None else (low, high)
        self.asked.append((low, high))
        return min(max(self.pick, low), high - 1)

    def random(self):
        return self.u


@pytest.mark.parametrize("next_token", [False, True])
def test_per_batch_cutoff_cuts_every_response_to_the_length_of_the_row_drawn(next_token):
    """Dream's perbatch_cutoff by hand: row 2's response (EOS included) is 2 tokens, so every
    response keeps at most its first 2 scored tokens; prompts and shorter responses stay; the cut
    tail is the row's own padding (mask tokens for diffusion, EOS for AR), never a target."""
    inputs, labels = _batch(next_token)
    before_in, before_lab = inputs.clone(), labels.clone()
    ResponseCutoff(per_batch=True).apply(inputs, labels, _Ids.eos_id if next_token else _Ids.mask_id, _Draw(2))
    scored = labels != IGNORE_INDEX
    assert scored.sum(dim=1).tolist() == [2, 2, 2, 2]
    pad = _Ids.eos_id if next_token else _Ids.mask_id
    for row, (prompt, response) in enumerate(EXAMPLES):
        head = 1 + len(prompt)
        start = head - 1 if next_token else head
        keep = start + 2
        assert torch.equal(inputs[row, :keep], before_in[row, :keep])  # the prompt and 2 response tokens
        assert torch.equal(labels[row, :keep], before_lab[row, :keep])
        assert (inputs[row, keep:] == pad).all() and (labels[row, keep:] == IGNORE_INDEX).all()
    if not next_token:  # diffusion rows: the kept targets are exactly the first two of [response, EOS]
        assert labels[0][scored[0]].tolist() == [20, 21] and labels[2][scored[2]].tolist() == [20, 99]


def test_response_cutoff_ratio_ends_every_row_c_tokens_before_the_longest():
    """Dream's resp_cutoff_ratio by hand: ends are 2+3, 3+6, 4+2, 5+5 (prompt with BOS + response);
    the shortest response is 2, so c is drawn from [1, 2) = 1 and every row ends at 10 - 1 = 9:
    only the two rows reaching past 9 lose tokens. A draw above the ratio leaves the batch whole."""
    inputs, labels = _batch(next_token=False)
    draw = _Draw(pick=1, u=0.05)
    ResponseCutoff(ratio=0.1).apply(inputs, labels, _Ids.mask_id, draw)
    assert draw.asked == [(1, 2)]
    ends = [int(torch.nonzero(labels[r] != IGNORE_INDEX).max()) + 1 for r in range(4)]
    assert ends == [5, 9, 6, 9]
    inputs, labels = _batch(next_token=False)
    whole = labels.clone()
    ResponseCutoff(ratio=0.1).apply(inputs, labels, _Ids.mask_id, _Draw(pick=1, u=0.5))
    assert torch.equal(labels, whole)


def test_the_ratio_cut_never_reaches_a_prompt_on_random_batches():
    """Dream's bound: c < the shortest response, so no prompt token is ever cut; and each cut
    batch still scores a token of every row."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        examples = [
            (list(range(1, 1 + int(rng.integers(1, 8)))), list(range(20, 20 + int(rng.integers(1, 8)))))
            for _ in range(4)
        ]
        rows = [sft_row(p, r, 24, _Ids, False) for p, r in examples]
        inputs, labels = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
        prompts = labels == IGNORE_INDEX
        kept_in = inputs.clone()
        ResponseCutoff(ratio=1.0).apply(inputs, labels, _Ids.mask_id, rng)
        assert torch.equal(inputs[prompts & (kept_in != _Ids.mask_id)], kept_in[prompts & (kept_in != _Ids.mask_id)])
        assert ((labels != IGNORE_INDEX).sum(dim=1) >= 1).all()


def _sft_file(tmp_path, n=40):
    path = tmp_path / "sft.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} plus {i}?", "response": " it is " + "ab " * (i % 9)}) + "\n"
            for i in range(n)
        )
    )
    return path


def _loader(path, split="train", infinite=True, **cut):
    cfg = PackedTextDataLoader.Config(
        source=SftRows(dataset_path=str(path), val_percent=20.0, **cut),
        next_token=False,
        split=split,
        infinite=infinite and split == "train",
    )
    return cfg.build(dp_world_size=1, dp_rank=0, tokenizer=MulocoTokenizer(), seq_len=48, local_batch_size=4)


def test_the_loader_cuts_training_batches_reproducibly_across_a_resume_and_never_validation(tmp_path):
    path = _sft_file(tmp_path)
    whole = [b[1] for _, b in zip(range(6), _loader(path))]
    cut_loader = _loader(path, per_batch_cutoff=True)
    it = iter(cut_loader)
    cut = [next(it)[1] for _ in range(3)]
    state = cut_loader.state_dict()
    cut += [next(it)[1] for _ in range(3)]
    for c, w in zip(cut, whole):  # the same rows, each response cut to the length of one row drawn
        full, kept = (w != IGNORE_INDEX).sum(dim=1), (c != IGNORE_INDEX).sum(dim=1)
        drawn = int(kept.max())
        assert drawn in full.tolist() and torch.equal(kept, full.clamp(max=drawn))
    assert any(not torch.equal(c, w) for c, w in zip(cut, whole))
    resumed = _loader(path, per_batch_cutoff=True)
    resumed.load_state_dict(state)
    again = [b[1] for _, b in zip(range(3), resumed)]
    assert all(torch.equal(a, b) for a, b in zip(again, cut[3:]))  # the same cuts after a resume
    assert json.loads(state["dp_rank_0"]["position"])["muloco_batches"] == 3
    val_whole = [lab for lab in (b for _, b in _loader(path, "validation"))]
    val_cut = [lab for lab in (b for _, b in _loader(path, "validation", per_batch_cutoff=True))]
    assert all(torch.equal(a, b) for a, b in zip(val_whole, val_cut)) and val_whole


def test_a_checkpoint_written_before_the_batch_count_still_resumes(tmp_path):
    path = _sft_file(tmp_path)
    loader = _loader(path, per_batch_cutoff=True)
    next(iter(loader))
    state = loader.state_dict()
    position = json.loads(state["dp_rank_0"]["position"])
    position.pop("muloco_batches")
    state["dp_rank_0"]["position"] = json.dumps(position)
    fresh = _loader(path, per_batch_cutoff=True)
    fresh.load_state_dict(state)
    assert fresh._batches == 0 and next(iter(fresh))[1].shape == (4, 48)


TINY = ["--model.flavor", "llama3-w64-d2-h2", "--training.seq_len", "48", "--training.local_batch_size", "4"]


def _parsed(tmp_path, *extra, config="diffusion/sft"):
    source = [] if config == "diffusion/sft" else ["--dataloader.source", "sft"]
    _, c = parse_args(
        [
            "--config",
            config,
            *TINY,
            *source,
            "--dataloader.source.dataset_path",
            str(_sft_file(tmp_path)),
            "--dump_folder",
            str(tmp_path / "run"),
            *extra,
        ]
    )
    return c


def test_epochs_become_steps_from_the_rows_the_loader_makes(tmp_path):
    c = _parsed(
        tmp_path,
        "--training.epochs",
        "2.5",
        "--validator.freq",
        "0.25",
        "--metrics.log_freq",
        "0.1",
        "--checkpoint.interval",
        "0.5",
    )
    check_config(c)
    rows = count_rows(c)
    held_out = replace(c.dataloader, split="validation", infinite=False).build(
        dp_world_size=1, dp_rank=0, tokenizer=MulocoTokenizer(), seq_len=48, local_batch_size=4
    )
    assert rows + sum(len(lab) for _, lab in held_out) == 40 and rows > 30  # every example is one row
    resolve_run_length(c, world_size=2)  # two data-parallel ranks of 4 rows: 8 rows a step
    assert c.training.steps == math.ceil(2.5 * rows / 8)
    steps = c.training.steps
    assert (c.validator.freq, c.metrics.log_freq, c.checkpoint.interval) == (
        max(1, round(0.25 * steps)),
        max(1, round(0.1 * steps)),
        max(1, round(0.5 * steps)),
    )
    assert all(isinstance(v, int) for v in (c.validator.freq, c.metrics.log_freq, c.checkpoint.interval))


def test_under_diloco_an_epoch_counts_every_group_and_ends_on_whole_syncs(tmp_path):
    """K=3 groups read disjoint shards, so an epoch is a third of the steps; the run ends on a sync
    and checkpoints land on sync boundaries."""
    c = _parsed(
        tmp_path,
        "--training.epochs",
        "4",
        "--outer.sync_every",
        "5",
        "--fault_tolerance.group_size",
        "3",
        "--checkpoint.interval",
        "0.3",
        "--objective.normaliser",
        "sequence",
        config="diffusion/muloco",
    )
    check_config(c)
    rows = count_rows(c)
    resolve_run_length(c, world_size=1)
    assert c.training.steps == math.ceil(math.ceil(4 * rows / 12) / 5) * 5
    assert c.checkpoint.interval % 5 == 0 and c.checkpoint.interval == max(1, round(0.3 * c.training.steps / 5)) * 5
    check_config(c)  # the resolved run passes the sync checks


def test_steps_on_the_command_line_win_over_a_modules_epochs_and_both_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--training.steps and --training.epochs both set"):
        _parsed(tmp_path, "--training.steps", "10", "--training.epochs", "1")
    c = _parsed(tmp_path, "--training.steps", "10")
    assert c.training.epochs == 0


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--validator.freq", "1.5"], r"validator.freq is 1.5; give a whole number of steps .* or a fraction"),
        (["--metrics.log_freq", "0"], r"metrics.log_freq is 0; give a whole number"),
        (["--checkpoint.enable", "--checkpoint.interval", "-0.5"], r"checkpoint.interval is -0.5"),
        (["--training.epochs", "-1"], r"training.epochs is -1.0; it must be a positive number of passes"),
        (["--dataloader.source.response_cutoff_ratio", "1.5"], r"response_cutoff_ratio is 1.5; it is a probability"),
        (
            ["--dataloader.source.per_batch_cutoff", "--dataloader.source.response_cutoff_ratio", "0.1"],
            r"per_batch_cutoff and dataloader.source.response_cutoff_ratio are exclusive",
        ),
    ],
)
def test_bad_sft_controls_are_one_clear_error(tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        check_config(_parsed(tmp_path, *flags))


def test_epochs_refuse_a_streamed_source(tmp_path):
    _, c = parse_args(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--dataloader.source",
            "huggingface",
            "--dataloader.source.dataset",
            "some/dataset",
            "--training.epochs",
            "1",
        ]
    )
    with pytest.raises(ConfigError, match="huggingface source is streamed: give --training.steps"):
        resolve_run_length(c)
