"""Every command muloco sends to SLURM, run from this one place: ``sinfo`` (what the cluster has),
``sbatch``, ``scontrol`` and ``scancel`` (submit, hold and release, cancel), ``squeue`` and ``sacct``
(what is still queued or how it ended).

Each call has a timeout and ends one of two ways: SLURM's standard output, or a
:class:`SlurmCommandError` that says whether the command is missing, failed (with what SLURM
said) or did not answer. Callers turn that into their own message; none runs SLURM itself.
"""

from __future__ import annotations

import subprocess

COMMANDS = ("sinfo", "sbatch", "scontrol", "scancel", "squeue", "sacct")


class SlurmCommandError(RuntimeError):
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
