"""Many runs on this machine, without SLURM: a sweep's ``--local N`` and ``compare``'s suites.

Each run is a job of submitit's ``LocalExecutor`` (its own process, its state, its stdout in
``<folder>/submitit/``), at most N at a time, started in the given order. A run is the
project's own launcher, as on a cluster node (:func:`local_command`): ``python -m muloco.train``
for a DDP run (one group; torchrun with ``--procs`` ranks on CPU, or over every visible GPU),
``python -m muloco.launch.local --replicas K`` for K replica groups (its lighthouse and groups).
Its output goes to ``<folder>/logs/<run>.log``. Each run's line of the folder's manifest (the
sweep's format, :mod:`muloco.runs.sweep_manifest`) is kept here, for sweeps and ``compare``
alike: its local job id, RUNNING, then COMPLETED (a summary written), FAILED or CANCELLED, the
manifest rewritten atomically at each. The caller hears the same events and may watch the
running runs on every poll (a progress line). Ctrl-C or SIGTERM stops the running runs (their launchers stop their own
processes) and leaves them resumable; submitit's own controller processes write to
``<folder>/submitit/controllers.log``.

Every run sees the GPUs this process sees (``CUDA_VISIBLE_DEVICES``); with N > 1 on a GPU
machine, runs share them, so N = 1 is the default.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import submitit

from muloco.launch.gpu_slices import visible_gpus
from muloco.runs.sweep_manifest import Entry, run_finished, write_manifest

POLL_S = 1.0
"""How often finished jobs are looked for (a run lasts minutes to days)."""
STOP_GRACE_S = 120.0
"""After Ctrl-C, how long a run's launcher has to stop its processes (it saves nothing then)."""
NO_TIME_LIMIT_MIN = 60 * 24 * 365
"""submitit's local jobs have a time limit (2 minutes by default); a run has none."""


def run_command(cmd: list[str], log: str, extra_env: dict[str, str] | None = None) -> int:
    """One local job's body, run inside submitit's job process: the run's command in the job's
    environment (inherited from the launching process) with ``extra_env`` set, its output
    appended to ``log``; a failure raises (submitit then records the job as failed)."""
    env = {**os.environ, **extra_env} if extra_env else None
    with open(log, "ab") as out:
        with _interrupt_deferred() as interrupted:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            if interrupted:
                raise KeyboardInterrupt
            code = proc.wait()
        except BaseException:  # submitit's cancel (SIGINT) or Ctrl-C: the launcher stops its children
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
            raise
    if code:
        raise RuntimeError(f"{' '.join(cmd[1:4])} exited with {code}")
    return code


def local_command(
    kind: str,
    config: str,
    overrides: list[str],
    *,
    replicas: int,
    procs: int = 1,
    gpus: int = 0,
    share_gpus: bool = False,
) -> list[str]:
    """The command that runs one run on this machine: DDP over ``gpus`` visible GPUs (else
    ``procs`` CPU ranks), or K replica groups through the local launcher (GPU slices its own;
    ``share_gpus`` when the machine has fewer GPUs than groups)."""
    if kind == "ddp":
        ranks = gpus or procs
        if ranks > 1:
            return [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(ranks),
                "-m",
                "muloco.train",
                "--config",
                config,
                *overrides,
            ]
        return [sys.executable, "-m", "muloco.train", "--config", config, *overrides]
    per_group = [] if gpus or procs == 1 else ["--procs-per-replica", str(procs)]
    return [
        sys.executable,
        "-m",
        "muloco.launch.local",
        "--config",
        config,
        "--replicas",
        str(replicas),
        *per_group,
        *(["--share-gpus"] if share_gpus else []),
        "--",
        *overrides,
    ]


@dataclass
class RunEvent:
    """What a run did: started (``RUNNING``, also sent on every poll to a watcher), or ended
    (``COMPLETED``, ``FAILED`` with ``error``, ``CANCELLED`` when this process was stopped)."""

    name: str
    job_id: str
    state: str
    seconds: float
    """Since the run started."""
    error: str = ""


class LocalRuns:
    """Runs named commands through submitit's LocalExecutor, ``parallel`` at a time."""

    def __init__(
        self,
        folder: str,
        parallel: int,
        manifest: dict[str, Entry],
        record: Callable[[RunEvent], None] | None = None,
        say=print,
        extra_env: dict[str, str] | None = None,
    ):
        """``manifest``: the folder's entries by run name (a run's own is put there as it starts,
        kept there, and the whole written to the folder); ``record`` hears each run start and
        end after its entry is kept; ``extra_env``: variables set for the runs on top of this process's environment.
        Only these are written into submitit's job file, so no secret of the environment (a
        token) lands on disk."""
        self.folder, self.parallel, self.manifest, self.say = folder, parallel, manifest, say
        self.record_hook, self.extra_env = record, extra_env
        self._entries: dict[str, Entry] = {}
        self.executor = submitit.LocalExecutor(folder=os.path.join(folder, "submitit"))
        self.executor.update_parameters(timeout_min=NO_TIME_LIMIT_MIN, tasks_per_node=1, **_same_gpus())
        for sub in ("logs", "submitit"):
            os.makedirs(os.path.join(folder, sub), exist_ok=True)

    def record(self, event: RunEvent) -> None:
        """The run's manifest entry (a COMPLETED run without its summary is FAILED), then the
        caller's hook."""
        entry = self.manifest[event.name] = self._entries[event.name]
        if event.state == "COMPLETED" and not run_finished(entry.run_dir):
            event.state, event.error = "FAILED", "no summary written"
        if event.job_id not in entry.jobs:
            entry.jobs.append(event.job_id)
        entry.state, entry.job_files = event.state, {"local": event.job_id}
        write_manifest(self.folder, self.manifest)
        if self.record_hook:
            self.record_hook(event)

    def log(self, name: str) -> str:
        return os.path.join(self.folder, "logs", f"{name}.log")

    @property
    def controller_log(self) -> str:
        return os.path.join(self.folder, "submitit", "controllers.log")

    def run(
        self, runs: list[tuple[Entry, list[str]]], watch: Callable[[RunEvent], None] | None = None
    ) -> dict[str, RunEvent]:
        """Each (manifest entry, command) to its end, ``watch`` told of the running ones on every
        poll; how each ended, by name."""
        self._entries = {entry.name: entry for entry, _ in runs}
        waiting, running, ended = [(entry.name, cmd) for entry, cmd in runs], {}, {}
        try:
            while waiting or running:
                while waiting and len(running) < self.parallel:
                    name, cmd = waiting.pop(0)
                    with _cancellable_jobs(), _controller_output(self.controller_log):
                        job = self.executor.submit(run_command, cmd, self.log(name), self.extra_env)
                    running[name] = (job, time.monotonic())
                    self.record(RunEvent(name, f"local:{job.job_id}", "RUNNING", 0.0))
                    self.say(f"started {name} (local job {job.job_id}; log {self.log(name)})")
                for name, (job, began) in list(running.items()):
                    event = RunEvent(name, f"local:{job.job_id}", "RUNNING", time.monotonic() - began)
                    if not job.done():
                        if watch:
                            watch(event)
                        continue
                    del running[name]
                    failure = job.exception()
                    event.state = "FAILED" if failure else "COMPLETED"
                    event.error = str(failure).strip().splitlines()[-1] if failure else ""
                    ended[name] = event
                    self.record(event)
                    failed = event.state == "FAILED"
                    self.say(
                        f"{'FAILED' if failed else 'finished'} {name}"
                        + (f": {event.error}; see {self.log(name)}" if failed else "")
                    )
                time.sleep(POLL_S)
        except BaseException:
            for job, _ in running.values():
                job.cancel()
            for name, (job, began) in running.items():
                _wait_done(job)
                self.record(RunEvent(name, f"local:{job.job_id}", "CANCELLED", time.monotonic() - began))
            raise
        return ended


@contextlib.contextmanager
def _interrupt_deferred() -> Iterator[list[int]]:
    """A cancel (SIGINT) that arrives while the run's launcher is being started is held until it
    has started, then raised: raised inside ``Popen``, after the fork, it would leave the launcher
    (in a session of its own) running with nobody to stop it. The list yielded is non-empty when
    one arrived. Outside the main thread (no signal handler can be set there) nothing is held."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _cancellable_jobs() -> Iterator[None]:
    """submitit cancels a local job with SIGINT to its controller. A process a script starts in the
    background (``cmd &``) inherits SIGINT ignored (bash does that so Ctrl-C spares it), and so
    would the jobs it starts: a cancel would do nothing and the run go on, orphaned. While a job
    is started, this process handles SIGINT (as Python does by default, with KeyboardInterrupt),
    which a child receives as the default action; the ignoring is put back afterwards."""
    if (
        signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _controller_output(path: str) -> Iterator[None]:
    """submitit starts one controller process per job (between this process and the run), which
    writes to the stderr it inherits: a cancel (SIGINT) makes it print a KeyboardInterrupt
    traceback of its own. Started while this process's stderr points at ``path``, it writes there
    instead, and the terminal shows only the progress line and this process's own words."""
    sys.stderr.flush()
    saved = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        os.dup2(log, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(log)


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
