"""One replica group as one torchrun: ``python -m muloco.launch.replica_group [torchrun args]``.

This is torchrun (``torch.distributed.run``: its argument parser, rendezvous, restarts and
tee), run in a process that adds three things the local launcher needs:

- each failed attempt is reported as it happens, on stderr, as one line
  ``[muloco] rank R (pid P) exited with code X; restart n/m`` (or ``; no restart left``),
  which the launcher turns into its console message and a ``=== restart n ===`` mark in the
  group's logs (torchrun itself logs restarts at INFO, without the exit code);
- the process ends with the exit status of the rank that failed first (torchrun's own ``main``
  ends with 1 and a traceback), so a replica's exit 3 (corrupt checkpoint) or SIGKILL reaches
  the launcher as such;
- its PID is exported to the ranks' environment (``MULOCO_AGENT_PID``) for
  ``muloco.launch.rank_process``, through which the launcher has torchrun start each rank, so
  ranks die with their agent even when the agent is SIGKILLed.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from muloco.launch.exits import describe_exit, exit_like
from muloco.launch.rank_process import AGENT_PID_VAR

if TYPE_CHECKING:
    from muloco.compat.torchrun_failures import WorkerFailure

TAG = "[muloco] "
"""Start of the lines this process prints for the launcher (which imports ``TAG`` from here
without importing torch)."""


class FailureReporter:
    """Prints one tagged line per failed attempt, counting the restarts torchrun has left."""

    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.failures = 0

    def __call__(self, f: "WorkerFailure") -> None:
        self.failures += 1
        then = (
            f"restart {self.failures}/{self.max_restarts}" if self.failures <= self.max_restarts else "no restart left"
        )
        print(
            f"{TAG}rank {f.local_rank} (pid {f.pid}) exited with {describe_exit(f.exitcode)}; {then}",
            file=sys.stderr,
            flush=True,
        )


def main(argv: list[str]) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from muloco.compat.torchrun_failures import on_worker_failure  # imports torch: not at module level

    args = parse_args(argv)
    os.environ[AGENT_PID_VAR] = str(os.getpid())
    on_worker_failure(FailureReporter(args.max_restarts))
    try:
        run(args)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        exit_like(failure.exitcode)
    except SignalException as e:  # stopped by the launcher; torchrun has stopped the ranks
        exit_like(-int(e.sigval))


if __name__ == "__main__":
    main(sys.argv[1:])
