"""The launcher's children: started in sessions of their own, output pumped line by line,
stopped with their process groups, and never outliving the launcher (see ``GroupReaper``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import IO, Any, Callable

from muloco.launch.parent_death import die_with_launcher


class GroupReaper:
    """A watchdog process that SIGKILLs the children's process groups if the launcher dies.

    The parent-death signal reaches only the launcher's direct children (the
    torchrun agents); their own children that stay in their process group (compile workers,
    helpers) are reparented when they die that way. The ranks torchrun starts in sessions of
    their own die with their agent (``muloco.launch.rank_process``). This watchdog, a tiny
    process in a session
    of its own (so Ctrl-C or a hangup of the launcher's terminal does not reach it), is told
    each group the launcher starts and reaps, over a pipe only the launcher holds. When that
    pipe reaches end-of-file without a goodbye, which the kernel makes happen when the
    launcher dies in any way, it SIGKILLs every group still listed, then exits. A process that
    leaves its group (``setsid``) escapes it; only a cgroup would catch those.
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from muloco.launch.children import reap_groups_on_eof; reap_groups_on_eof()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            text=True,
        )
        self.pid = self.proc.pid
        self._lock = threading.Lock()

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with self._lock:
            try:
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
            except (OSError, ValueError):
                pass  # the watchdog was killed: direct children still die with the launcher

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def note_log(self, path: str) -> None:
        """A log of the run: if the launcher dies, the watchdog's last line goes there too, so the
        run's logs say why they stop."""
        if "\n" not in path:
            self._send(f"!{os.path.abspath(path)}")

    def forget(self, pgid: int) -> None:
        """Called once a group is reaped, so a reused process-group id is never killed."""
        self._send(f"-{pgid}")

    def close(self) -> None:
        """Everything is stopped: say goodbye, so the watchdog exits without killing."""
        self._send("bye")
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def reap_groups_on_eof(stream: IO[str] | None = None) -> None:
    """The ``GroupReaper`` process: read ``+PGID``, ``-PGID``, ``!LOG`` and ``bye`` lines; at end
    of input without ``bye`` (the launcher died), SIGKILL every group still listed and say so, as
    the last line of every log it was told of."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    launcher = os.getppid()
    groups: set[int] = set()
    logs: list[str] = []
    for line in stream or sys.stdin:
        line = line.strip()
        if line == "bye":
            return
        if line[:1] == "+":
            groups.add(int(line[1:]))
        elif line[:1] == "-":
            groups.discard(int(line[1:]))
        elif line[:1] == "!":
            logs.append(line[1:])
    said = (
        f"=== {datetime.now().isoformat(timespec='seconds')} the launcher (pid {launcher}) died without "
        f"stopping the run (SIGKILL, out of memory, or a crash: see the system log, e.g. dmesg); its watchdog "
        f"kills the {len(groups)} process group(s) still running. Rerun the same command to resume from the "
        "checkpoints. ===\n"
    )
    for path in logs:  # first, so the line is there once the processes are gone
        try:
            with open(path, "a") as f:
                f.write(said)
        except OSError:
            pass
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


class Console:
    """Serialises lines from many pump threads so prefixed lines never interleave mid-line."""

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream
        self.lock = threading.Lock()

    def line(self, text: str) -> None:
        stream = self.stream or sys.stdout
        with self.lock:
            try:
                stream.write(text + "\n")
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # a closed console must not kill the launcher (logs still get everything)


class ManagedProcess:
    """One child in its own session, each line of its output handed to a ``sink``.

    Its own session means Ctrl-C at the terminal reaches only the launcher, which then stops
    each child *with its children* via its process group. It dies with the launcher
    (``die_with_launcher``), its group too when a ``reaper`` is given, and inherits no
    descriptor of the launcher's (the dump folder lock among them).
    """

    def __init__(
        self, cmd: list[str], env: dict[str, str], sink: Any, reaper: GroupReaper | None = None, name: str = "child"
    ):
        self.cmd, self.sink, self._reaper = cmd, sink, reaper
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            preexec_fn=die_with_launcher(),
        )
        self.pid = self.proc.pid
        if reaper:
            reaper.watch(self.pid)
        self._returncode: int | None = None
        self._pump = threading.Thread(target=self._pump_lines, daemon=True, name=f"pump-{name}-{self.pid}")
        self._pump.start()

    def _pump_lines(self) -> None:
        assert self.proc.stdout is not None
        try:
            for raw in iter(self.proc.stdout.readline, b""):
                self.sink.write(raw)
        finally:
            self.sink.close()
            self.proc.stdout.close()

    def poll(self) -> int | None:
        """Exit code once exited; the first time, also reap leftovers in its process group."""
        if self._returncode is None:
            rc = self.proc.poll()
            if rc is not None:
                self._returncode = rc
                self.signal_group(signal.SIGKILL)  # orphans would hold the log pipe open
                if self._reaper:
                    self._reaper.forget(self.pid)
        return self._returncode

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def join_pump(self, timeout: float = 5.0) -> None:
        self._pump.join(timeout)


def stop_processes(
    procs: list[ManagedProcess], grace_s: float = 10.0, hurry: Callable[[], bool] = lambda: False
) -> None:
    """SIGTERM every live group, wait up to ``grace_s`` (or until ``hurry()``), then SIGKILL."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
        live = [p for p in live if p.poll() is None]
    for p in live:
        p.signal_group(signal.SIGKILL)
    for p in live:
        p.proc.wait()
        p.poll()
    for p in procs:
        p.join_pump()
