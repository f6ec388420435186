"""Supervised fine-tuning examples: a prompt and a response per JSON line, one example per row.

A line is ``{"prompt": ..., "response": ...}`` or ``{"messages": [{"role": ..., "content":
...}, ...]}`` ending with an assistant message (field names configurable). A conversation
becomes its last assistant message as the response and every turn before it as the
prompt, each turn written ``<|role|>\\ncontent\\n`` and the prompt ending ``<|assistant|>\\n``.

Rows are not packed: each holds one example, ``[bos] + prompt + response + [eos]``, padded
to the row length. The prompt is never trained on (its labels are ignored), nor is the
padding. For masked diffusion the response and its one EOS are the targets, and the padding
is ``<|mask|>`` tokens that are never scored: to the model the row looks like a sampling
canvas (prompt, then masks to the end), so it learns where an answer ends by predicting
its EOS from the text, not from where visible padding starts. LLaDA pads with EOS and
scores it, which teaches runs of EOS and counts them in the loss; here nothing after the
real EOS is a target. Normalise per response with ``--objective.normaliser sequence``. For
next-token prediction the row is shifted and the padding ignored. A response that does not
fit is cut (and has no EOS); an example whose prompt fills the row is skipped (counted in
the data description).

Dream's SFT (and dllm's and Transformer Lab's Dream trainers after it) also cuts responses at
random, so that a model does not learn the answer lengths of its data: ``ResponseCutoff``
trims the responses of a training batch in place (the cut tail becomes unscored padding, so
rows keep their length and compiled shapes stay put).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchtitan.components.loss import IGNORE_INDEX

from muloco.data.corpus import DataError, decode_jsonl_line


@dataclass(frozen=True)
class SftFields:
    prompt: str = "prompt"
    response: str = "response"
    messages: str = "messages"


@dataclass(frozen=True)
class SftExample:
    prompt: str
    response: str


def _render(messages: list, where: str) -> SftExample:
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                               and isinstance(m.get("role"), str) for m in messages):
        raise DataError(f"{where}: messages must be a non-empty list of {{'role': str, 'content': str}}; "
                        "fix or remove the line")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message has role {messages[-1]['role']!r}; an SFT conversation "
                        "must end with the assistant's answer")
    prompt = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages[:-1]) + "<|assistant|>\n"
    return SftExample(prompt, messages[-1]["content"])


def parse_sft_line(raw: bytes, path: Path, line_number: int, fields: SftFields) -> SftExample:
    """One JSON line as an example, or a DataError that points at the line."""
    where = f"{path}:{line_number}"
    line = decode_jsonl_line(raw, where)
    try:
        record = json.loads(line)
    except ValueError as err:
        raise DataError(f"{where}: not a JSON object ({err}); fix or remove the line") from None
    if isinstance(record, dict) and fields.messages in record:
        return _render(record[fields.messages], where)
    if isinstance(record, dict) and isinstance(record.get(fields.prompt), str) \
            and isinstance(record.get(fields.response), str):
        return SftExample(record[fields.prompt], record[fields.response])
    found = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise DataError(f"{where}: an SFT line needs string fields {fields.prompt!r} and {fields.response!r}, "
                    f"or a {fields.messages!r} list (found {found}); set dataloader.source.prompt_field / "
                    "response_field / messages_field, or fix the line")


def sft_row(prompt: list[int], response: list[int], seq_len: int, tokens, next_token: bool
            ) -> tuple[list[int], list[int]] | None:
    """``(inputs, labels)`` of exactly ``seq_len`` tokens, or None if the prompt fills the row.

    ``tokens``: the tokenizer (its ``bos_id``, ``eos_id`` and ``mask_id``)."""
    head = [tokens.bos_id, *prompt]
    if len(head) >= seq_len:
        return None
    if not next_token:  # masked diffusion: the answer and its EOS are targets; padding is unscored masks
        body = [*response, tokens.eos_id][: seq_len - len(head)]
        pad = seq_len - len(head) - len(body)
        return head + body + [tokens.mask_id] * pad, [IGNORE_INDEX] * len(head) + body + [IGNORE_INDEX] * pad
    sequence = (head + [*response, tokens.eos_id])[: seq_len + 1]
    inputs, labels = sequence[:-1], sequence[1:]
    labels = [IGNORE_INDEX] * (len(head) - 1) + labels[len(head) - 1:]
    pad = seq_len - len(inputs)
    return inputs + [tokens.eos_id] * pad, labels + [IGNORE_INDEX] * pad


@dataclass(frozen=True)
class ResponseCutoff:
    """Dream's two random response cuts, per training batch (``DreamSFTCollator`` in dllm).

    ``per_batch`` (Dream's ``perbatch_cutoff``): draw one row of the batch and cut every
    response to that row's response length. Else, with probability ``ratio`` (Dream's
    ``resp_cutoff_ratio``) per batch: draw ``c`` uniformly from ``[1, shortest response)`` and
    end every row ``c`` tokens before the batch's longest one ends. Prompts are never cut. The
    two are exclusive, as in Dream (its ratio is read only without the per-batch cut).
    """

    per_batch: bool = False
    ratio: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.per_batch or self.ratio > 0

    def keep_until(self, start: torch.Tensor, length: torch.Tensor, rng: np.random.Generator
                   ) -> torch.Tensor | None:
        """Per row, the first position to cut (None: this batch stays whole). ``start``: each
        row's first scored position; ``length``: how many it scores (its response, EOS included)."""
        if self.per_batch:
            kept = length[int(rng.integers(len(length)))]
            return start + torch.minimum(length, kept)
        if rng.random() >= self.ratio:
            return None
        shortest = int(length.min())
        if shortest <= 1:
            return None
        end = start + length
        return torch.minimum(end, end.max() - int(rng.integers(1, shortest)))

    def apply(self, inputs: torch.Tensor, labels: torch.Tensor, pad_id: int, rng: np.random.Generator) -> None:
        """Cut the responses of a batch of SFT rows in place: past each row's cut, inputs become
        ``pad_id`` and labels ``IGNORE_INDEX``, the row's own padding."""
        scored = labels != IGNORE_INDEX
        length = scored.sum(dim=1)  # >= 1: a row always scores its response's first token or EOS
        start = scored.int().argmax(dim=1)
        cut_from = self.keep_until(start, length, rng)
        if cut_from is None:
            return
        cut = torch.arange(labels.shape[1]).unsqueeze(0) >= cut_from.unsqueeze(1)
        inputs.masked_fill_(cut, pad_id)
        labels.masked_fill_(cut, IGNORE_INDEX)
