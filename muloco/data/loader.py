"""Packed next-token batches from a document source, with a pickle-free checkpoint.

torchtitan's own text loader wraps ``StatefulDataLoader``, whose state is a
pickled blob; this one keeps its whole position in ints, strings, lists and
dicts, so a checkpoint loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import torch
import tyro

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

from muloco.data.corpus import DataError, ShardReader
from muloco.data.sft import SftExample, sft_row
from muloco.data.sources import EmbeddedStdlib, JsonlFiles, SourceConfig

# Documents per tokenizer call: large enough for batch encoding to pay off,
# small enough that the pending-token buffer in a checkpoint stays small.
DOCS_PER_TOKENIZE_CALL = 16

BATCHES_KEY = "muloco_batches"
"""Key of the loader's batch count inside a saved source position."""


PACKED_MARK = b"\x01"
"""First byte of a saved token buffer: an empty ``bytes`` pickles as a call of ``bytes()``, which
the weights-only load of a checkpoint refuses, so a buffer saved empty (a document that ended on a
row's last token) would make the checkpoint unloadable; with the mark no buffer is empty."""


def _packed(tokens: list[int]) -> bytes:
    """A token buffer as a checkpoint keeps it: the mark, then little-endian int64."""
    return PACKED_MARK + np.asarray(tokens, dtype="<i8").tobytes()


def _unpacked(saved: bytes | list[int]) -> list[int]:
    """A saved token buffer: marked int64 bytes, int64 bytes without the mark (checkpoints written
    on 2026-11-27 and 28), or the list of ints that earlier checkpoints hold."""
    if isinstance(saved, (bytes, bytearray)):
        start = len(PACKED_MARK) if len(saved) % 8 == len(PACKED_MARK) else 0
        return np.frombuffer(saved, dtype="<i8", offset=start).tolist()
    return list(saved)


class PackedTextDataLoader(BaseDataLoader):
    """Documents packed end to end into rows of exactly ``seq_len`` tokens.

    Each document becomes ``[bos] + tokens + [eos]``. For next-token prediction
    inputs take ``doc[:-1]`` and labels ``doc[1:]`` before concatenation, so no
    label is ever the first token of the next document. Otherwise (masked
    diffusion) inputs and labels are the whole document, BOS and EOS included:
    every token is a target the objective may mask, so a model learns where a
    document ends (as LLaDA and MDLM pre-train). No ``positions`` are emitted: RoPE
    uses 0..L-1 per row, and the objective finds the documents from the BOS tokens.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        source: tyro.conf.AvoidSubcommands[SourceConfig] = field(default_factory=EmbeddedStdlib)
        """stdlib | jsonl | huggingface | sft: pick with ``--dataloader.source NAME``, then set its
        own settings as ``--dataloader.source.SETTING`` (see --help after picking)."""

        split: str = "train"
        """
        'train' or 'validation'. For a 'huggingface' source any other value is
        read as a split name of the dataset, whole.
        """

        infinite: bool = True
        """
        Start a new epoch, in a new deterministic order, when the data runs out.
        When False iteration ends after one pass (the validator's mode).
        """

        def validate(self, key: str = "dataloader") -> None:
            """torchtitan's loader config has ``dataset`` and ``dataset_path``; muloco reads neither (its
            data comes from ``source``), so a value there would be silently ignored. Then the source's
            own check (its files exist)."""
            if getattr(self, "dataset", "") or getattr(self, "dataset_path", None):
                raise ValueError(f"{key}.dataset / {key}.dataset_path are not read: the data comes from "
                                 f"{key}.source; use --{key}.source jsonl --{key}.source.dataset_path PATH "
                                 f"(or --{key}.source huggingface --{key}.source.dataset NAME).")
            self.source.validate(f"{key}.source")

        seed: int = 0
        """Seed of the per-epoch document order (with the epoch number)."""

        next_token: bool = True
        """
        Labels are the next tokens (autoregressive). Set from the objective:
        masked diffusion reads whole documents, every token (BOS and EOS too) a label.
        """

        shuffle_documents: bool = True
        """
        Read the documents in a new order every epoch, seeded by (seed, epoch):
        'stdlib' its files, 'jsonl' and 'sft' every line of every file (through
        an index of line offsets, 8 bytes a line, cached), 'huggingface' through
        a shuffle buffer (source.shuffle_buffer, checkpointed); off, they are
        read in their stored order.
        """

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = None,
    ) -> None:
        # snapshot_every_n_steps is accepted for the Trainer's call only: the
        # state here is a few ints plus one tokenizer group, cheap at any step.
        self.config = config
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.tokenizer = tokenizer
        self.seq_len = _positive(seq_len, "training.seq_len")
        self.local_batch_size = _positive(local_batch_size, "training.local_batch_size")
        self.source = source_for(config, rank=dp_rank, world=dp_world_size)
        self._rank_key = f"dp_rank_{dp_rank}"
        self._epoch = 0
        self._start_position: dict[str, Any] = {}
        self._reader: ShardReader | None = None
        self._documents: Iterator[str] | None = None
        self._inputs: list[int] = []
        self._labels: list[int] = []
        self.skipped = 0
        """SFT examples whose prompt alone fills a row."""
        self._batches = 0
        """Batches handed out so far (all epochs): with the seed and rank, what a random response
        cut draws from, so a resumed run cuts its batches as an uninterrupted one would."""
        cutoff = getattr(config.source, "cutoff", None)
        self._cutoff = cutoff() if cutoff is not None and config.split == "train" else None

    def describe(self) -> str:
        layout = "one SFT example per row" if self.config.source.one_example_per_row else "packed documents"
        return (
            f"{self.source.describe()}; {layout}, rows of {self.seq_len} tokens, "
            f"{self.local_batch_size} rows per batch, "
            f"{'infinite' if self.config.infinite else 'one pass'}"
        )

    # ---------------------------------------------------------------- reading

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while (batch := self._next_batch()) is not None:
            yield batch

    def _next_batch(self) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        """The next batch; at the end of a finite pass a short one, then None."""
        wanted = self.local_batch_size * self.seq_len
        while len(self._inputs) < wanted and self._read_more():
            pass
        rows = min(self.local_batch_size, len(self._inputs) // self.seq_len)
        if rows == 0:
            return None
        taken = rows * self.seq_len
        inputs = torch.tensor(self._inputs[:taken], dtype=torch.long).view(rows, self.seq_len)
        labels = torch.tensor(self._labels[:taken], dtype=torch.long).view(rows, self.seq_len)
        del self._inputs[:taken], self._labels[:taken]
        if self._cutoff is not None and self._cutoff.enabled:
            pad = self.tokenizer.eos_id if self.config.next_token else self.tokenizer.mask_id
            rng = np.random.default_rng([self.config.seed, self.dp_rank, self._batches])
            self._cutoff.apply(inputs, labels, pad, rng)
        self._batches += 1
        return {"input": inputs}, labels

    def _read_more(self) -> bool:
        """Tokenize the next group of documents into the buffer; False when the data has ended."""
        while True:
            texts = list(islice(self._open_documents(), DOCS_PER_TOKENIZE_CALL))
            if texts:
                self._append_documents(texts)
                return True
            if not self._end_epoch():
                return False

    def _open_documents(self) -> Iterator[str]:
        if self._documents is None:
            self._reader = self.source.open_shard(self._epoch, self._start_position or None)
            self._documents = self._reader.documents()
        return self._documents

    def _append_documents(self, texts: list) -> None:
        if self.config.source.one_example_per_row:
            self._append_examples(texts)
            return
        for doc in self._encode(texts):
            if self.config.next_token:
                self._inputs.extend(doc[:-1])
                self._labels.extend(doc[1:])
            else:
                self._inputs.extend(doc)
                self._labels.extend(doc)

    def _append_examples(self, examples: list[SftExample]) -> None:
        prompts = self._encode([e.prompt for e in examples], documents=False)
        responses = self._encode([e.response for e in examples], documents=False)
        for prompt, response in zip(prompts, responses):
            row = sft_row(prompt, response, self.seq_len, self.tokenizer, self.config.next_token)
            if row is None:
                self.skipped += 1
                if self.skipped in (1, 100, 10000):
                    logger.warning(f"{self.skipped} SFT example(s) skipped so far: the prompt fills the "
                                   f"{self.seq_len}-token row; raise training.seq_len")
                continue
            self._inputs.extend(row[0])
            self._labels.extend(row[1])

    def _encode(self, texts: list[str], documents: bool = True) -> list[list[int]]:
        """Token ids of each text; ``documents``: wrapped in BOS ... EOS."""
        encode_batch = getattr(self.tokenizer, "encode_batch", None)
        if encode_batch is not None:
            return encode_batch(texts, add_bos=documents, add_eos=documents)
        return [self.tokenizer.encode(t, add_bos=documents, add_eos=documents) for t in texts]

    def _end_epoch(self) -> bool:
        """Close the finished pass; True if another one starts."""
        assert self._reader is not None
        if self._reader.doc_index == 0:
            raise DataError(
                f"{self.source.describe()} yielded no documents: this shard is "
                "empty; check dataloader.source's files / dataloader.split, or use "
                "fewer data-parallel ranks than documents"
            )
        if not self.config.infinite:
            return False
        self._reader.close()
        self._epoch += 1
        self._start_position = {}
        self._reader = self._documents = None
        logger.info(f"Data re-loop: epoch {self._epoch} of {self.source.describe()}")
        return True

    # ---------------------------------------------------------- checkpointing

    def state_dict(self) -> dict[str, Any]:
        """This shard's read position, keyed by rank like torchtitan's loaders.

        The source's cursor travels as a JSON string: DCP loads only the keys
        the receiving state_dict already has, and a fresh loader cannot know
        the nested keys (a Hugging Face stream's, say) of a saved position. The
        packing buffer (the rest of the current document, 150k tokens for a
        large stdlib file) travels as int64 bytes: as a list, DCP's planner
        visited each token at every save (154 ms per walk of the state).
        """
        position = self._reader.position if self._reader is not None else self._start_position
        return {
            self._rank_key: {
                "source": self._source_key(),
                "split": self.config.split,
                "next_token": self.config.next_token,
                "epoch": self._epoch,
                # the batch count rides in the position's JSON: a new key in the state would be missing
                # from every older checkpoint, and DCP refuses a load that lacks one
                "position": json.dumps({**position, BATCHES_KEY: self._batches}, sort_keys=True),
                "inputs": _packed(self._inputs),
                "labels": _packed(self._labels),
            },
            "world_size": self.dp_world_size,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._check_compatible(state_dict)
        state = state_dict[self._rank_key]
        if self._reader is not None:
            self._reader.close()
        self._reader = self._documents = None
        self._epoch = int(state["epoch"])
        self._start_position = json.loads(state["position"])
        self._batches = int(self._start_position.pop(BATCHES_KEY, 0))  # absent before 2026-11-28
        self.source.check_position(self._start_position)  # at the load, not at the first batch
        self._inputs = _unpacked(state["inputs"])
        self._labels = _unpacked(state["labels"])

    def _source_key(self) -> str:
        """The reader a position belongs to: SFT rows are read as JSON lines (and were recorded so)."""
        return JsonlFiles.name if isinstance(self.config.source, JsonlFiles) else self.config.source.name

    def _check_compatible(self, state_dict: dict[str, Any]) -> None:
        saved_world = state_dict.get("world_size")
        if saved_world != self.dp_world_size:
            raise DataError(
                f"the checkpoint's data loader state is for {saved_world} data shards, "
                f"this run has {self.dp_world_size}: resharding a data position is not "
                "supported; resume with the same data-parallel size, or leave the "
                "loader out with checkpoint.exclude_from_loading=['dataloader']"
            )
        state = state_dict.get(self._rank_key)
        if state is None:
            raise DataError(f"the checkpoint has no data loader state for {self._rank_key}")
        if state.get("next_token", True) != self.config.next_token:
            raise DataError(
                "the checkpoint's data position was read for the "
                f"{'autoregressive' if state.get('next_token', True) else 'masked-diffusion'} objective, "
                "this run trains the other one; resume with the same --objective, or leave the loader "
                "out with checkpoint.exclude_from_loading=['dataloader']"
            )
        saved = (state.get("source"), state.get("split"))
        if saved != (self._source_key(), self.config.split):
            raise DataError(
                f"the checkpoint's data position is for dataloader.source/split={saved}, "
                f"this run reads {(self._source_key(), self.config.split)}; restore the "
                "setting, or leave the loader out with "
                "checkpoint.exclude_from_loading=['dataloader']"
            )


def source_for(config: PackedTextDataLoader.Config, *, rank: int, world: int):
    """The document source ``config`` names, as shard ``rank`` of ``world``."""
    return config.source.build(split=config.split, seed=config.seed, shuffle=config.shuffle_documents,
                               rank=rank, world=world)


def check_readable(config: PackedTextDataLoader.Config, prefix: str = "dataloader") -> None:
    """DataError unless ``config``'s split resolves to files and yields a first document.

    Runs in preflight, once per split the run will read, as shard 0 of 1: it resolves
    the files (a folder without *.jsonl, a glob matching nothing) and reads only up to
    the first document (an empty file, a bad first line), not whole files.
    """
    try:
        if source_for(config, rank=0, world=1).first_document() is not None:
            return
    except OSError as err:
        raise DataError(
            f"{prefix}.source {config.source.name!r}: cannot read {err.filename or 'the data'}: "
            f"{err.strerror or err}; check the path and its permissions."
        ) from None
    if config.split == "validation":
        separate = f"set {prefix}.source.validation_path, " if hasattr(config.source, "validation_path") else ""
        fix = (f"{separate}raise {prefix}.source.val_percent (the held-out part is empty), or turn "
               "validation off with --validator.no-enable")
    else:
        fix = "give data with at least one document (jsonl: one JSON object per non-blank line)"
    raise DataError(f"{prefix}.source {config.source.name!r} ({config.source.label()}) has no document in its "
                    f"{config.split} split; {fix}.")


def _positive(value: int, key: str) -> int:
    if value < 1:
        raise DataError(f"{key}={value} must be at least 1 for the data loader")
    return value
