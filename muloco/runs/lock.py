"""One live run per dump folder: a lock file that the kernel releases when its holder dies.

    lock = DumpFolderLock("outputs/my-run").acquire()   # DumpFolderBusy if a live run holds it
    try:
        ...                                              # write into the folder
    finally:
        lock.release()

or ``with DumpFolderLock(folder) as lock: ...``.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on ``<folder>/.muloco.lock``, which holds the holder's
PID, host and start time as JSON so a refusal can say which run to stop.

What it guarantees, on a local file system:

- at most one live lock per folder, across processes and within one process (each
  ``DumpFolderLock`` opens the file anew, and flocks on separate opens conflict);
- a holder that dies in any way (exit, exception, SIGKILL, OOM killer) releases the lock at
  once: the kernel drops a flock when the last descriptor of its open file goes away. A lock
  file left behind is therefore *stale by construction* when nobody holds its flock; the next
  ``acquire()`` takes it over and reports whose it was in ``stale``;
- the descriptor is close-on-exec, so children started with ``subprocess`` (which also closes
  other descriptors by default) do not keep the lock alive after the holder dies.

What it does not guarantee:

- on network file systems flock is best effort: NFSv4 maps it onto byte-range locks (fine with
  a healthy server), older NFS clients may lock only on the local host, so runs on two hosts
  can both get it; a lock of a host that vanished is held until the server's lease expires;
- it is advisory: a program that does not take it (another tool, ``rm -rf``) is not stopped;
- a forked child that never execs keeps the holder's open file, and so the lock, alive.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime

from muloco.utils.created_dirs import make_dirs, remove_dirs
from muloco.utils.errors import BadInput

LOCK_NAME = ".muloco.lock"
_HOLDER_WRITE_WAIT_S = 0.5  # a new holder writes its JSON right after taking the flock


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or held) a lock: what the lock file says."""

    pid: int
    host: str
    started: str  # ISO 8601, local time

    @classmethod
    def parse(cls, text: str) -> LockHolder | None:
        try:
            data = json.loads(text)
            return cls(int(data["pid"]), str(data["host"]), str(data["started"]))
        except (ValueError, KeyError, TypeError):
            return None

    @classmethod
    def me(cls) -> LockHolder:
        return cls(os.getpid(), socket.gethostname(), datetime.now().astimezone().isoformat(timespec="seconds"))

    def to_json(self) -> str:
        return json.dumps({"pid": self.pid, "host": self.host, "started": self.started}) + "\n"

    def describe(self) -> str:
        return f"PID {self.pid} on {self.host} (started {self.started})"


class DumpFolderBusy(BadInput, RuntimeError):
    """The folder is locked by a live process; the message says which and what to do."""

    def __init__(self, folder: str, holder: LockHolder | None, option: str = "--dump_folder"):
        self.folder, self.holder = folder, holder
        if holder is None:  # an empty lock file: its holder is still writing, or not ours
            who, fix = "another process (its lock file does not say which)", "stop that run"
        else:
            here = holder.host == socket.gethostname()
            who = holder.describe()
            fix = f"stop that run (kill {holder.pid}{'' if here else ' on ' + holder.host})"
        super().__init__(
            f"{'dump' if option == '--dump_folder' else 'the'} folder {folder} is in use by {who}: "
            f"{fix} or pass another {option}"
        )


class DumpFolderLock:
    """The lock of one dump folder; see the module docstring for what it guarantees."""

    def __init__(self, folder: str | os.PathLike, option: str = "--dump_folder"):
        """``option``: the flag that chose the folder, named in the busy message's fix."""
        self.folder, self.option = os.fspath(folder), option
        self.path = os.path.join(self.folder, LOCK_NAME)
        self.created_dirs: list[str] = []  # folders acquire() created (so a failed launch can undo)
        self.stale: LockHolder | None = None  # the dead holder whose lock file acquire() took over
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> DumpFolderLock:
        """Take the lock, creating the folder if needed; raises DumpFolderBusy if a live process
        holds it (then nothing in the folder was changed)."""
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already held by this DumpFolderLock")
        self.created_dirs = make_dirs(self.folder)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd, wait_s=_HOLDER_WRITE_WAIT_S)
                os.close(fd)
                raise DumpFolderBusy(self.folder, holder, self.option) from None
            except BaseException:
                os.close(fd)
                raise
            if _is_current_file(fd, self.path):
                break
            os.close(fd)  # its holder unlinked it while releasing, after we opened it: retry
        self.stale = _read_holder(fd)
        _write(fd, LockHolder.me().to_json())
        self._fd = fd
        return self

    def release(self, remove_created: bool = False) -> None:
        """Drop the lock and its file; with ``remove_created``, also the folders ``acquire()``
        created, if they are empty by now (for a launch that failed before writing anything)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked, so nobody takes over a file being removed
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
        if remove_created:
            remove_dirs(self.created_dirs)

    def __enter__(self) -> DumpFolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _is_current_file(fd: int, path: str) -> bool:
    """Whether ``fd`` is still the file at ``path`` (a releasing holder unlinks it)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _read_holder(fd: int, wait_s: float = 0.0) -> LockHolder | None:
    """The holder the file names; waits up to ``wait_s`` for a new holder to write it."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = LockHolder.parse(os.pread(fd, 4096, 0).decode("utf-8", errors="replace"))
        if holder is not None or time.monotonic() >= deadline:
            return holder
        time.sleep(0.02)


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
