"""Run a suite's runs one after another on this machine, resumably, with a live progress line.

Each run is the project's own launcher in a child process: ``python -m muloco.train`` for a
DDP row (one replica group), ``python -m muloco.launch.local`` for K replica groups (it starts
the lighthouse and the groups), with ``--dump_folder <suite>/<name>``; its output goes to
``<suite>/logs/<name>.log``. A run whose folder holds its summaries is finished and reused; a
run interrupted part-way is started again with the same command and resumes from its last
checkpoint. Ctrl-C, SIGTERM or a closed terminal stops the current run with the suite (its whole
process group; a second Ctrl-C kills it at once),
so nothing keeps training behind an interrupted suite. The suite's ``manifest.jsonl`` (the sweep's format: name, config, overrides, run
folder, state) is rewritten atomically after every run, so ``python -m muloco.report`` and
``muloco.launch.sweep --status``-style readers see the same runs.

The progress line (stderr; rewritten in place on a terminal, a line per tenth of a run
otherwise) says runs done of total, the current run's step, and the time left, estimated
from the seconds per sequence trained so far in this invocation.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from muloco.compare.suites import Planned
from muloco.launch.sweep import Entry, read_manifest, run_finished, write_manifest

POLL_SECONDS = 2.0
"""How often the progress line looks at the current run's metrics (display only)."""
STOP_GRACE_S = 60.0
"""How long an interrupted run has to stop its processes after SIGTERM before SIGKILL."""


def command(p: Planned, folder: Path, *, share_gpus: bool = False) -> list[str]:
    """The command that trains ``p`` into ``folder``; ``share_gpus`` lets its replica groups
    share the machine's GPUs (fewer GPUs than groups)."""
    if p.row.ddp:
        return [sys.executable, "-m", "muloco.train", "--config", p.row.config, *p.overrides,
                "--dump_folder", str(folder)]
    return [sys.executable, "-m", "muloco.launch.local", "--config", p.row.config, "--replicas",
            str(p.row.replicas), *(["--share-gpus"] if share_gpus else []), "--", *p.overrides,
            "--dump_folder", str(folder)]


def _work(p: Planned) -> int:
    """Sequences trained by all groups together: what a run costs on a machine whose cores all
    its groups share (a DDP row's doubled batch counts twice)."""
    return p.steps * p.local_batch * p.row.replicas


def current_step(folder: Path) -> int:
    """The last step the run logged (any replica group), 0 before its first log line."""
    files = [folder / "metrics.jsonl", *sorted(folder.glob("replica_*/metrics.jsonl"))]
    last = 0
    for f in files:
        try:
            tail = f.read_bytes()[-4096:].decode(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(tail):
            try:
                last = max(last, int(json.loads(line)["step"]))
                break
            except (ValueError, KeyError, TypeError):
                continue
    return last


@dataclass
class Progress:
    """The live line: runs done of total, the current run's step, the time left."""

    total_runs: int
    total_work: int
    out: TextIO = field(default_factory=lambda: sys.stderr)  # the stream of the moment, not of import time
    done_runs: int = 0
    done_work: int = 0
    measured_work: int = 0
    measured_seconds: float = 0.0
    _last_decile: int = -1

    def _left(self, remaining_work: int, measured_work: int, measured_seconds: float) -> str:
        if not measured_work:
            return "time left: measuring"
        seconds = remaining_work * measured_seconds / measured_work
        return f"about {int(seconds // 60)}m{int(seconds % 60):02d}s left"

    def show(self, p: Planned, step: int, elapsed: float) -> None:
        steps = p.steps
        work_now = _work(p) * step // max(steps, 1)
        left = self.total_work - self.done_work - work_now
        eta = self._left(left, self.measured_work + work_now, self.measured_seconds + elapsed)
        line = (f"[{self.done_runs}/{self.total_runs} runs done] {p.row.label} seed {p.seed}: "
                f"step {step}/{steps}, {eta}")
        if self.out.isatty():
            self.out.write("\r\033[K" + line)
        else:
            decile = 10 * step // max(steps, 1)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.out.write(line + "\n")
        self.out.flush()

    def finished(self, p: Planned, seconds: float | None, state: str) -> None:
        self.done_runs += 1
        self.done_work += _work(p)
        if seconds is not None:
            self.measured_work += _work(p)
            self.measured_seconds += seconds
        self._last_decile = -1
        prefix = "\r\033[K" if self.out.isatty() else ""
        took = f" in {int(seconds // 60)}m{int(seconds % 60):02d}s" if seconds is not None else ""
        self.out.write(f"{prefix}[{self.done_runs}/{self.total_runs} runs done] {p.row.label} seed {p.seed}: "
                       f"{state}{took}\n")
        self.out.flush()


def _entry(p: Planned, folder: Path, state: str) -> Entry:
    kind = "ddp" if p.row.ddp else "groups"
    return Entry(name=p.name, kind=kind, config=p.row.config, overrides=p.overrides,
                 options={"replicas": p.row.replicas, "label": p.row.label, "seed": p.seed}, run_dir=str(folder),
                 state=state)


def _stop(child: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (the launchers stop their own children on it), SIGKILL
    if it outlives ``STOP_GRACE_S`` or a second Ctrl-C comes."""
    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(timeout=STOP_GRACE_S)
    except ProcessLookupError:
        return
    except (subprocess.TimeoutExpired, KeyboardInterrupt, SystemExit):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        child.wait()


def stop_on_sigterm() -> None:
    """SIGTERM and SIGHUP (a closed terminal) raise SystemExit in the main thread, so
    :func:`run_all` stops the running child (and the manifest keeps what finished) instead of
    leaving it orphaned in its own session."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))


def run_all(planned: list[Planned], suite_dir: Path, *, env: dict[str, str] | None = None,
            share_gpus: bool = False, progress_out: TextIO | None = None) -> dict[str, str]:
    """Train every planned run not yet finished; {name: COMPLETED | FAILED (log path)}; the
    progress line goes to ``progress_out`` (default: sys.stderr as it is when called)."""
    suite_dir.mkdir(parents=True, exist_ok=True)
    (suite_dir / "logs").mkdir(exist_ok=True)
    manifest = read_manifest(str(suite_dir))
    progress = Progress(len(planned), sum(_work(p) for p in planned), progress_out or sys.stderr)
    states: dict[str, str] = {}
    for p in planned:
        folder = suite_dir / p.name
        if run_finished(str(folder)):
            states[p.name] = "COMPLETED"
            manifest[p.name] = _entry(p, folder, "COMPLETED")
            progress.finished(p, None, "finished before, reused")
            continue
        manifest[p.name] = _entry(p, folder, "RUNNING")
        write_manifest(str(suite_dir), manifest)
        log = suite_dir / "logs" / f"{p.name}.log"
        began = time.monotonic()
        with open(log, "ab") as f:
            child = subprocess.Popen(command(p, folder, share_gpus=share_gpus), stdout=f, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
            try:
                while child.poll() is None:
                    progress.show(p, current_step(folder), time.monotonic() - began)
                    try:
                        child.wait(timeout=POLL_SECONDS)
                    except subprocess.TimeoutExpired:
                        pass
            except BaseException:  # Ctrl-C or SIGTERM: the run stops with the suite, resumable
                _stop(child)
                raise
        seconds = time.monotonic() - began
        ok = child.returncode == 0 and run_finished(str(folder))
        states[p.name] = "COMPLETED" if ok else "FAILED"
        manifest[p.name] = _entry(p, folder, states[p.name])
        write_manifest(str(suite_dir), manifest)
        progress.finished(p, seconds if ok else None,
                          "done" if ok else f"FAILED (exit {child.returncode}); see {log}")
    return states
