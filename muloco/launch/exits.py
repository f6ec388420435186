"""Exit statuses of child processes, as people read them and as a parent passes them on."""

from __future__ import annotations

import os
import signal
import sys

STOP_FILE_ENV = "MULOCO_STOP_FILE"
"""The file whose existence asks a run to checkpoint and stop (``muloco.preemption``)."""
EXIT_PREEMPTED = 75
"""EX_TEMPFAIL: a run stopped on request after writing a checkpoint (``muloco.preemption``);
launchers pass it on and job scripts requeue on it."""


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


def clear_stop_request(environ=None) -> None:
    """Remove a stop request left by an earlier stop (the file and its agreed boundary), so the
    run being started resumes instead of stopping again at once."""
    path = (os.environ if environ is None else environ).get(STOP_FILE_ENV)
    for stale in (path, f"{path}.at") if path else ():
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass
