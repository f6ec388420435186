"""The torchft lighthouse: the small server every replica group asks for the current quorum.

Run it once per job, before the replicas, telling it how many replica groups the job has::

    python -m muloco.launch.lighthouse --replicas 2                        # local: loopback only
    python -m muloco.launch.lighthouse --replicas 4 --bind node:29510      # cluster node
    python -m muloco.launch.lighthouse --replicas 4 --bind node:0 --url_file RUN/slurm/lighthouse-A.url \
        --until_job A                                                      # inside a SLURM job

A quorum is a majority of the K groups (⌊K/2⌋+1) unless ``--min_replicas`` says otherwise: two
majorities always share a group, so two disjoint sets of replicas can never both commit a step
(split brain). It prints one line,
``lighthouse listening on http://HOST:PORT (status page: http://HOST:PORT/)``, then serves
until SIGINT/SIGTERM. Replicas find it through ``TORCHFT_LIGHTHOUSE=http://HOST:PORT``.

``node`` as the host is this node's address as other nodes reach it. A SLURM job's lighthouse
(its groups are array tasks or srun steps on other nodes) binds ``node:0``, writes its URL to
``--url_file`` atomically (the groups wait for that file, so start order does not matter) and,
with ``--until_job``, stops once SLURM no longer lists any task of that job (a requeued task is
listed as pending, so the lighthouse stays up for it).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from muloco.launch.slurm.commands import job_listed
from muloco.outer.lighthouse_status import majority
from muloco.utils.atomic_file import write_atomically
from muloco.utils.command_line import UsageError, failed, parse, run_main
from muloco.utils.errors import BadInput

DEFAULT_BIND = "127.0.0.1:29510"
# 90% of the trainer's default --fault_tolerance.quorum_timeout_seconds (300 s): see
# ReplicaGroupManager.Config.join_timeout_ms.
DEFAULT_JOIN_TIMEOUT_MS = 270_000
# IPv6 hosts must be bracketed ("[::1]:29510") so the port split is unambiguous.
_BIND_RE = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(?P<port>[0-9]{1,5})$")


class LighthouseError(BadInput):
    """Bad input or a bind failure, with a message meant for the user as is."""


def parse_bind(bind: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` and check it here, so a typo gets a clear message, not a Rust error."""
    m = _BIND_RE.match(bind or "")
    if not m or int(m["port"]) > 65535:
        raise LighthouseError(
            f"invalid --bind {bind!r}: expected HOST:PORT with PORT in 0..65535, e.g. "
            f"127.0.0.1:29510, node:29510 (this node's address as other nodes reach it) or [::1]:29510 "
            f"(port 0 picks a free port)"
        )
    return m["host"], int(m["port"])


def node_address() -> str:
    """This node's address as other nodes reach it: the source address of its default route,
    else what its hostname resolves to (loopback only as a last resort, with a warning)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks a route
            address = s.getsockname()[0]
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def below_majority_warning(option: str, min_replicas: int, replicas: int) -> str | None:
    """The one-line warning for a quorum smaller than a majority, or None when it is one."""
    if min_replicas >= majority(replicas):
        return None
    return (
        f"{option} {min_replicas} is below a majority of {replicas}: two disjoint groups of "
        f"replicas could both commit (split brain)"
    )


def quorum_size(replicas: int | None, min_replicas: int | None) -> int:
    """``min_replicas`` if given, else a majority of ``replicas``; refuses to guess with neither."""
    if replicas is not None and replicas < 1:
        raise LighthouseError(f"--replicas must be at least 1, got {replicas}")
    if min_replicas is None:
        if replicas is None:
            raise LighthouseError(
                "give --replicas K (the number of replica groups; a quorum is then a majority, "
                "K//2+1) or --min_replicas N (the replica groups a quorum needs)"
            )
        return majority(replicas)
    if replicas is not None and min_replicas > replicas:
        raise LighthouseError(f"--min_replicas {min_replicas} exceeds --replicas {replicas}: a quorum could never form")
    return min_replicas


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


def resolve_bind(bind: str) -> str:
    """``bind`` with the host ``node`` (a name reserved for this) replaced by this node's address
    as other nodes reach it."""
    host, port = parse_bind(bind)
    if host != "node":
        return bind
    address = node_address()
    if address.startswith("127."):
        print(
            f"muloco lighthouse: warning: this node's only address is {address}: groups on other nodes cannot "
            f"reach it (pass --bind ADDRESS:PORT)",
            file=sys.stderr,
            flush=True,
        )
    return f"{address}:{port}"


def start_lighthouse(
    bind: str = "127.0.0.1:0",
    min_replicas: int = 1,
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS,
    quorum_tick_ms: int = 100,
    heartbeat_timeout_ms: int = 5000,
) -> Lighthouse:
    """Start a lighthouse in this process; raises LighthouseError with a user-facing message.

    The caller picks the quorum (``majority(K)`` unless it knows better); the CLI refuses to
    start without being told K or the quorum size.
    """
    bind = resolve_bind(bind)
    host, port = parse_bind(bind)
    _check_settings(
        min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    # Imported late: loading torchft's Rust extension takes a moment, and bad arguments fail before it.
    from muloco.compat.torchft_native import lighthouse_server

    LighthouseServer = lighthouse_server()
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


@dataclass
class LighthouseOptions:
    """Run the torchft lighthouse (quorum server) until SIGINT/SIGTERM, or --until_job is gone."""

    bind: str = DEFAULT_BIND
    """HOST:PORT to listen on (loopback only by default; on a cluster the node's routable
    address: node:29510, where the host node stands for it; port 0 picks a free port)."""
    replicas: int | None = None
    """Replica groups in the job; the quorum is then a majority, K//2+1, so two disjoint sets of
    groups can never both commit (split brain)."""
    min_replicas: int | None = None
    """Replica groups needed to form a quorum (default: a majority of --replicas; one of the two
    options is required). Below a majority it is allowed, with a warning: split brain becomes possible."""
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS
    """How long a forming quorum waits for groups that heartbeat but have not joined yet (270 s).
    Keep it a bit below the replicas' --fault_tolerance.quorum_timeout_seconds (300 s by default):
    once a replica has waited longer than this, the next majority forms a quorum without the
    slightly late healthy groups, which then have to heal. Dead groups stop heartbeating and drop
    out after --heartbeat_timeout_ms, so they do not hold a quorum up this long."""
    quorum_tick_ms: int = 100
    """How often quorum state is re-evaluated."""
    heartbeat_timeout_ms: int = 5000
    """A group silent this long is dropped from the quorum."""
    url_file: str | None = None
    """Also write the URL to this file, atomically (a SLURM job's groups wait for it)."""
    until_job: str | None = None
    """Stop once SLURM lists no task of this job any more."""


def stop_on_signal() -> threading.Event:
    """An event set by SIGINT or SIGTERM; installed before the address is printed, so a
    parent that stops the lighthouse as soon as it read the address gets a clean exit."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def serve(
    lh: Lighthouse, stop: threading.Event, poll_s: float = 0.5, finished: Callable[[], bool] = lambda: False
) -> None:
    """Serve until SIGINT/SIGTERM (``stop``) or ``finished()`` says so, then shut down."""
    try:
        while not stop.wait(poll_s) and not finished():
            pass
    finally:
        lh.shutdown()


def _job_gone(job_id: str) -> bool:
    """SLURM lists no task of ``job_id`` any more (said once, in the log)."""
    if job_listed(job_id):
        return False
    print(f"lighthouse: job {job_id} has no task left; stopping", flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    prog = "python -m muloco.launch.lighthouse"
    try:
        args, _ = parse(
            LighthouseOptions,
            list(sys.argv[1:] if argv is None else argv),
            prog=prog,
            description=LighthouseOptions.__doc__,
            underscores=True,
            overrides=False,
        )
    except UsageError as e:
        return failed("lighthouse", e)
    stop = stop_on_signal()
    if args.url_file:  # a URL left by an earlier run (or an earlier start of this job) must not be read
        try:
            os.unlink(args.url_file)
        except FileNotFoundError:
            pass
    try:
        parse_bind(args.bind)  # a typo in the address is reported before the quorum options
        min_replicas = quorum_size(args.replicas, args.min_replicas)
        if args.replicas is not None:
            warning = below_majority_warning("--min_replicas", min_replicas, args.replicas)
            if warning:
                print(f"muloco lighthouse: warning: {warning}", file=sys.stderr, flush=True)
        lh = start_lighthouse(
            args.bind, min_replicas, args.join_timeout_ms, args.quorum_tick_ms, args.heartbeat_timeout_ms
        )
    except LighthouseError as e:
        return failed("lighthouse", e)
    if args.url_file:
        write_atomically(args.url_file, lh.url + "\n")
    written = f"; URL in {args.url_file}" if args.url_file else ""
    print(f"lighthouse listening on {lh.url} (status page: {lh.url}/){written}", flush=True)
    until = args.until_job
    serve(lh, stop, 5.0 if until else 0.5, lambda: bool(until) and _job_gone(until))
    return 0


if __name__ == "__main__":
    run_main(main)
