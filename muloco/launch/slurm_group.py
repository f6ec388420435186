"""One DiLoCo replica group inside a SLURM job: ``srun ... python -m muloco.launch.slurm_group``.

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

from muloco.launch.cli import UsageError, parse
from muloco.launch.group import group_variables, torchrun_args, torchrun_group, trainer_command

RDZV_PORT_BASE = 26400
RDZV_PORT_SPAN = 3000  # 26400-29399: below the ephemeral range and the ddp kind's ports


class GroupStartError(RuntimeError):
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
            raise GroupStartError(f"{seen} after {timeout_s:.0f} s: is the lighthouse job running? "
                                  f"(squeue --me; its log is in the run's logs/)")
        time.sleep(1.0)


def step_hosts() -> list[str]:
    """The nodes of this srun step, in SLURM's order (the first one hosts the rendezvous)."""
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise GroupStartError("not inside a SLURM step (no SLURM_STEP_NODELIST): run it with srun")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return out.split()


def rendezvous_port(job_id: int, replica: int) -> int:
    """A port for the group's rendezvous store that differs between the groups and jobs sharing
    a node (two array tasks on one node have different job ids)."""
    return RDZV_PORT_BASE + (job_id * 17 + replica) % RDZV_PORT_SPAN


def visible_gpu_count() -> int:
    spec = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in spec.split(",") if d.strip()])


def torchrun_command(args: GroupOptions, hosts: list[str], overrides: list[str]) -> list[str]:
    """The group's torchrun (through replica_group) and each rank's trainer command."""
    job_id = int(os.environ.get("SLURM_JOB_ID", "0"))
    torchrun = torchrun_args(args.replica, procs=visible_gpu_count() or args.procs, max_restarts=args.max_restarts,
                             hosts=hosts, port=rendezvous_port(job_id, args.replica), rdzv_id=f"{job_id}_{args.replica}")
    return torchrun_group(torchrun, trainer_command(args.config, args.replica, args.replicas, overrides,
                                                    args.min_replicas))


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
    procs: int = 1
    """Ranks per node on CPU (GPUs: one per GPU)."""
    max_restarts: int = 0
    """torchrun restarts of a failed group."""


def main(argv: list[str] | None = None) -> int:
    prog = "python -m muloco.launch.slurm_group"
    try:
        args, overrides = parse(GroupOptions, list(sys.argv[1:] if argv is None else argv), prog=prog,
                                description=GroupOptions.__doc__)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        url = wait_for_url(args.lighthouse_file, args.lighthouse_wait_s)
        hosts = step_hosts()
    except GroupStartError as e:
        print(f"replica group {args.replica}: error: {e}", file=sys.stderr, flush=True)
        return 2
    cmd = torchrun_command(args, hosts, overrides)
    env = {**os.environ, **group_variables(url, args.replica, args.replicas)}
    env.setdefault("RUST_LOG", "warn")
    print(f"replica group {args.replica}/{args.replicas} on {','.join(hosts)}, lighthouse {url}",
          flush=True)
    os.execvpe(cmd[0], cmd, env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
