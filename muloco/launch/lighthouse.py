"""The torchft lighthouse: the small server every replica group asks for the current quorum.

Run it once per job, before the replicas::

    python -m muloco.launch.lighthouse                      # local: loopback only
    python -m muloco.launch.lighthouse --bind "$(hostname -i):29510"   # cluster node

It prints one line, ``lighthouse listening on http://HOST:PORT (status page: http://HOST:PORT/)``,
then serves until SIGINT/SIGTERM. Replicas find it through ``TORCHFT_LIGHTHOUSE=http://HOST:PORT``.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

DEFAULT_BIND = "127.0.0.1:29510"
# IPv6 hosts must be bracketed ("[::1]:29510") so the port split is unambiguous.
_BIND_RE = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>[0-9]{1,5})$")


class LighthouseError(Exception):
    """Bad input or a bind failure, with a message meant for the user as is."""


def parse_bind(bind: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` and check it here, so a typo gets a clear message, not a Rust error."""
    m = _BIND_RE.match(bind or "")
    if not m or int(m["port"]) > 65535:
        raise LighthouseError(
            f"invalid --bind {bind!r}: expected HOST:PORT with PORT in 0..65535, e.g. "
            f"127.0.0.1:29510, \"$(hostname -i):29510\" or [::1]:29510 (port 0 picks a free port)"
        )
    return m["host"], int(m["port"])


def _check_settings(min_replicas: int, **timeouts_ms: int) -> None:
    """Reject values the server would accept but that make a job hang or never form a quorum."""
    if min_replicas < 1:
        raise LighthouseError(f"--min_replicas must be at least 1, got {min_replicas}")
    for name, value in timeouts_ms.items():
        if value < 0:
            raise LighthouseError(f"--{name} must be >= 0, got {value}")


@dataclass
class Lighthouse:
    """A running in-process lighthouse; ``url`` is what replicas put in TORCHFT_LIGHTHOUSE."""

    server: Any
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def shutdown(self) -> None:
        self.server.shutdown()


def start_lighthouse(
    bind: str = "127.0.0.1:0",
    min_replicas: int = 1,
    join_timeout_ms: int = 2000,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5000,
) -> Lighthouse:
    """Start a lighthouse in this process; raises LighthouseError with a user-facing message."""
    host, port = parse_bind(bind)
    _check_settings(min_replicas, join_timeout_ms=join_timeout_ms,
                    quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)
    # Imported late: it pulls in torch, and bad arguments should fail fast without it.
    from torchft.coordination import LighthouseServer

    try:
        server = LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except RuntimeError as e:
        if "in use" in str(e).lower():
            raise LighthouseError(
                f"port {port} on {host} is already in use (another lighthouse or job?): stop it, "
                f"or pass --bind {host}:OTHER_PORT (port 0 picks a free one)"
            ) from None
        raise LighthouseError(f"cannot start the lighthouse on {bind}: {e}") from None
    # address() reports the machine's hostname; the URL keeps the host the user bound to
    # (loopback stays loopback) with the port the OS actually gave.
    actual_port = int(server.address().rstrip("/").rsplit(":", 1)[1])
    return Lighthouse(server=server, host=host, port=actual_port)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m muloco.launch.lighthouse",
        description="Run the torchft lighthouse (quorum server) until SIGINT/SIGTERM.",
    )
    p.add_argument("--bind", default=DEFAULT_BIND,
                   help="HOST:PORT to listen on (default %(default)s, loopback only; on a cluster "
                        "use the node's routable address, e.g. \"$(hostname -i):29510\"; port 0 "
                        "picks a free port)")
    p.add_argument("--min_replicas", type=int, default=1,
                   help="replica groups needed to form a quorum (default %(default)s, so losing "
                        "one group never stalls the others)")
    p.add_argument("--join_timeout_ms", type=int, default=2000,
                   help="how long a new quorum waits for more groups to join (default %(default)s)")
    p.add_argument("--quorum_tick_ms", type=int, default=100,
                   help="how often quorum state is re-evaluated (default %(default)s)")
    p.add_argument("--heartbeat_timeout_ms", type=int, default=5000,
                   help="a group silent this long is dropped from the quorum (default %(default)s)")
    return p


def _wait_for_signal() -> None:
    """Block the main thread until SIGINT or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        lh = start_lighthouse(args.bind, args.min_replicas, args.join_timeout_ms,
                              args.quorum_tick_ms, args.heartbeat_timeout_ms)
    except LighthouseError as e:
        print(f"lighthouse: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"lighthouse listening on {lh.url} (status page: {lh.url}/)", flush=True)
    try:
        _wait_for_signal()
    finally:
        lh.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
