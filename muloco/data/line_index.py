"""Where each line of a JSON-lines file starts: what reading its documents in a shuffled order needs.

A corpus exported in some order (by source, date, language, length; a book chapter by chapter)
must not be trained front to back, and shuffling its lines needs random access: each line's byte
offset, 8 bytes a line (``uint64``; the top bit marks a blank line), read through a memory map, so
a file of N lines costs 8·N bytes, never its size. The index is built in one pass the first time a
file is read and cached in the user's cache folder (``MULOCO_CACHE_DIR``, else
``$XDG_CACHE_HOME/muloco``, else ``~/.cache/muloco``), under ``line-index/``, keyed by the file's
absolute path, size and modification time: a file that changes gets a new index (the stale one is
removed), and the data folder itself is never written to. A cache folder that cannot be written is
no error: the index is then kept in memory for this process. ``cached_array`` keeps other per-line
arrays the same way (the hash split's held-out lines, ``corpus.py``).

``epoch_order`` is the per-epoch permutation of a split's documents: numpy's PCG64 seeded by a hash
of (seed, epoch), so every rank and every resume computes the same order from two integers.
"""

from __future__ import annotations

import hashlib
import io
import os
from array import array
from collections.abc import Callable
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


def _cache_names(path: Path, tag: str) -> tuple[str, str]:
    """(the pattern every version of this path's ``tag`` array matches, this version's file name)."""
    stat = path.stat()
    prefix = hashlib.sha256(os.fsencode(path.resolve())).hexdigest()[:24]
    return f"{prefix}-*-{tag}.npy", f"{prefix}-{stat.st_size}-{stat.st_mtime_ns}-{tag}.npy"


def _scan(path: Path) -> np.ndarray:
    """One pass over the file: each line's start, the top bit set for a blank line."""
    starts, at = array("Q"), 0
    blank = int(BLANK)
    with open(path, "rb") as handle:
        for raw in handle:
            starts.append(at | blank if raw.isspace() else at)
            at += len(raw)
    return np.frombuffer(starts, dtype=np.uint64) if starts else np.zeros(0, dtype=np.uint64)


def _store(folder: Path, pattern: str, name: str, values: np.ndarray) -> None:
    """Write the array atomically and remove this path's stale versions of it; quietly nothing if
    the cache folder cannot be written (a read-only home, a full disk)."""
    if (folder / name).is_file():  # another rank or node wrote it meanwhile: replacing a mapped file is not safe
        return
    try:
        created = not folder.is_dir()
        folder.mkdir(parents=True, exist_ok=True)
        if created:
            as_umask_says(folder, folder=True)
        header = np.lib.format.header_data_from_array_1_0(values)
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(buffer, header)
        write_atomically(folder / name, buffer.getvalue() + values.tobytes())
        for stale in folder.glob(pattern):
            if stale.name != name:
                stale.unlink(missing_ok=True)
    except OSError:
        pass


def cached_array(path: Path, tag: str, dtype: np.dtype, build: Callable[[], np.ndarray]) -> np.ndarray:
    """An array derived from ``path`` (``tag`` says which: its line index, a split's held-out lines),
    read (memory-mapped) from the cache while the file is unchanged, else built and stored."""
    pattern, name = _cache_names(path, tag)
    cached = cache_folder() / name
    if cached.is_file():
        try:
            values = np.load(cached, mmap_mode="r", allow_pickle=False)
            if values.dtype == dtype and values.ndim == 1:
                return values
        except (OSError, ValueError):
            pass
        cached.unlink(missing_ok=True)  # damaged: built again
    values = build()
    _store(cache_folder(), pattern, name, values)
    return values


@lru_cache(maxsize=None)
def _offsets(resolved: str, version: tuple[int, int]) -> np.ndarray:
    path = Path(resolved)
    return cached_array(path, "lines", np.dtype(np.uint64), lambda: _scan(path))


def line_offsets(path: Path) -> np.ndarray:
    """Each line's start offset in ``path`` (``uint64``; ``BLANK`` set for a blank line), from the
    cache when the file has not changed since it was indexed."""
    stat = path.stat()
    return _offsets(str(path.resolve()), (stat.st_size, stat.st_mtime_ns))


def start_of(offset: np.uint64 | int) -> int:
    """A line's byte offset without its blank mark."""
    return int(offset) & ~int(BLANK)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of ``range(n)`` (``int64``) that depends only on (seed, epoch)."""
    key = hashlib.sha256(f"muloco-line-order/{seed}/{epoch}".encode()).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(key[:16], "little")))
    return rng.permutation(n)
