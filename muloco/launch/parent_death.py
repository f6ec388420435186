"""Processes that die with the process that started them (Linux's parent-death signal).

The local launcher starts torchrun agents (its lighthouse is a thread of its own); each torchrun agent starts its
ranks in sessions of their own. A SIGKILLed launcher or agent runs no cleanup, so each child
asks the kernel for a signal when its parent dies (``PR_SET_PDEATHSIG``). The setting fires
when the *thread* that forked the child exits, is cleared in the child's own children (fork)
and survives ``exec``. The parent may die between fork and the request: the child then checks
that its parent is still the one it expects, and treats a different one as a dead parent.

Elsewhere (macOS, BSD) there is no parent-death signal and these helpers do nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
from typing import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@functools.lru_cache(maxsize=1)
def _libc_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once (never between fork and exec)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def signal_on_parent_death(sig: int, parent: int) -> bool:
    """Have the kernel send ``sig`` to this process when ``parent`` dies.

    Returns False when that cannot be promised: ``parent`` is already gone (this process has
    been reparented), so the caller must act as if the signal had come. Returns True without
    doing anything where the platform has no parent-death signal.
    """
    prctl = _libc_prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    return os.getppid() == parent


def die_with_launcher() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when the launcher dies.

    Every child of the local launcher is started from the thread that runs ``LocalJob.run()``
    and stopped by it before it returns, so the signal only fires when the launcher dies.
    None where there is no parent-death signal (a SIGKILLed launcher's children are then
    stopped only by its ``GroupReaper``).
    """
    if _libc_prctl() is None:
        return None
    launcher, sigkill = os.getpid(), int(signal.SIGKILL)

    def arm() -> None:
        if not signal_on_parent_death(sigkill, launcher):
            os._exit(1)

    return arm
