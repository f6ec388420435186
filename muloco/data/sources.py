"""Where a data loader's documents come from: one config class per source, chosen like a codec.

``--dataloader.source jsonl`` puts a ``JsonlFiles`` config in the loader (the settings a config
module gave, if it already chose that source), and the chosen source's own settings are then
``--dataloader.source.SETTING`` (``--dataloader.source.dataset_path data/*.jsonl``). Each source
holds only the fields it reads; a setting of another source is one error that names where it
belongs (``muloco.config.variants``). ``build`` makes the reader of one split and shard.

- ``stdlib``: this interpreter's standard-library ``.py`` files (no download): the embedded corpus;
- ``jsonl``: local JSON-lines files, one document per line;
- ``huggingface``: a ``datasets`` hub name or local dataset directory, streamed;
- ``sft``: JSON-lines files of prompt/response (or chat) rows, one example per row, the prompt
  never trained on (``muloco/data/sft.py``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Annotated, ClassVar

import tyro

from muloco.data.corpus import DocumentSource, HuggingFaceSource, JsonlSource, StdlibSource
from muloco.data.sft import ResponseCutoff, SftFields, parse_sft_line


@dataclass(kw_only=True, slots=True)
class EmbeddedStdlib:
    """The standard library's ``.py`` files, split into train/validation by a hash of each path."""

    name: ClassVar[str] = "stdlib"
    one_example_per_row: ClassVar[bool] = False
    val_percent: float = 5.0
    """Percent of files held out for validation."""

    def validate(self, key: str = "dataloader.source") -> None:
        """Nothing to find on disk: the corpus ships inside the package."""

    def build(self, *, split: str, seed: int, shuffle: bool, rank: int, world: int) -> DocumentSource:
        return StdlibSource(split=split, val_percent=self.val_percent, seed=seed, shuffle=shuffle, rank=rank,
                            world=world)

    def label(self) -> str:
        return "the standard library"


@dataclass(kw_only=True, slots=True)
class JsonlFiles:
    """Local JSON-lines files; each line one document (its ``text_field``)."""

    name: ClassVar[str] = "jsonl"
    one_example_per_row: ClassVar[bool] = False
    dataset_path: str | None = None
    """A JSONL file, a directory of *.jsonl files, or a glob."""
    validation_path: str | None = None
    """Separate validation files (file, directory or glob), used whole; unset: each line is
    assigned to a split by a hash of (file name, line number)."""
    text_field: str = "text"
    """Field of each JSON line that holds the document text."""
    val_percent: float = 5.0
    """Percent of lines held out for validation by the hash split."""

    def validate(self, key: str = "dataloader.source") -> None:
        """The files exist (a glob is matched when the data is read)."""
        where = f"{key}.dataset_path ({key} is {self.name!r})"
        path = self.dataset_path
        if not path:
            raise ValueError(f"{where} is empty; give the JSONL file, directory or glob to read.")
        if not any(ch in path for ch in "*?[") and not os.path.exists(path):
            raise ValueError(f"{where} '{path}' does not exist; give an existing JSONL file or directory, or "
                             f"use --{key} stdlib for the embedded corpus.")

    def build(self, *, split: str, seed: int, shuffle: bool, rank: int, world: int) -> DocumentSource:
        return JsonlSource(dataset_path=self.dataset_path, validation_path=self.validation_path, split=split,
                           text_field=self.text_field, val_percent=self.val_percent, seed=seed, shuffle=shuffle,
                           rank=rank, world=world, parse_line=self._parse_line())

    def _parse_line(self):
        return None

    def label(self) -> str:
        return self.dataset_path or "no files"


@dataclass(kw_only=True, slots=True)
class SftRows(JsonlFiles):
    """JSON-lines files of supervised fine-tuning rows: a prompt and a response, or a chat whose
    last message answers; one example per row, the prompt never trained on."""

    name: ClassVar[str] = "sft"
    one_example_per_row: ClassVar[bool] = True
    prompt_field: str = "prompt"
    """Field of the prompt."""
    response_field: str = "response"
    """Field of the response."""
    messages_field: str = "messages"
    """Field of a chat (a list of {role, content}; the last one answers)."""
    per_batch_cutoff: bool = False
    """Dream's ``perbatch_cutoff``: cut every response of a training batch to the response length
    of one of its rows, drawn at random (validation batches are never cut)."""
    response_cutoff_ratio: float = 0.0
    """Dream's ``resp_cutoff_ratio``: the probability that a training batch's rows all end a random
    1 .. shortest-response-1 tokens before its longest one (without ``per_batch_cutoff`` only)."""

    def validate(self, key: str = "dataloader.source") -> None:
        JsonlFiles.validate(self, key)
        if not 0.0 <= self.response_cutoff_ratio <= 1.0:
            raise ValueError(f"{key}.response_cutoff_ratio is {self.response_cutoff_ratio}; it is a probability "
                             "per batch, between 0 and 1 (Dream's trainers use 0.0 to 0.2).")
        if self.per_batch_cutoff and self.response_cutoff_ratio > 0:
            raise ValueError(f"{key}.per_batch_cutoff and {key}.response_cutoff_ratio are exclusive (Dream reads "
                             "the ratio only without the per-batch cut, and would ignore it here); drop one.")

    def cutoff(self) -> ResponseCutoff:
        return ResponseCutoff(per_batch=self.per_batch_cutoff, ratio=self.response_cutoff_ratio)

    def _parse_line(self):
        fields = SftFields(self.prompt_field, self.response_field, self.messages_field)
        return functools.partial(parse_sft_line, fields=fields)


@dataclass(kw_only=True, slots=True)
class HuggingFaceDataset:
    """A ``datasets`` dataset (hub name or local directory), streamed through a seeded shuffle buffer."""

    name: ClassVar[str] = "huggingface"
    one_example_per_row: ClassVar[bool] = False
    dataset: str = ""
    """Hub dataset name (e.g. 'HuggingFaceFW/fineweb-edu'); ``dataset_path`` wins when set."""
    dataset_path: str | None = None
    """A local dataset directory (or hub name) that overrides ``dataset``."""
    dataset_subset: str | None = None
    """Dataset configuration name (e.g. 'sample-10BT'); None for the default."""
    validation_split: str = "validation"
    """Split read for validation; a dataset without it has 'train' divided by a hash of each
    example's text (``val_percent`` held out)."""
    text_field: str = "text"
    """Field of each example that holds the document text."""
    val_percent: float = 5.0
    """Percent held out by the hash split when the dataset has no validation split."""
    shuffle_buffer: int = 1000
    """Training documents each next one is drawn from at random (a window shuffle, resumed exactly:
    the buffer rides in the checkpoint); 0, or --dataloader.no-shuffle-documents: the dataset's
    order. Validation reads the dataset's order (the same batches every time, without streaming a
    buffer's worth of held-out documents at each evaluation)."""

    def validate(self, key: str = "dataloader.source") -> None:
        """A local ``dataset_path`` exists (a hub name goes in ``dataset``)."""
        if self.shuffle_buffer < 0 or self.shuffle_buffer != int(self.shuffle_buffer):
            raise ValueError(f"{key}.shuffle_buffer is {self.shuffle_buffer!r}; give a number of documents "
                             "(0: the dataset's order)")
        if self.dataset_path and not os.path.exists(self.dataset_path):
            raise ValueError(f"{key}.dataset_path ({key} is {self.name!r}) '{self.dataset_path}' does not exist; "
                             f"for a dataset on the Hugging Face hub set --{key}.dataset <name> and leave "
                             "dataset_path empty.")

    def build(self, *, split: str, seed: int, shuffle: bool, rank: int, world: int) -> DocumentSource:
        return HuggingFaceSource(name_or_path=self.dataset_path or self.dataset or None, subset=self.dataset_subset,
                                 split=split, validation_split=self.validation_split, text_field=self.text_field,
                                 val_percent=self.val_percent, rank=rank, world=world, seed=seed,
                                 shuffle_buffer=self.shuffle_buffer if shuffle and split != "validation" else 0)

    def label(self) -> str:
        return self.dataset_path or self.dataset or "no dataset"


SourceConfig = (
    Annotated[EmbeddedStdlib, tyro.conf.subcommand("stdlib")]
    | Annotated[JsonlFiles, tyro.conf.subcommand("jsonl")]
    | Annotated[HuggingFaceDataset, tyro.conf.subcommand("huggingface")]
    | Annotated[SftRows, tyro.conf.subcommand("sft")]
)
"""The type of ``dataloader.source``: one of the sources above, chosen by name."""
