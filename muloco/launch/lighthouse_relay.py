"""A loopback relay to a lighthouse that may move, so a replica group outlives its lighthouse.

torchft's manager is given the lighthouse's address once (``TORCHFT_LIGHTHOUSE``) and keeps it:
when a heartbeat or quorum call fails, it reconnects to the same address (``quorum_retries``
times for a quorum). On SLURM the lighthouse is a job of its own, and a requeued lighthouse
comes back on another node or port and writes its new URL to the same file. So each group
points its manager at this relay, on 127.0.0.1, and the relay connects every new connection to
the URL the file holds *then*: after a lighthouse moves, the manager's next reconnect reaches
the new lighthouse, and the group keeps its state (no restart, no lost steps). A connection
that arrives while no lighthouse answers is held until one does (up to ``wait_s``), so a
reconnect during the move waits instead of failing.

The relay copies bytes (gRPC and the status page share the lighthouse's port); it never reads
them. It binds loopback only: it is this node's way to the lighthouse, not a service.

    python -m muloco.launch.lighthouse_relay --url-file RUN/slurm/lighthouse-A.url [--wait-s 600]

prints ``relay http://127.0.0.1:PORT`` once it listens and serves until it is killed
(``muloco.launch.slurm.group`` starts it to die with the group; SIGTERM and SIGINT are
ignored, so a group that is stopping keeps its way to the lighthouse until its ranks are done).
"""

from __future__ import annotations

import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from muloco.utils.command_line import UsageError, failed, parse
from muloco.utils.errors import BAD_INPUT

CONNECT_TIMEOUT_S = 5.0
POLL_S = 0.5
CHUNK = 65536


def read_target(url_file: str) -> tuple[str, int] | None:
    """(host, port) of the URL in ``url_file``; None while the file is missing or empty."""
    try:
        with open(url_file) as f:
            url = f.read().strip()
    except FileNotFoundError:
        return None
    if not url:
        return None
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise ValueError(f"{url_file} holds {url!r}, not a lighthouse URL (http://HOST:PORT)")
    return parts.hostname, parts.port


class LighthouseRelay:
    """Accepts on 127.0.0.1 (a free port: ``url``) and joins each connection to the lighthouse
    whose URL ``url_file`` holds when the connection arrives."""

    def __init__(self, url_file: str, wait_s: float = 120.0):
        self.url_file = url_file
        self.wait_s = wait_s
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._joined: list[tuple[tuple[str, int], socket.socket, socket.socket]] = []
        self._bad_file = False
        self.targets: list[tuple[str, int]] = []
        """Each lighthouse address connected to, in order (a move shows as a new entry)."""
        threading.Thread(target=self._accept, name="lighthouse-relay", daemon=True).start()
        threading.Thread(target=self._follow, name="lighthouse-relay-follow", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        self._server.close()

    def _target(self) -> tuple[str, int] | None:
        try:
            return read_target(self.url_file)
        except ValueError as e:  # said once: a hand-edited file; the lighthouse writes it atomically
            if not self._bad_file:
                print(f"relay: {e}; waiting for a lighthouse URL", file=sys.stderr, flush=True)
            self._bad_file = True
            return None

    def _follow(self) -> None:
        """Close the joined connections whose lighthouse the file no longer names: the manager
        reconnects (to the new one) even when the old node died without closing them."""
        while not self._closed.wait(POLL_S):
            target = self._target()
            if target is None:
                continue
            with self._lock:
                stale = [j for j in self._joined if j[0] != target]
                self._joined = [j for j in self._joined if j[0] == target]
            for _, client, upstream in stale:
                _shut(client)
                _shut(upstream)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        joined = self._connect(client)
        if joined is None:
            client.close()  # no lighthouse for wait_s, or the caller left: its own retry says so
            return
        target, upstream = joined
        with self._lock:
            self._joined.append((target, client, upstream))
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def _connect(self, client: socket.socket) -> tuple[tuple[str, int], socket.socket] | None:
        """A connection to the lighthouse the URL file names, retried (re-reading the file)
        until one answers, ``wait_s`` passes or the client hangs up (its request would be stale)."""
        deadline = time.monotonic() + self.wait_s
        while not self._closed.is_set() and not _hung_up(client):
            target = self._target()
            if target is not None:
                try:
                    sock = socket.create_connection(target, timeout=CONNECT_TIMEOUT_S)
                    sock.settimeout(None)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # a dead node shows up
                    if not self.targets or self.targets[-1] != target:
                        self.targets.append(target)
                    return target, sock
                except OSError:
                    pass
            if time.monotonic() > deadline:
                return None
            time.sleep(POLL_S)
        return None


def _hung_up(client: socket.socket) -> bool:
    """The client closed its side (a peek at its data reads end of file)."""
    try:
        readable, _, _ = select.select([client], [], [], 0)
        return bool(readable) and client.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until either side ends; then end both (a dead lighthouse ends
    the manager's connection, which then reconnects through the relay)."""
    try:
        while data := src.recv(CHUNK):
            dst.sendall(data)
    except OSError:
        pass
    for sock in (src, dst):
        _shut(sock)
        sock.close()


@dataclass
class RelayOptions:
    """A loopback relay to the lighthouse whose URL a file holds (it may move)."""

    url_file: str
    """Where the lighthouse writes its URL (rewritten when it moves)."""
    wait_s: float = 600.0
    """How long a connection waits for a lighthouse that answers before it is closed."""


def main(argv: list[str] | None = None) -> int:
    prog = "python -m muloco.launch.lighthouse_relay"
    try:
        args, _ = parse(
            RelayOptions,
            list(sys.argv[1:] if argv is None else argv),
            prog=prog,
            description=RelayOptions.__doc__,
            overrides=False,
        )
    except UsageError as e:
        return failed("slurm", f"lighthouse relay: {e}", BAD_INPUT)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    relay = LighthouseRelay(args.url_file, args.wait_s)
    print(f"relay {relay.url}", flush=True)
    seen = 0
    while True:  # serves until killed; says when the lighthouse it reaches changes
        time.sleep(POLL_S)
        for host, port in relay.targets[seen:]:
            print(f"relay: connected to the lighthouse at {host}:{port}", file=sys.stderr, flush=True)
        seen = len(relay.targets)


if __name__ == "__main__":
    sys.exit(main())
