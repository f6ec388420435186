"""The lighthouse of a SLURM job whose replica groups are array tasks (or srun steps).

    python -m muloco.launch.slurm_lighthouse --replicas K --url-file RUN/slurm/lighthouse-A.url \
        [--until-job A] [--host ADDR]

It binds to this node's address (``--host``, default: the address ``hostname`` resolves to;
the groups run on other nodes, so loopback would not do), a free port, writes its URL to
``--url-file`` atomically (the groups wait for that file, so start order does not matter), and
serves until SIGTERM or, with ``--until-job``, until SLURM no longer lists any task of that
job (all groups finished or were cancelled; a requeued task is listed as pending, so the
lighthouse stays up for it).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

from muloco.launch.slurm_commands import SlurmCommandError, slurm
from muloco.utils.atomic_file import write_atomically
from muloco.utils.command_line import UsageError, parse
from muloco.launch.lighthouse import (DEFAULT_JOIN_TIMEOUT_MS, LighthouseError, serve, stop_on_signal,
                                      quorum_size, start_lighthouse)

POLL_S = 5.0


def node_address() -> str:
    """This node's address as other nodes reach it: the source address of its default route,
    else what its hostname resolves to (loopback only as a last resort, said in the log)."""
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


def job_gone(job_id: str) -> bool:
    """SLURM lists no task of ``job_id`` any more (said once, in the log)."""
    if job_listed(job_id):
        return False
    print(f"lighthouse: job {job_id} has no task left; stopping", flush=True)
    return True


def job_listed(job_id: str) -> bool:
    """Whether squeue still lists a task of ``job_id`` (pending, running, requeued, completing).
    A failing squeue (controller restarting) counts as listed: never stop on a hiccup."""
    try:
        return bool(slurm("squeue", "-h", "-j", job_id, "-o", "%i").strip())
    except SlurmCommandError as e:
        return "Invalid job id" not in e.stderr


@dataclass
class SlurmLighthouseOptions:
    """A torchft lighthouse for the replica groups of a SLURM job."""

    replicas: int
    """Replica groups K."""
    url_file: str
    """Where the URL is written for the groups."""
    min_replicas: int | None = None
    """Replica groups a quorum needs (default: a majority of K)."""
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS
    """How long a forming quorum waits for heartbeating groups that have not joined yet."""
    heartbeat_timeout_ms: int = 5000
    """A group silent this long is dropped from the quorum."""
    until_job: str | None = None
    """Stop once SLURM lists no task of this job."""
    host: str | None = None
    """Address to bind (default: this node's address)."""


def main(argv: list[str] | None = None) -> int:
    prog = "python -m muloco.launch.slurm_lighthouse"
    try:
        args, _ = parse(SlurmLighthouseOptions, list(sys.argv[1:] if argv is None else argv), prog=prog,
                        description=SlurmLighthouseOptions.__doc__, overrides=False)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    stop = stop_on_signal()
    try:  # a URL left by an earlier run (or an earlier start of this job) must not be read
        os.unlink(args.url_file)
    except FileNotFoundError:
        pass
    host = args.host or node_address()
    if host.startswith("127.") and not args.host:
        print(f"lighthouse: warning: this node's only address is {host}: groups on other nodes cannot "
              f"reach it (pass --host)", file=sys.stderr, flush=True)
    try:
        lh = start_lighthouse(f"{host}:0",
                              quorum_size(args.replicas, args.min_replicas),
                              args.join_timeout_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except LighthouseError as e:
        print(f"lighthouse: error: {e}", file=sys.stderr, flush=True)
        return 2
    write_atomically(args.url_file, lh.url + "\n")
    print(f"lighthouse listening on {lh.url} (status page: {lh.url}/); URL in {args.url_file}",
          flush=True)
    serve(lh, stop, POLL_S, lambda: bool(args.until_job) and job_gone(args.until_job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
