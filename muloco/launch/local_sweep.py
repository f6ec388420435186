"""A sweep on this machine, without SLURM: ``python jobs/sweeps/NAME.py --local N``.

Each run is a job of submitit's ``LocalExecutor`` (its own process, its state, its stdout in
``<sweep>/submitit/``), at most N at a time, started in the sweep's order. A run is the
project's own launcher, as on a cluster node: ``python -m muloco.train`` for a DDP run (one
group; torchrun with ``--procs`` ranks on CPU), ``python -m muloco.launch.local --replicas K``
for K replica groups (its lighthouse and groups). Its output goes to
``<sweep>/logs/<run>.log``. The manifest is the SLURM sweep's (``local:<id>`` job ids):
``--status`` reads it, and running the sweep file again reuses finished runs and resumes an
interrupted one from its checkpoint. Ctrl-C stops the running runs (their launchers stop
their own processes) and leaves them resumable.

Every run sees the GPUs this process sees (``CUDA_VISIBLE_DEVICES``); with N > 1 on a GPU
machine, runs share them, so N = 1 is the default.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import submitit

from muloco.launch.gpu_slices import visible_gpus

POLL_S = 1.0
"""How often finished jobs are looked for (a run lasts minutes to days)."""
STOP_GRACE_S = 120.0
"""After Ctrl-C, how long a run's launcher has to stop its processes (it saves nothing then)."""
NO_TIME_LIMIT_MIN = 60 * 24 * 365
"""submitit's local jobs have a time limit (2 minutes by default); a run has none."""


def run_command(cmd: list[str], log: str) -> int:
    """One local job's body, run inside submitit's job process: the run's command, its output
    appended to ``log``; a failure raises (submitit then records the job as failed)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait()
        except BaseException:  # submitit's cancel (SIGINT) or Ctrl-C: the launcher stops its children
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    if code:
        raise RuntimeError(f"{' '.join(cmd[1:4])} exited with {code}; see {log}")
    return code


def local_command(kind: str, config: str, overrides: list[str], *, replicas: int, procs: int,
                  gpus: int) -> list[str]:
    """The command that runs one sweep run on this machine: DDP over every visible GPU (else
    ``procs`` CPU ranks), or K replica groups through the local launcher (GPU slices its own)."""
    if kind == "ddp":
        ranks = gpus or procs
        if ranks > 1:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                    "-m", "muloco.train", "--config", config, *overrides]
        return [sys.executable, "-m", "muloco.train", "--config", config, *overrides]
    per_group = [] if gpus or procs == 1 else ["--procs-per-replica", str(procs)]
    return [sys.executable, "-m", "muloco.launch.local", "--config", config, "--replicas", str(replicas),
            *per_group, "--", *overrides]


class LocalSweep:
    """Runs planned sweep runs through submitit's LocalExecutor, ``parallel`` at a time."""

    def __init__(self, folder: str, parallel: int, record: Callable[[str, str, str], None], say=print):
        """``record(name, job id, state)`` keeps the manifest."""
        self.folder, self.parallel, self.record, self.say = folder, parallel, record, say
        self.executor = submitit.LocalExecutor(folder=os.path.join(folder, "submitit"))
        self.executor.update_parameters(timeout_min=NO_TIME_LIMIT_MIN, tasks_per_node=1, **_same_gpus())
        os.makedirs(os.path.join(folder, "logs"), exist_ok=True)

    def run(self, runs: list[tuple[str, list[str]]]) -> list[str]:
        """Each (name, command) to its end; the names of the runs that failed."""
        waiting, running, failed = list(runs), {}, []
        try:
            while waiting or running:
                while waiting and len(running) < self.parallel:
                    name, cmd = waiting.pop(0)
                    log = os.path.join(self.folder, "logs", f"{name}.log")
                    job = self.executor.submit(run_command, cmd, log)
                    running[name] = job
                    self.record(name, f"local:{job.job_id}", "RUNNING")
                    self.say(f"started {name} (local job {job.job_id}; log {log})")
                for name, job in list(running.items()):
                    if job.done():
                        del running[name]
                        ok = job.exception() is None
                        self.record(name, f"local:{job.job_id}", "COMPLETED" if ok else "FAILED")
                        self.say(f"{'finished' if ok else 'FAILED'} {name}"
                                 + ("" if ok else f": {str(job.exception()).strip().splitlines()[-1]}"))
                        if not ok:
                            failed.append(name)
                time.sleep(POLL_S)
        except BaseException:
            for job in running.values():
                job.cancel()
            for name, job in running.items():
                _wait_done(job)
                self.record(name, f"local:{job.job_id}", "CANCELLED")
            raise
        return failed


def _same_gpus() -> dict:
    """submitit's parameters that give a job the GPUs this process sees (it sets
    ``CUDA_VISIBLE_DEVICES`` itself, from integer ids: a restriction of ours, UUIDs included,
    is exported again before its job starts)."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is not None:
        return {"gpus_per_node": 0, "setup": [f"export CUDA_VISIBLE_DEVICES={shlex.quote(spec)}"]}
    count = len(visible_gpus())
    return {"gpus_per_node": count, "visible_gpus": tuple(range(count))}


def _wait_done(job, timeout: float = STOP_GRACE_S + 30) -> None:
    deadline = time.monotonic() + timeout
    while not job.done() and time.monotonic() < deadline:
        time.sleep(0.2)
