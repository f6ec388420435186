"""A hang timeout that waits on progress: a wait on a job fails when nothing its runs write has
changed for ``quiet_s`` seconds, never when its total time passes a cap (a loaded machine makes
every file change come later; a hang makes them stop). For a process whose output a test reads,
``conftest.Watched`` does the same with its lines."""

from __future__ import annotations

import time
from pathlib import Path

HANG_S = 300
"""Seconds without a new log line (or, for ``until``, without the event) that make a wait a hang."""
JOB_QUIET_S = 300
"""Seconds in which a SLURM job's run writes nothing (no log line, metrics record, checkpoint or
drill marker) before a test calls it hung: importing torch and torchtitan under load prints
nothing for a minute or more, and a requeue waits for SLURM."""


class FolderProgress:
    """Progress of the runs writing under ``paths`` (folders, walked whole, or single files):
    ``expired()`` once no file there was made, grown or rewritten for ``quiet_s`` seconds."""

    def __init__(self, quiet_s: float, *paths: Path, every_s: float = 1.0):
        self.quiet_s, self.paths, self.every_s = quiet_s, paths, every_s
        self._seen = self._snapshot()
        self._changed = self._looked = time.monotonic()

    def _snapshot(self) -> frozenset:
        files = []
        for path in self.paths:
            for p in path.rglob("*") if path.is_dir() else [path]:
                try:
                    st = p.stat()
                except (FileNotFoundError, NotADirectoryError):
                    continue
                files.append((str(p), st.st_size, st.st_mtime_ns))
        return frozenset(files)

    def expired(self) -> bool:
        now = time.monotonic()
        if now - self._looked >= self.every_s:
            self._looked = now
            seen = self._snapshot()
            if seen != self._seen:
                self._seen, self._changed = seen, now
        return now - self._changed > self.quiet_s

    def __str__(self) -> str:
        return f"nothing under {', '.join(map(str, self.paths))} changed for {self.quiet_s:g} s"


def until(
    what: str,
    happened,
    timeout: float = HANG_S,
    poll: float = 0.1,
    detail=lambda: "",
    progress: FolderProgress | None = None,
) -> None:
    """Wait for an event (``happened()`` true), polling; fail naming it (and ``detail()``) after a
    hang timeout. The one way the tests wait: for an event, never for a time. An event that
    training brings about is given the runs' ``progress``: the wait fails once they stop writing
    (for its quiet time), however long they take; ``timeout`` is for events nothing writes toward."""
    deadline = time.monotonic() + timeout
    while not happened():
        if progress is not None:
            assert not progress.expired(), f"{what} ({progress})\n{detail()}"
        else:
            assert time.monotonic() < deadline, f"{what} (waited {timeout:.0f} s)\n{detail()}"
        time.sleep(poll)
