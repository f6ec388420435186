"""Run a command's real ``main`` in the test's own process, as its ``python -m`` would.

A test process has torch and torchtitan imported already, so a command that stops before it
builds anything (a refused input, a dry run, a pre-flight check) costs a fraction of a second
here against 5-7 s of CPU as a fresh process, most of it importing. What the process would
have printed to its stdout and stderr is read at the file descriptors (``capfd``), its exit
status from ``SystemExit`` or ``main``'s return value.

The command must leave the test process as it found it: the environment (a plain
``muloco.train`` writes ``RANK``/``MASTER_PORT``), the working directory, ``sys.argv``, the
root logger (torchtitan's ``init_logger`` replaces its handlers) and the signal handlers are put
back; a process group or a non-daemon thread left behind fails the test, since a real process
would have taken them with it and this one cannot.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

from conftest import REPO, run_watched

DISTRIBUTED_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHFT_LIGHTHOUSE",
)
"""What a test worker may carry that a fresh ``python -m`` on a login shell would not."""
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD)


RECORDER = """#!/bin/sh
for a in "$@"; do printf '%s\\0' "$a"; done > "$SMOKE_RECORD"
"""
"""Stands in for the Python a job script runs (``MULOCO_PYTHON``): records its command line, NUL-separated."""


def recorded_python(
    cmd: list[str], env: dict[str, str], folder: Path, cwd: Path = REPO
) -> tuple[subprocess.CompletedProcess, list[str] | None]:
    """Run the job script ``cmd`` (in ``cwd``) with ``RECORDER`` as its Python: what the script
    did, and the command line it gave Python (None when it never ran it)."""
    recorder, record = folder / "record-python", folder / "record"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    proc = run_watched(cmd, cwd=cwd, env={**env, "MULOCO_PYTHON": str(recorder), "SMOKE_RECORD": str(record)})
    return proc, (record.read_text().split("\0")[:-1] if record.is_file() else None)


def _exit_status(code: object) -> int:
    """``sys.exit(code)``'s status: None is 0, an int itself, anything else is printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_in_process(
    main: Callable[[], int | None],
    capfd,
    *,
    argv0: str = "muloco",
    args: list[str] = (),
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
) -> subprocess.CompletedProcess:
    """``main()`` with ``sys.argv = [argv0, *args]``, ``env`` over the distributed-free
    environment and ``cwd``; what it printed and its exit status, as ``subprocess.run`` gives them.

    Warnings raised while it ran are printed to its stderr, filtered as a fresh process filters
    them (pytest would otherwise collect them out of sight)."""
    saved_env, saved_argv, saved_cwd = dict(os.environ), sys.argv, os.getcwd()
    root = logging.getLogger()
    saved_logging = (list(root.handlers), root.level)
    saved_signals = {sig: signal.getsignal(sig) for sig in SIGNALS}
    threads_before = set(threading.enumerate())
    capfd.readouterr()  # what the test printed before is not the command's
    for key in DISTRIBUTED_ENV:
        os.environ.pop(key, None)
    os.environ.update(env or {})
    sys.argv = [argv0, *args]
    if cwd is not None:
        os.chdir(cwd)
    try:
        with warnings.catch_warnings(record=True) as caught:
            _python_default_filters()
            try:
                code = _exit_status(main())
            except SystemExit as done:
                code = _exit_status(done.code)
        for w in caught:
            print(warnings.formatwarning(w.message, w.category, w.filename, w.lineno), end="", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        root.handlers[:] = saved_logging[0]
        root.setLevel(saved_logging[1])
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
    out, err = capfd.readouterr()
    _assert_nothing_left(threads_before)
    return subprocess.CompletedProcess([argv0, *args], code, out, err)


def _python_default_filters() -> None:
    """The filters of a ``python`` started without ``-W``: these four categories are not shown."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category)


def _assert_nothing_left(threads_before: set[threading.Thread]) -> None:
    if "torch.distributed" in sys.modules:
        import torch.distributed

        assert not torch.distributed.is_initialized(), "the command left a process group behind"
    left = [t.name for t in threading.enumerate() if t not in threads_before and t.is_alive() and not t.daemon]
    assert not left, f"the command left threads running: {left}"
