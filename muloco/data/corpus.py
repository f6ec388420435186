"""Document sources: where training text comes from, in a reproducible order.

Every source hands the loader one shard of one split as a stream of text
documents and can say, in plain Python types, how far it has read. That
position is what goes into a checkpoint, so resuming never re-reads or skips a
document and never needs pickle.

Sharding is round-robin over the epoch's document order: document ``k`` of the
split belongs to shard ``k % world``. Shards are therefore disjoint, together
cover the split, and differ by at most one document in size.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import json
import os
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from muloco.data import split as stdlib_split
from muloco.data.line_index import BLANK, cached_array, epoch_order, line_offsets
from muloco.utils.errors import BadInput

SPLITS = ("train", "validation")


class DataError(BadInput, ValueError):
    """A data configuration or data file the pipeline cannot use.

    The message names the config key (or file and line) at fault, what was
    wrong and what is allowed, so a failed job can be fixed from its log alone.
    """


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """A permutation of ``range(n)`` that depends only on (seed, epoch).

    A string seed goes through SHA-512 inside ``random``, so the order is the
    same in every process and under every PYTHONHASHSEED.
    """
    order = list(range(n))
    random.Random(f"muloco-epoch-order/{seed}/{epoch}").shuffle(order)
    return order


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise DataError(
            f"dataloader.split={split!r} is not a split of this source; "
            f"use one of {list(SPLITS)}"
        )


def check_val_percent(val_percent: float) -> None:
    if not 0.0 <= val_percent <= 100.0:
        raise DataError(
            f"dataloader.source.val_percent={val_percent} is out of range; "
            "use a percentage between 0 and 100"
        )


def check_shard(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise DataError(
            f"data shard {rank} of {world} does not exist; "
            "dp_rank must lie in [0, dp_world_size)"
        )


class ShardReader(ABC):
    """One pass (epoch) over one shard, resumable from a saved position.

    ``position`` always describes the point just after the last document that
    ``documents()`` yielded, in JSON-serializable types only (it is checkpointed).
    """

    position: dict[str, Any]

    @abstractmethod
    def documents(self) -> Iterator[str]:
        ...

    def close(self) -> None:
        """Release open files early; readers are also safe to drop unclosed."""

    @property
    def doc_index(self) -> int:
        return self.position["doc_index"]


class DocumentSource(ABC):
    """A split of a corpus, seen from one data-parallel shard."""

    rank: int
    world: int

    @abstractmethod
    def open_shard(self, epoch: int, position: dict[str, Any] | None) -> ShardReader:
        """A reader for ``epoch``, starting at ``position`` (None: the beginning)."""

    @abstractmethod
    def describe(self) -> str:
        ...

    def check_position(self, position: dict[str, Any] | None) -> None:
        """DataError if a saved ``position`` cannot resume this source (checked at the load)."""

    def first_document(self) -> str | None:
        """The first document of the split (None: the split is empty), read without
        going further, so a run can check its data before it writes anything."""
        reader = self.open_shard(0, None)
        try:
            return next(iter(reader.documents()), None)
        finally:
            reader.close()


# --------------------------------------------------------------------------
# stdlib: the interpreter's own sources, present on every node
# --------------------------------------------------------------------------


@lru_cache(maxsize=8)
def stdlib_split_paths(root: str, split: str, val_percent: float) -> tuple[str, ...]:
    """Cached because the validator rebuilds its loader at every evaluation
    and walking the stdlib tree costs a noticeable fraction of a second."""
    want_validation = split == "validation"
    return tuple(
        rel
        for rel in stdlib_split.stdlib_sources(root)
        if stdlib_split.is_validation(rel, val_percent) == want_validation
    )


class StdlibSource(DocumentSource):
    """The running interpreter's standard-library ``.py`` files, one per document.

    The file list and the train/validation assignment come from
    ``muloco.data.split``, the same functions the tokenizer build uses, so the
    tokenizer never saw the validation files either.
    """

    def __init__(
        self,
        *,
        split: str,
        val_percent: float,
        seed: int,
        shuffle: bool,
        rank: int,
        world: int,
        root: str | os.PathLike[str] | None = None,
    ) -> None:
        check_split(split)
        check_val_percent(val_percent)
        check_shard(rank, world)
        self.root = Path(root) if root is not None else stdlib_split.stdlib_root()
        self.split = split
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world = world
        self.rel_paths = list(stdlib_split_paths(str(self.root), split, val_percent))
        self._check_not_empty(val_percent)

    def _check_not_empty(self, val_percent: float) -> None:
        if len(self.rel_paths) < self.world:
            raise DataError(
                f"the stdlib corpus at {self.root} has {len(self.rel_paths)} "
                f"{self.split} files for {self.world} data shards "
                f"(dataloader.source.val_percent={val_percent}); every shard needs at "
                "least one document: adjust dataloader.source.val_percent or use "
                "another dataloader.source"
            )

    def shard_paths(self, epoch: int) -> list[str]:
        """This shard's files in the order epoch ``epoch`` reads them."""
        if self.shuffle:
            order = epoch_permutation(len(self.rel_paths), self.seed, epoch)
            ordered = [self.rel_paths[i] for i in order]
        else:
            ordered = self.rel_paths
        return ordered[self.rank :: self.world]

    def open_shard(self, epoch: int, position: dict[str, Any] | None) -> ShardReader:
        start = (position or {}).get("doc_index", 0)
        return _FileListReader(self.root, self.shard_paths(epoch), start)

    def num_documents(self) -> int:
        """Documents in this shard per epoch."""
        return len(self.rel_paths[self.rank :: self.world])

    def describe(self) -> str:
        return (
            f"stdlib {self.root} split={self.split} shard {self.rank}/{self.world}: "
            f"{self.num_documents()} of {len(self.rel_paths)} documents"
        )


class _FileListReader(ShardReader):
    def __init__(self, root: Path, rel_paths: list[str], start: int) -> None:
        self.root = root
        self.rel_paths = rel_paths
        self.position = {"doc_index": start}

    def documents(self) -> Iterator[str]:
        while self.position["doc_index"] < len(self.rel_paths):
            path = self.root / self.rel_paths[self.position["doc_index"]]
            text = path.read_text(encoding="utf-8", errors="replace")
            self.position["doc_index"] += 1
            yield text


# --------------------------------------------------------------------------
# jsonl: local files, streamed line by line
# --------------------------------------------------------------------------


def resolve_jsonl_files(spec: str | None, key: str) -> list[Path]:
    """The files a jsonl path setting names: a file, a directory of ``*.jsonl``, or a glob."""
    if not spec:
        raise DataError(
            f"{key} is not set: dataloader.source jsonl needs a JSONL file, "
            "a directory of *.jsonl files, or a glob such as 'data/*.jsonl'"
        )
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
        if not files:
            raise DataError(f"{key}={spec!r} is a directory without *.jsonl files")
        return files
    files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec)) if os.path.isfile(p))
    if not files:
        raise DataError(
            f"{key}={spec!r} does not exist and matches no file as a glob; "
            "give a JSONL file, a directory of *.jsonl files, or a glob"
        )
    return files


def jsonl_line_is_validation(file_name: str, line_number: int, val_percent: float) -> bool:
    """The held-out test for a line: its file's name and line number, nothing else.

    Keyed by base name rather than full path so moving the data directory
    does not reshuffle the split.
    """
    return stdlib_split.is_validation(f"{file_name}:{line_number}", val_percent)


class JsonlSource(DocumentSource):
    """JSON-lines files with one document per line.

    With ``shuffle`` (the default) every epoch reads the split's documents, all files' lines
    together, in a permutation seeded by (seed, epoch): each file's line offsets are indexed once
    (``line_index.py``: 8 bytes a line, cached) and each document is read by a seek, so memory is
    O(lines), never O(bytes), and a resume continues the same order from its document count.
    Without ``shuffle`` the files are streamed in their stored order. The held-out split is
    defined by (file name, line number) either way. Every shard parses only its own lines, and a
    bad line raises ``DataError`` in the shard that owns it.
    """

    def __init__(
        self,
        *,
        dataset_path: str | None,
        validation_path: str | None,
        split: str,
        text_field: str,
        val_percent: float,
        seed: int,
        shuffle: bool,
        rank: int,
        world: int,
        parse_line: Callable[[bytes, Path, int], Any] | None = None,
    ) -> None:
        check_split(split)
        check_val_percent(val_percent)
        check_shard(rank, world)
        self.split = split
        self.text_field = text_field
        self.parse_line = parse_line or (lambda raw, path, number: parse_jsonl_line(raw, path, number, text_field))
        """A line's document: its text field, or whatever ``parse_line`` makes of it (SFT examples)."""
        self.val_percent = val_percent
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world = world
        if split == "validation" and validation_path:
            self.spec = validation_path
            self.files = resolve_jsonl_files(validation_path, "dataloader.source.validation_path")
        else:
            self.spec = dataset_path
            self.files = resolve_jsonl_files(dataset_path, "dataloader.source.dataset_path")
        # With a separate validation set the training files are used whole.
        self.hash_split = not validation_path
        self._lines: _SplitLines | None = None

    def legacy_file_order(self, epoch: int) -> list[Path]:
        """The order a checkpoint written before documents were shuffled read its files in: with
        ``shuffle``, the files permuted per epoch (so such a position resumes where it was)."""
        if not self.shuffle:
            return self.files
        return [self.files[i] for i in epoch_permutation(len(self.files), self.seed, epoch)]

    def split_lines(self) -> _SplitLines:
        """Every document of this split, over all files (indexed on first use)."""
        if self._lines is None:
            side = None if not self.hash_split else self.split == "validation"
            self._lines = _SplitLines(self.files, [_documents_of(p, side, self.val_percent) for p in self.files])
        return self._lines

    def check_position(self, position: dict[str, Any] | None) -> None:
        """A saved position must come from a reader of the same order, seed and split size (one
        written before the order was recorded resumes in the order it was read in)."""
        if not position or "order" not in position:
            return
        saved = position["order"]
        if (saved == SHUFFLED) != self.shuffle:
            how = "in a shuffled order" if saved == SHUFFLED else "in the files' stored order"
            flag = "--dataloader.shuffle-documents" if saved == SHUFFLED else "--dataloader.no-shuffle-documents"
            raise DataError(f"the checkpoint's data position was read {how}, and this run reads the other order: "
                            f"resume with {flag}, or leave the loader out with "
                            "checkpoint.exclude_from_loading=['dataloader']")
        here = (self.seed, len(self.split_lines())) if saved == SHUFFLED else None
        if here is not None and (position.get("seed"), position.get("documents")) != here:
            raise DataError(f"the checkpoint's data position is for a shuffled order of {position.get('documents')} "
                            f"documents with dataloader.seed {position.get('seed')}, and this run has {here[1]} "
                            f"with seed {here[0]}: resume with the same seed and data, or leave the loader out "
                            "with checkpoint.exclude_from_loading=['dataloader']")

    def keeps_line(self, file_name: str, line_number: int) -> bool:
        if not self.hash_split:
            return True
        held_out = jsonl_line_is_validation(file_name, line_number, self.val_percent)
        return held_out == (self.split == "validation")

    def open_shard(self, epoch: int, position: dict[str, Any] | None) -> ShardReader:
        self.check_position(position)
        if position and "order" not in position:  # written before the order was recorded
            return _JsonlReader(self, self.legacy_file_order(epoch), position, order=None)
        if self.shuffle:
            return _ShuffledJsonlReader(self, epoch, position)
        return _JsonlReader(self, self.files, position)  # the files in their stored order

    def first_document(self) -> str | None:
        """Like the reader, but every line up to the first document of this split is
        parsed, the other split's lines included: a bad line at the top of a file is
        reported before the run starts, whichever split it belongs to."""
        for path in self.files:
            with open(path, "rb") as handle:
                for number, raw in enumerate(handle, start=1):
                    if not raw.strip():
                        continue
                    text = self.parse_line(raw, path, number)
                    if self.keeps_line(path.name, number):
                        return text
        return None

    def describe(self) -> str:
        how = "hash split" if self.hash_split else "whole files"
        if self.shuffle:
            total = len(self.split_lines())
            count = (f"{len(range(self.rank, total, self.world))} of {total} documents, "
                     f"in a new order each epoch (seed {self.seed})")
        else:
            count = "documents counted while streaming, in the files' stored order"
        return f"jsonl {self.spec} ({len(self.files)} files, {how}) split={self.split} shard {self.rank}/{self.world}: {count}"


SHUFFLED, STORED = "shuffled", "stored"
"""The ``order`` a JSONL reader records in its position."""
OPEN_FILES = 32
"""Files a shuffled reader keeps open at once (a corpus of thousands must not exhaust ``ulimit -n``)."""


@lru_cache(maxsize=None)
def _held_out_lines(resolved: str, name: str, identity: tuple[int, int],
                    val_percent: float) -> tuple[np.ndarray, np.ndarray]:
    """(1-based line numbers of the non-blank lines, whether each is held out), per file version:
    both sides of the hash split from one pass, tested by the file's name as given (as the
    stored-order reader tests it), never by a symlink target's."""
    path = Path(resolved)
    offsets = line_offsets(path)
    numbers = np.flatnonzero((offsets & BLANK) == 0) + 1

    if val_percent <= 0:  # no hash split: nothing held out, nothing to hash
        return numbers, np.zeros(len(numbers), dtype=bool)

    def held_out() -> np.ndarray:  # a hash per line: cached beside the index (about 2.6 s a million lines)
        return np.fromiter((jsonl_line_is_validation(name, int(n), val_percent) for n in numbers), dtype=bool,
                           count=len(numbers))

    tag = "held-" + hashlib.sha256(f"{name}/{val_percent!r}".encode()).hexdigest()[:12]
    return numbers, cached_array(path, tag, np.dtype(bool), held_out)


def _documents_of(path: Path, side: bool | None, val_percent: float) -> tuple[np.ndarray, np.ndarray]:
    """(line numbers, byte offsets) of ``path``'s documents on one side of the hash split (``side``
    True: the held-out ones, None: every non-blank line), cached while the file is unchanged."""
    stat = path.stat()
    numbers, held = _held_out_lines(str(path.resolve()), path.name, (stat.st_size, stat.st_mtime_ns),
                                    val_percent if side is not None else 0.0)
    if side is not None:
        numbers = numbers[held == side]
    starts = (line_offsets(path)[numbers - 1] & ~BLANK).astype(np.int64)
    return numbers, starts


class _SplitLines:
    """A split's documents as (file, line number, byte offset), numbered 0..n-1 file by file."""

    def __init__(self, files: list[Path], documents: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.files = files
        empty = np.zeros(0, dtype=np.int64)
        self.numbers = np.concatenate([n for n, _ in documents]) if documents else empty
        self.offsets = np.concatenate([o for _, o in documents]) if documents else empty
        self.starts = np.cumsum([0] + [len(n) for n, _ in documents])

    def __len__(self) -> int:
        return len(self.numbers)

    def locate(self, doc: int) -> tuple[int, int, int]:
        """(file index, line number, byte offset) of document ``doc``."""
        f = int(np.searchsorted(self.starts, doc, side="right")) - 1
        return f, int(self.numbers[doc]), int(self.offsets[doc])


class _ShuffledJsonlReader(ShardReader):
    """The shard's documents of one epoch's permutation, each read by a seek; the position is the
    number read (the order follows from the seed, the epoch and the split's size, recorded to
    check a resume against)."""

    def __init__(self, source: JsonlSource, epoch: int, position: dict | None) -> None:
        self.source = source
        self.lines = source.split_lines()
        self.order = epoch_order(len(self.lines), source.seed, epoch)[source.rank::source.world]
        self.position = {"doc_index": int((position or {}).get("doc_index", 0)), "order": SHUFFLED,
                         "seed": source.seed, "documents": len(self.lines)}
        self._handles: collections.OrderedDict[int, Any] = collections.OrderedDict()

    def _handle(self, f: int):
        """File ``f`` open for reading; the least recently read one closed beyond ``OPEN_FILES``."""
        handle = self._handles.pop(f, None)
        if handle is None:
            handle = open(self.lines.files[f], "rb")
            if len(self._handles) >= OPEN_FILES:
                self._handles.popitem(last=False)[1].close()
        self._handles[f] = handle
        return handle

    def documents(self) -> Iterator[str]:
        pos = self.position
        while pos["doc_index"] < len(self.order):
            f, number, offset = self.lines.locate(int(self.order[pos["doc_index"]]))
            handle = self._handle(f)
            handle.seek(offset)
            text = self.source.parse_line(handle.readline(), self.lines.files[f], number)
            pos["doc_index"] += 1
            yield text

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


class _JsonlReader(ShardReader):
    """Streams lines and remembers the byte offset, so resuming is a seek, not a re-read."""

    def __init__(self, source: JsonlSource, files: list[Path], position: dict | None,
                 order: str | None = STORED) -> None:
        self.source = source
        self.files = files
        self.position = {
            "doc_index": 0,  # documents of this shard yielded this epoch
            "stream_index": 0,  # documents of the split seen this epoch, all shards
            "file_index": 0,
            "byte_offset": 0,
            "line_number": 0,  # lines of the current file consumed
        }
        if position:
            self.position.update({k: position[k] for k in self.position})
        if order is not None:  # None: a position from before the order was recorded resumes as it was read
            self.position["order"] = order
        self._handle = None

    def documents(self) -> Iterator[str]:
        pos = self.position
        while pos["file_index"] < len(self.files):
            yield from self._file_documents(self.files[pos["file_index"]])
            pos.update(file_index=pos["file_index"] + 1, byte_offset=0, line_number=0)

    def _file_documents(self, path: Path) -> Iterator[str]:
        pos = self.position
        src = self.source
        with open(path, "rb") as handle:
            self._handle = handle
            handle.seek(pos["byte_offset"])
            for raw in handle:
                pos["byte_offset"] += len(raw)
                pos["line_number"] += 1
                if not raw.strip() or not src.keeps_line(path.name, pos["line_number"]):
                    continue
                mine = pos["stream_index"] % src.world == src.rank
                pos["stream_index"] += 1
                if mine:
                    text = src.parse_line(raw, path, pos["line_number"])
                    pos["doc_index"] += 1
                    yield text
        self._handle = None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()


def decode_jsonl_line(raw: bytes, where: str) -> str:
    """One line of a JSONL file as text: JSONL is UTF-8, and a file in another encoding (Latin-1,
    UTF-16) gets one message naming the encoding problem and the fix, not a JSON parse error."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        utf16 = raw.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in raw
        kind = "UTF-16 text (NUL bytes or a byte-order mark)" if utf16 else \
            f"not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line)"
        source = "utf-16" if utf16 else "latin1"
        raise DataError(f"{where}: {kind}; JSONL files must be UTF-8: convert the file, e.g. "
                        f"`iconv -f {source} -t utf-8 FILE > FILE.utf8`") from None


def parse_jsonl_line(raw: bytes, path: Path, line_number: int, text_field: str) -> str:
    """The text of one JSONL line, or a DataError that points at the line."""
    where = f"{path}:{line_number}"
    line = decode_jsonl_line(raw, where)
    try:
        record = json.loads(line)
    except ValueError as err:  # JSONDecodeError
        raise DataError(
            f"{where}: not a JSON object ({err}); every non-blank line must be one "
            f"object with a string field {text_field!r}: fix or remove the line"
        ) from None
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{where}: no string field {text_field!r} (found {found}); set "
            "dataloader.source.text_field to the field holding the text, or fix the line"
        )
    return text


# --------------------------------------------------------------------------
# huggingface: hub datasets (FineWeb-Edu, DCLM) or local dataset directories
# --------------------------------------------------------------------------


def text_is_validation(text: str, val_percent: float) -> bool:
    """Held-out test for datasets without a validation split: a hash of the text.

    The example index would be the obvious key, but under
    ``split_dataset_by_node`` each node counts only its own examples, so the
    index (and with it the split) would change with the world size. The text
    is the same everywhere; exact duplicates also land on the same side.
    """
    digest = hashlib.sha256(text.encode("utf-8", errors="replace")).hexdigest()
    return stdlib_split.is_validation(f"text/{digest}", val_percent)


def _missing_split(err: ValueError) -> bool:
    return "split" in str(err).lower()


class HuggingFaceSource(DocumentSource):
    """A ``datasets`` dataset read in streaming mode, sharded by ``split_dataset_by_node``.

    ``split="validation"`` reads ``validation_split``; a dataset without that
    split is divided by a hash of each example's text (see
    ``text_is_validation``), and ``split="train"`` then drops the held-out
    examples so the two never overlap. Any other split name is read whole.

    With ``shuffle_buffer`` > 0 each shard's examples pass through a seeded shuffle buffer: the
    next document is drawn at random from the last ``shuffle_buffer`` read (a window shuffle, the
    draws seeded by (seed, epoch, rank)). ``datasets``' own buffer is refilled on resume, losing
    what it held; this one rides in the checkpoint (its documents and the generator's state), so
    a resume continues exactly. 0 reads the dataset's order. The window mixes only nearby
    examples: a dataset sorted end to end needs shuffling before training (FineWeb-Edu and DCLM
    are shuffled at the file level).
    """

    def __init__(
        self,
        *,
        name_or_path: str | None,
        subset: str | None,
        split: str,
        validation_split: str,
        text_field: str,
        val_percent: float,
        rank: int,
        world: int,
        seed: int = 0,
        shuffle_buffer: int = 0,
    ) -> None:
        if not name_or_path:
            raise DataError(
                "dataloader.source.dataset_path and dataloader.source.dataset are both unset: "
                "dataloader.source huggingface needs a hub name (e.g. "
                "'HuggingFaceFW/fineweb-edu') or a local dataset directory"
            )
        check_val_percent(val_percent)
        check_shard(rank, world)
        self.name_or_path = name_or_path
        self.subset = subset
        self.split = split
        self.text_field = text_field
        self.val_percent = val_percent
        self.rank = rank
        self.world = world
        self.seed = seed
        self.shuffle_buffer = int(shuffle_buffer)
        self.dataset, self.keep = self._resolve(split, validation_split)

    def _load(self, split_name: str):
        import datasets

        try:
            return datasets.load_dataset(
                self.name_or_path, name=self.subset or None, split=split_name, streaming=True
            )
        except FileNotFoundError as err:
            raise DataError(
                f"dataloader.source.dataset_path / dataloader.source.dataset={self.name_or_path!r} "
                f"(subset {self.subset!r}) could not be opened: {err}; give a hub "
                "dataset name or a local dataset directory"
            ) from None

    def _load_if_present(self, split_name: str):
        try:
            return self._load(split_name)
        except ValueError as err:
            if isinstance(err, DataError) or not _missing_split(err):
                raise
            return None

    def _resolve(self, split: str, validation_split: str):
        """The dataset to stream and which hash side of it to keep (None: all)."""
        if split not in SPLITS:
            self.read_split = split
            return self._load_or_explain(split), None
        held_out = self._load_if_present(validation_split)
        if split == "validation" and held_out is not None:
            self.read_split = validation_split
            return held_out, None
        self.read_split = "train"
        keep = None if held_out is not None else split == "validation"
        return self._load_or_explain("train"), keep

    def _load_or_explain(self, split_name: str):
        try:
            return self._load(split_name)
        except ValueError as err:
            if isinstance(err, DataError):
                raise
            raise DataError(
                f"dataloader.split={split_name!r}: {err}; set dataloader.split to "
                "'train', 'validation' or a split the dataset has"
            ) from None

    def keeps(self, text: str) -> bool:
        if self.keep is None:
            return True
        return text_is_validation(text, self.val_percent) == self.keep

    def open_shard(self, epoch: int, position: dict[str, Any] | None) -> ShardReader:
        from datasets.distributed import split_dataset_by_node

        # A fresh shard object per epoch: a loaded state would otherwise stick.
        shard = split_dataset_by_node(self.dataset, rank=self.rank, world_size=self.world)
        shard.set_epoch(epoch)
        self.check_position(position)
        return _HuggingFaceReader(self, shard, position, epoch)

    def check_position(self, position: dict[str, Any] | None) -> None:
        """A saved position must come from a reader with the same buffer (or none)."""
        if not position:
            return
        saved = position.get("buffer_size", len(position["buffer"])) if "buffer" in position else 0
        if saved != self.shuffle_buffer:
            how = "in the dataset's order" if not saved else f"through a shuffle buffer of {saved} documents"
            raise DataError(f"the checkpoint's data position was read {how}, and this run reads with "
                            f"dataloader.source.shuffle_buffer {self.shuffle_buffer}: resume with the buffer it was "
                            "read with, or leave the loader out with checkpoint.exclude_from_loading=['dataloader']")

    def num_documents(self) -> int | None:
        """Examples in the whole split when the dataset card says so."""
        splits = getattr(self.dataset.info, "splits", None) or {}
        info = splits.get(self.read_split) if hasattr(splits, "get") else None
        return getattr(info, "num_examples", None)

    def describe(self) -> str:
        total = self.num_documents()
        count = f"{total} documents in split" if total else "document count unknown (streaming)"
        side = {None: "", True: ", hash-held-out part", False: ", hash-train part"}[self.keep]
        subset = f" subset={self.subset}" if self.subset else ""
        order = (f", shuffled through a buffer of {self.shuffle_buffer} (seed {self.seed})" if self.shuffle_buffer
                 else ", in the dataset's order")
        return (
            f"huggingface {self.name_or_path}{subset} split={self.read_split}{side} "
            f"shard {self.rank}/{self.world}: {count}{order}"
        )


class _HuggingFaceReader(ShardReader):
    """The shard's examples, through the source's shuffle buffer when it has one; the position
    holds the stream's state and, with a buffer, the buffer and the draws' generator."""

    def __init__(self, source: HuggingFaceSource, shard, position: dict | None, epoch: int = 0) -> None:
        self.source = source
        self.shard = shard
        self._doc_index = 0
        self._buffer: list[str] | None = [] if source.shuffle_buffer else None
        key = hashlib.sha256(f"muloco-hf-buffer/{source.seed}/{epoch}/{source.rank}".encode()).digest()
        self._rng = np.random.Generator(np.random.PCG64(int.from_bytes(key[:16], "little")))
        if position:
            self._doc_index = position["doc_index"]
            self.shard.load_state_dict(position["hf_state"])
            if self._buffer is not None:
                self._buffer = list(position["buffer"])
                self._rng.bit_generator.state = position["rng"]

    @property
    def position(self) -> dict[str, Any]:
        out = {"doc_index": self._doc_index, "hf_state": self.shard.state_dict()}
        if self._buffer is not None:
            out.update(buffer=list(self._buffer), buffer_size=self.source.shuffle_buffer,
                       rng=self._rng.bit_generator.state)
        return out

    def _texts(self) -> Iterator[str]:
        """The shard's documents of this split, in the dataset's order."""
        field = self.source.text_field
        for number, example in enumerate(self.shard):
            text = example.get(field)
            if not isinstance(text, str):
                raise DataError(
                    f"{self.source.name_or_path} example {number} of shard "
                    f"{self.source.rank}: no string field {field!r} (columns: "
                    f"{sorted(example)}); set dataloader.source.text_field"
                )
            if self.source.keeps(text):
                yield text

    def documents(self) -> Iterator[str]:
        buffer = self._buffer
        for text in self._texts():
            if buffer is None:
                self._doc_index += 1
                yield text
            elif len(buffer) < self.source.shuffle_buffer:
                buffer.append(text)
            else:  # the next document: a random one of the buffer, whose place the new one takes
                i = int(self._rng.integers(len(buffer)))
                out, buffer[i] = buffer[i], text
                self._doc_index += 1
                yield out
        while buffer:  # the stream ended: the rest of the buffer in random order
            i = int(self._rng.integers(len(buffer)))
            out, buffer[i] = buffer[i], buffer[-1]
            buffer.pop()
            self._doc_index += 1
            yield out
