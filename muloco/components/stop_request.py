"""How a run is asked to stop, and the status it then ends with: the contract between a run
(:mod:`muloco.components.preemption` reads the request) and whoever starts it (launchers and job
scripts make the request and requeue on the status). Owned by the trainer side and free of torch,
so a launcher imports it without importing the trainer."""

from __future__ import annotations

import os

STOP_FILE_ENV = "MULOCO_STOP_FILE"
"""The file whose existence asks a run to checkpoint and stop (``muloco.components.preemption``)."""
EXIT_PREEMPTED = 75
"""EX_TEMPFAIL: a run stopped on request after writing a checkpoint (``muloco.components.preemption``);
launchers pass it on and job scripts requeue on it."""


def clear_stop_request(environ=None) -> None:
    """Remove a stop request left by an earlier stop (the file and its agreed boundary), so the
    run being started resumes instead of stopping again at once."""
    path = (os.environ if environ is None else environ).get(STOP_FILE_ENV)
    for stale in (path, f"{path}.at") if path else ():
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass
