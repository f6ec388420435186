"""Write a file so that readers see the old content or the whole new one, never a part.

A temporary file in the same folder (so ``os.replace`` is a rename on one filesystem), flushed
and fsync'd, then renamed over the target; on any failure the temporary file is removed. Used
for checkpoint manifests, ``run.json``, a sweep's manifest and the lighthouse's URL file, which
other processes read while they may be rewritten.

``tempfile`` creates its files 0600 and folders 0700 whatever the umask; a file or folder that
takes the place of a normal one gets the mode a normal one would have (0666 or 0777 less the
umask), so teammates on a shared cluster can read runs and exports as the user's umask says.
"""

from __future__ import annotations

import os
import tempfile


def umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it to read it, which
    another thread creating a file at that moment would see)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def as_umask_says(path: str | os.PathLike, *, folder: bool = False) -> None:
    """Give a temporary file or folder the mode a file or folder created normally would have."""
    os.chmod(path, (0o777 if folder else 0o666) & ~umask())


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
        as_umask_says(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
