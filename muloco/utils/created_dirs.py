"""Create a folder's missing parents and remove exactly those again.

A run that fails in preflight, or a launcher that stops, must leave the file system as it
found it: no empty folders that it made, and nothing removed that existed before or that
another process (a peer rank, a second launcher) made meanwhile.
"""

from __future__ import annotations

import errno
import os


def missing_dirs(path: str | os.PathLike) -> list[str]:
    """``path`` and those of its ancestors that do not exist yet, deepest first."""
    missing, current = [], os.path.abspath(path)
    while not os.path.lexists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return missing


def make_dirs(path: str | os.PathLike) -> list[str]:
    """``os.makedirs`` that returns the folders it created, outermost first; on failure it
    removes those it made before raising."""
    created: list[str] = []
    try:
        for d in reversed(missing_dirs(path)):
            try:
                os.mkdir(d)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise
                continue  # made by someone else meanwhile: not ours to remove
            created.append(d)
        if not os.path.isdir(path):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), os.fspath(path))
    except OSError:
        remove_dirs(created)
        raise
    return created


def remove_dirs(created: list[str]) -> None:
    """Remove folders ``make_dirs`` created, innermost first, keeping any that are not empty."""
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            pass
