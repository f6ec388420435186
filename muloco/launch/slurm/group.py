"""One DiLoCo replica group inside a SLURM job: ``srun ... python -m muloco.launch.slurm.group``.

Run once per node of the group (``srun --nodes N --ntasks-per-node 1``). It waits for the
lighthouse's URL file (the lighthouse may be another job that starts later), then becomes the
group's torchrun (``muloco.launch.replica_group``, so failed ranks are restarted and reported as
in the local launcher) over the group's nodes: a c10d rendezvous on the group's first node at a
port derived from the SLURM job id (groups on one node each get their own), each rank running
``muloco.train`` with the group's replica id, K and quorum size. GPUs are the ones SLURM gave
the step (``CUDA_VISIBLE_DEVICES``), one rank each; on CPU ``--procs`` ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from muloco.launch.gpu_slices import visible_gpus
from muloco.launch.group import group_variables, torchrun_args, torchrun_group, trainer_command
from muloco.launch.parent_death import die_with_launcher
from muloco.launch.slurm.commands import SlurmCommandError, slurm
from muloco.utils.command_line import UsageError, failed, parse
from muloco.utils.errors import BAD_INPUT, MulocoError

RDZV_PORT_BASE = 26400
RDZV_PORT_SPAN = 3000  # 26400-29399: below the ephemeral range and the ddp kind's ports


class GroupStartError(MulocoError, RuntimeError):
    """The group cannot start; the message says why and what to check."""


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/", timeout=5):
            return True
    except (OSError, ValueError):
        return False


def wait_for_url(path: str, timeout_s: float) -> str:
    """The lighthouse URL from its file, once the file exists and the lighthouse answers there
    (polls: the lighthouse may start later, and a file left by a dead one is not trusted)."""
    deadline = time.monotonic() + timeout_s
    url = ""
    while True:
        try:
            with open(path) as f:
                url = f.read().strip()
            if url and _answers(url):
                return url
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            seen = f"{url} does not answer" if url else f"no lighthouse URL in {path}"
            raise GroupStartError(
                f"{seen} after {timeout_s:.0f} s: is the lighthouse job running? "
                f"(squeue --me; its log is in the run's logs/)"
            )
        time.sleep(1.0)


def start_relay(url_file: str, wait_s: float) -> str:
    """A lighthouse relay on this node (``muloco.launch.lighthouse_relay``) that dies with this
    process, which then becomes torchrun (exec keeps the PID); the relay's URL."""
    relay = subprocess.Popen(
        [sys.executable, "-m", "muloco.launch.lighthouse_relay", "--url-file", url_file, "--wait-s", f"{wait_s:g}"],
        stdout=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        preexec_fn=die_with_launcher(),
    )
    line = relay.stdout.readline().strip() if relay.stdout else ""
    if not line.startswith("relay http://"):
        relay.kill()
        raise GroupStartError(f"the lighthouse relay did not start (it printed {line!r}; exit {relay.wait()})")
    return line.split(" ", 1)[1]


def step_hosts() -> list[str]:
    """The addresses of this srun step's nodes, in SLURM's order (the first one hosts the
    rendezvous): each node's NodeAddr, which is its name unless slurm.conf says otherwise (a
    node name need not resolve; the address SLURM itself reaches the node at does)."""
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise GroupStartError("not inside a SLURM step (no SLURM_STEP_NODELIST): run it with srun")
    try:
        names = slurm("scontrol", "show", "hostnames", nodelist).split()
        nodes = slurm("scontrol", "show", "node", "-o", ",".join(names))
    except SlurmCommandError as e:
        raise GroupStartError(f"cannot list this step's nodes: {e}") from None
    addresses = {}
    for line in nodes.splitlines():
        fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
        if "NodeName" in fields:
            addresses[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return [addresses.get(name, name) for name in names]


def rendezvous_port(job_id: int, replica: int) -> int:
    """A port for the group's rendezvous store that differs between the groups and jobs sharing
    a node (two array tasks on one node have different job ids)."""
    return RDZV_PORT_BASE + (job_id * 17 + replica) % RDZV_PORT_SPAN


def torchrun_command(args: GroupOptions, hosts: list[str], overrides: list[str]) -> list[str]:
    """The group's torchrun (through replica_group) and each rank's trainer command."""
    job_id = int(os.environ.get("SLURM_JOB_ID", "0"))
    torchrun = torchrun_args(
        args.replica,
        procs=len(visible_gpus(ask_torch=False)) or args.procs,
        max_restarts=args.max_restarts,
        hosts=hosts,
        port=rendezvous_port(job_id, args.replica),
        rdzv_id=f"{job_id}_{args.replica}",
        is_host=os.environ.get("SLURM_NODEID", "0") == "0",
    )  # the step's first node
    return torchrun_group(
        torchrun, trainer_command(args.config, args.replica, args.replicas, overrides, args.min_replicas)
    )


@dataclass
class GroupOptions:
    """One DiLoCo replica group of a SLURM job (run by the generated scripts, under srun)."""

    config: str
    """muloco config module."""
    replica: int
    """This group's replica id."""
    replicas: int
    """Replica groups K."""
    min_replicas: int
    """Replica groups a quorum needs (the lighthouse's, so trainers and lighthouse agree)."""
    lighthouse_file: str
    """Where the lighthouse job writes its URL."""
    lighthouse_wait_s: float = 900.0
    """How long to wait for that file and the lighthouse answering at its URL."""
    lighthouse_lost_s: float = 600.0
    """How long the group waits for a lighthouse that stopped answering mid-run (it may have been
    requeued onto another node: the group follows its URL file through a relay). 0: a lighthouse
    that cannot move (a step of the group's own job): no relay, the trainer's connect timeout."""
    procs: int = 1
    """Ranks per node on CPU (GPUs: one per GPU)."""
    max_restarts: int = 0
    """torchrun restarts of a failed group."""


def main(argv: list[str] | None = None) -> int:
    prog = "python -m muloco.launch.slurm.group"
    try:
        args, overrides = parse(
            GroupOptions, list(sys.argv[1:] if argv is None else argv), prog=prog, description=GroupOptions.__doc__
        )
    except UsageError as e:
        return failed("slurm", e)
    try:
        url = wait_for_url(args.lighthouse_file, args.lighthouse_wait_s)
        hosts = step_hosts()
    except GroupStartError as e:
        return failed("slurm", f"replica group {args.replica}: {e}", BAD_INPUT)
    moves = args.lighthouse_lost_s > 0
    lost = ["--fault_tolerance.lighthouse_lost_seconds", f"{args.lighthouse_lost_s:g}"] if moves else []
    cmd = torchrun_command(args, hosts, [*lost, *overrides])  # the user's own override comes later and wins
    try:
        reach = start_relay(args.lighthouse_file, args.lighthouse_lost_s) if moves else url
    except GroupStartError as e:
        return failed("slurm", f"replica group {args.replica}: {e}", BAD_INPUT)
    env = {**os.environ, **group_variables(reach, args.replica, args.replicas)}
    env.setdefault("RUST_LOG", "warn")
    through = f" (through {reach}, which follows {args.lighthouse_file})" if moves else ""
    print(f"replica group {args.replica}/{args.replicas} on {','.join(hosts)}, lighthouse {url}{through}", flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
