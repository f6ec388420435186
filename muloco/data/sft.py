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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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
