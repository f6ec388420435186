"""Hear about each failed attempt of a torchrun worker group, which torch 2.13 only logs.

torchrun's agent restarts a failed worker group up to ``--max-restarts`` times and says so
only in an INFO log line, without the exit code; the exit code of the rank that failed is
in one ERROR record of ``torch.distributed.elastic.multiprocessing.api`` ("failed
(exitcode: %s) local_rank: %s (pid: %s) of binary: %s"), logged once per failed attempt when
the agent collects the group. Only at the very end does the agent raise ``ChildFailedError``
with the failures. The launcher wants every failure as it happens (to say "replica 1 exited
with code 5; restart 1/2" and mark the restart in the logs), so :func:`on_worker_failure`
attaches a filter to that logger that hands the record's arguments to a callback and drops
the record (the callback reports the same facts). Nothing in torch changes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

ELASTIC_API_LOGGER = "torch.distributed.elastic.multiprocessing.api"
_FAILED_PREFIX = "failed (exitcode: "


@dataclass(frozen=True)
class WorkerFailure:
    """The first failed rank of one attempt: its exit code (negative: killed by a signal)."""

    exitcode: int
    local_rank: int
    pid: int


class _FailureFilter(logging.Filter):
    def __init__(self, callback: Callable[[WorkerFailure], None]):
        super().__init__()
        self._callback = callback

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(_FAILED_PREFIX)):
            return True
        exitcode, local_rank, pid = record.args[:3]  # type: ignore[index]
        self._callback(WorkerFailure(int(exitcode), int(local_rank), int(pid)))
        return False


def on_worker_failure(callback: Callable[[WorkerFailure], None]) -> logging.Filter:
    """Call ``callback`` for every failed attempt of this process's torchrun worker group."""
    f = _FailureFilter(callback)
    logging.getLogger(ELASTIC_API_LOGGER).addFilter(f)
    return f
