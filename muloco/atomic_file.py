"""Write a file so that readers see the old content or the whole new one, never a part.

A temporary file in the same folder (so ``os.replace`` is a rename on one filesystem), flushed
and fsync'd, then renamed over the target; on any failure the temporary file is removed. Used
for checkpoint manifests, ``run.json``, a sweep's manifest and the lighthouse's URL file, which
other processes read while they may be rewritten.
"""

from __future__ import annotations

import os
import tempfile


def write_atomically(path: str | os.PathLike, data: str | bytes, temp_prefix: str | None = None) -> None:
    """Replace ``path`` with ``data``; ``temp_prefix`` names the temporary file (default: the
    target's name), so a reader listing the folder can recognise and skip it."""
    folder, name = os.path.split(os.fspath(path))
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix or f".{name}.tmp-", dir=folder or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
