"""One rank of a replica group, as torchrun starts it: ``python -m muloco.launch.rank_process CMD...``.

torchrun starts each rank in a session of its own and stops it by signalling that session's
process group, but it cannot stop anything once it is SIGKILLed itself (as the launcher's
teardown does after its grace period, or the kernel when the launcher dies): the ranks and
their children (data loader workers, compile workers) would live on. This small process,
with no torch import, is what torchrun starts: it runs ``CMD`` in its own process group and,
when the agent that started it dies, SIGKILLs that whole group, itself included. Signals the
agent sends to the group reach ``CMD`` directly; this process only waits, and ends with the
status ``CMD`` ended with (the same signal, if it was killed by one), so torchrun sees the
rank's real exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from muloco.launch.exits import exit_like
from muloco.launch.parent_death import signal_on_parent_death

AGENT_PID_VAR = "MULOCO_AGENT_PID"
"""Set by ``muloco.launch.replica_group`` (the torchrun agent) to its PID."""
_AGENT_GONE = signal.SIGUSR1


def _kill_own_group(*_args) -> None:
    os.killpg(0, signal.SIGKILL)


USAGE = (
    "usage: python -m muloco.launch.rank_process CMD [ARG ...]\n"
    "Runs CMD as one rank of a replica group: it dies with its torchrun agent.\n"
    "  -h, --help  show this message and exit"
)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(USAGE)
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0)
    signal.signal(_AGENT_GONE, _kill_own_group)
    agent = os.environ.get(AGENT_PID_VAR)
    if agent is not None and not signal_on_parent_death(_AGENT_GONE, int(agent)):
        _kill_own_group()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)  # meant for CMD (same group); reset in it on exec
    try:
        proc = subprocess.Popen(argv)
    except OSError as e:
        sys.exit(f"rank process: cannot start {argv[0]}: {e.strerror or e}")
    exit_like(proc.wait())


if __name__ == "__main__":
    main(sys.argv[1:])
