"""Train/validation split of the standard-library corpus.

The split is a pure function of a file's path relative to the stdlib root, so
the tokenizer build script and the data loaders agree on it without sharing
state, and it does not move when files are added elsewhere in the tree.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path, PurePath

# Directories that hold no stdlib sources of our own interpreter: third-party
# packages (site-packages) and bytecode caches.
EXCLUDED_DIRS = frozenset({"site-packages", "__pycache__"})


def is_validation(rel_path: str | os.PathLike[str], val_percent: float = 5.0) -> bool:
    """Whether the file at ``rel_path`` (relative to the stdlib root) is held out.

    Hashing the posix spelling keeps the answer identical across platforms and
    runs; 10,000 buckets give 0.01 % resolution for ``val_percent``.
    """
    key = PurePath(rel_path).as_posix().encode("utf-8")
    bucket = int(hashlib.sha256(key).hexdigest()[:8], 16) % 10_000
    return bucket < val_percent * 100


def stdlib_root() -> Path:
    """The running interpreter's standard library: the corpus every node already has."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Relative posix paths of the stdlib ``.py`` files, sorted for reproducibility."""
    base = Path(root) if root is not None else stdlib_root()
    rels = (p.relative_to(base) for p in base.rglob("*.py") if p.is_file())
    return sorted(r.as_posix() for r in rels if EXCLUDED_DIRS.isdisjoint(r.parts))
