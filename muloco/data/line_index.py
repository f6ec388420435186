"""Where each line of a JSON-lines file starts: what reading its documents in a shuffled order needs.

A corpus exported in some order (by source, date, language, length; a book chapter by chapter)
must not be trained front to back, and shuffling its lines needs random access: each line's byte
offset, 8 bytes a line (``uint64``; the top bit marks a blank line), read through a memory map, so
a file of N lines costs 8·N bytes, never its size. The index is built in one pass the first time a
file is read and cached in the user's cache folder (``MULOCO_CACHE_DIR``, else
``$XDG_CACHE_HOME/muloco``, else ``~/.cache/muloco``), under ``line-index/``, keyed by the file's
absolute path, size and modification time: a file that changes gets a new index (the stale one is
removed), and the data folder itself is never written to. A cache folder that cannot be written is
no error: the index is then kept in memory for this process.

``epoch_order`` is the per-epoch permutation of a split's documents: numpy's PCG64 seeded by a hash
of (seed, epoch), so every rank and every resume computes the same order from two integers.
"""

from __future__ import annotations

import hashlib
import io
import os
from array import array
from functools import lru_cache
from pathlib import Path

import numpy as np

from muloco.utils.atomic_file import as_umask_says, write_atomically

BLANK = np.uint64(1 << 63)
"""Set in the offset of a line that holds only whitespace (not a document)."""


def cache_folder() -> Path:
    """Where line indexes are cached (the folder may not exist yet)."""
    if os.environ.get("MULOCO_CACHE_DIR"):
        return Path(os.environ["MULOCO_CACHE_DIR"]) / "line-index"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "muloco" / "line-index"


def _cache_names(path: Path) -> tuple[str, str]:
    """(the prefix every index of this path has, this version's file name)."""
    stat = path.stat()
    prefix = hashlib.sha256(os.fsencode(path.resolve())).hexdigest()[:24]
    return prefix, f"{prefix}-{stat.st_size}-{stat.st_mtime_ns}.npy"


def _scan(path: Path) -> np.ndarray:
    """One pass over the file: each line's start, the top bit set for a blank line."""
    starts, at = array("Q"), 0
    blank = int(BLANK)
    with open(path, "rb") as handle:
        for raw in handle:
            starts.append(at | blank if raw.isspace() else at)
            at += len(raw)
    return np.frombuffer(starts, dtype=np.uint64) if starts else np.zeros(0, dtype=np.uint64)


def _store(folder: Path, prefix: str, name: str, offsets: np.ndarray) -> None:
    """Write the index atomically and remove this path's stale ones; quietly nothing if the cache
    folder cannot be written (a read-only home, a full disk)."""
    if (folder / name).is_file():  # another rank or node wrote it meanwhile: replacing a mapped file is not safe
        return
    try:
        created = not folder.is_dir()
        folder.mkdir(parents=True, exist_ok=True)
        if created:
            as_umask_says(folder, folder=True)
        header = np.lib.format.header_data_from_array_1_0(offsets)
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(buffer, header)
        write_atomically(folder / name, buffer.getvalue() + offsets.tobytes())
        for stale in folder.glob(f"{prefix}-*.npy"):
            if stale.name != name:
                stale.unlink(missing_ok=True)
    except OSError:
        pass


@lru_cache(maxsize=None)
def _offsets(resolved: str, name: str) -> np.ndarray:
    path = Path(resolved)
    folder = cache_folder()
    cached = folder / name
    if cached.is_file():
        try:
            offsets = np.load(cached, mmap_mode="r", allow_pickle=False)
            if offsets.dtype == np.uint64 and offsets.ndim == 1:
                return offsets
        except (OSError, ValueError):
            pass  # a damaged cache file: built again below
    offsets = _scan(path)
    _store(folder, name.split("-")[0], name, offsets)
    return offsets


def line_offsets(path: Path) -> np.ndarray:
    """Each line's start offset in ``path`` (``uint64``; ``BLANK`` set for a blank line), from the
    cache when the file has not changed since it was indexed."""
    _, name = _cache_names(path)
    return _offsets(str(path.resolve()), name)


def start_of(offset: np.uint64 | int) -> int:
    """A line's byte offset without its blank mark."""
    return int(offset) & ~int(BLANK)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of ``range(n)`` (``int64``) that depends only on (seed, epoch)."""
    key = hashlib.sha256(f"muloco-line-order/{seed}/{epoch}".encode()).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(key[:16], "little")))
    return rng.permutation(n)
