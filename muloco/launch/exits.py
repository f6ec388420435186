"""Exit statuses of child processes, as people read them and as a parent passes them on (the
status of a run stopped on request, and the request itself, belong to the trainer side:
:mod:`muloco.components.stop_request`)."""

from __future__ import annotations

import os
import signal
import sys


def describe_exit(code: int) -> str:
    """Exit codes as people read them: 'code 3', or 'signal SIGKILL' for a killed process
    (``Popen``'s negative return code)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def shell_status(code: int) -> int:
    """Map Popen's negative 'killed by signal N' to the shell's 128+N, so it fits an exit status."""
    return 128 - code if code < 0 else code


def exit_like(returncode: int) -> None:
    """End this process as a child ended (``Popen.returncode``): with that exit code, or
    killed by that signal, so the parent of this process sees the child's real exit."""
    if returncode < 0:
        if -returncode not in (signal.SIGKILL, signal.SIGSTOP):  # those have no handler to reset
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    sys.exit(returncode if 0 <= returncode < 256 else 1)
