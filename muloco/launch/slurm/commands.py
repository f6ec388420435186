"""Every command muloco sends to SLURM, run from this one place: ``sinfo`` (what the cluster has),
``sbatch``, ``scontrol`` and ``scancel`` (submit, hold and release, cancel), ``squeue`` and ``sacct``
(what is still queued or how it ended), and what their answers say of a job.

Each call has a timeout and ends one of two ways: SLURM's standard output, or a
:class:`SlurmCommandError` that says whether the command is missing, failed (with what SLURM
said) or did not answer. Callers turn that into their own message; none runs SLURM itself.
"""

from __future__ import annotations

import subprocess

from muloco.utils.errors import MulocoError

COMMANDS = ("sinfo", "sbatch", "scontrol", "scancel", "squeue", "sacct")


class SlurmCommandError(MulocoError, RuntimeError):
    """A SLURM command that is missing (``kind='missing'``), failed (``'failed'``, with SLURM's
    ``stderr``) or did not answer in time (``'timeout'``)."""

    def __init__(self, command: list[str], kind: str, stderr: str = "", timeout: float | None = None):
        self.command, self.kind, self.stderr = command, kind, stderr.strip()
        if kind == "missing":
            said = f"{command[0]} was not found"
        elif kind == "timeout":
            said = f"{command[0]} did not answer in {timeout:g} s"
        else:
            said = f"{command[0]} failed: {self.stderr or 'no message'}"
        super().__init__(said)

    @property
    def last_line(self) -> str:
        """SLURM's last line of complaint (``sbatch: error: `` prefixes dropped), or this error's text."""
        lines = [line.replace(f"{self.command[0]}: error: ", "") for line in self.stderr.splitlines()]
        return " ".join(lines) or str(self)


def slurm(command: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60) -> str:
    """Run a SLURM command; its standard output, or :class:`SlurmCommandError`."""
    if command not in COMMANDS:
        raise ValueError(f"{command!r} is not a SLURM command this module runs ({', '.join(COMMANDS)})")
    cmd = [command, *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except FileNotFoundError:
        raise SlurmCommandError(cmd, "missing") from None
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(cmd, "timeout", timeout=timeout) from None
    if r.returncode != 0:
        raise SlurmCommandError(cmd, "failed", r.stderr)
    return r.stdout


def cancel(job_ids: list[str]) -> None:
    """Cancel jobs, best effort (used to undo a submission that failed half-way)."""
    if job_ids:
        try:
            slurm("scancel", *job_ids)
        except SlurmCommandError:
            pass


# -- what SLURM says of a job ----------------------------------------------------------------

FAILED_STATES = {
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "LOST",
}
"""LOST: SLURM no longer knows the job (no accounting, older than MinJobAge) and the run has no summary."""
KNOWN_STATES = FAILED_STATES | {
    "PENDING",
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "COMPLETED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "STOPPED",
    "SPECIAL_EXIT",
}
ACTIVE_STATES = "PENDING,RUNNING,CONFIGURING,COMPLETING,REQUEUED,RESIZING,SUSPENDED"


def states_in(text: str) -> list[str]:
    """Every job state named in scontrol's or sacct's answer (one per record: an array job's
    tasks each have one)."""
    return [
        word for token in text.replace("|", " ").split() if (word := token.removeprefix("JobState=")) in KNOWN_STATES
    ]


def combined_state(states: list[str]) -> str | None:
    """One state for a job's records (an array's tasks): RUNNING or PENDING while any task is,
    else the first failure, else COMPLETED when every task completed."""
    if not states:
        return None
    for active in (
        "RUNNING",
        "COMPLETING",
        "CONFIGURING",
        "REQUEUED",
        "RESIZING",
        "SUSPENDED",
        "PENDING",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
    ):
        if active in states:
            return active
    failed = [s for s in states if s != "COMPLETED"]
    return failed[0] if failed else "COMPLETED"


def job_state(job_id: str, finished: bool) -> str:
    """SLURM's state of a job (every task of an array job ``A``, or one task ``A_i``): scontrol
    while the controller remembers it (MinJobAge), else sacct where accounting exists, else what
    the run folder says (``finished``: its summary is written)."""
    for cmd in (["scontrol", "show", "job", job_id], ["sacct", "-n", "-X", "-P", "-o", "State", "-j", job_id]):
        try:
            state = combined_state(states_in(slurm(*cmd)))
        except SlurmCommandError:
            continue
        if state:
            return state
    return "COMPLETED" if finished else "LOST"


def job_listed(job_id: str) -> bool:
    """Whether squeue still lists a task of ``job_id`` (pending, running, requeued, completing).
    A failing squeue (controller restarting) counts as listed: never stop on a hiccup."""
    try:
        return bool(slurm("squeue", "-h", "-j", job_id, "-o", "%i").strip())
    except SlurmCommandError as e:
        return "Invalid job id" not in e.stderr


def nodes_in_use(user: str) -> int:
    """Nodes held or wanted by this user's running and pending jobs, every QOS and partition
    (array tasks counted one by one)."""
    return sum(int(x) for x in slurm("squeue", "-h", "--array", "-u", user, "-t", ACTIVE_STATES, "-o", "%D").split())
