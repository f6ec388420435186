"""Run a suite's runs one after another on this machine, resumably, with a live progress line.

Each run is the project's own launcher, run as a sweep's ``--local`` runs are
(:mod:`muloco.launch.sweeps.local_runs`: a job of submitit's LocalExecutor): ``python -m muloco.train``
for a DDP row (one replica group), ``python -m muloco.launch.local`` for K replica groups (it
starts the lighthouse and the groups), with ``--dump_folder <suite>/<name>``; its output goes to
``<suite>/logs/<name>.log``. A run whose folder holds its summaries is finished and reused; a
run interrupted part-way is started again with the same command and resumes from its last
checkpoint. Ctrl-C, SIGTERM or a closed terminal stops the current run with the suite (its
launcher stops its own processes), so nothing keeps training behind an interrupted suite. The
suite's ``manifest.jsonl`` (the sweep's format: name, config, overrides, run folder, local job
ids, state) is kept by :class:`LocalRuns` as each run starts and ends, so ``python -m
muloco.report`` and ``muloco.launch.sweeps --status``-style readers see the same runs. One
compare holds the suite folder at a time (its lock, as a run holds its dump folder).

The progress line (stderr; rewritten in place on a terminal, a line per tenth of a run
otherwise) says runs done of total, the current run's step, and the time left, estimated
from the seconds per sequence trained so far in this invocation (a resumed run's steps from
before the resume are not counted as trained in no time).
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from muloco.compare.suites import Planned
from muloco.launch.sweeps.local_runs import LocalRuns, RunEvent, local_command
from muloco.runs.manifest import complete_steps
from muloco.runs.sweep_manifest import Entry, read_manifest, run_finished, write_manifest


def command(p: Planned, folder: Path, *, share_gpus: bool = False) -> list[str]:
    """The command that trains ``p`` into ``folder``; ``share_gpus`` lets its replica groups
    share the machine's GPUs (fewer GPUs than groups)."""
    return local_command(
        "ddp" if p.row.ddp else "groups",
        p.row.config,
        [*p.overrides, "--dump_folder", str(folder)],
        replicas=p.row.replicas,
        share_gpus=share_gpus and not p.row.ddp,
    )


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


def resume_step(folder: Path) -> int:
    """The step a run picks up from when started again: the newest complete checkpoint (of a
    DiLoCo run: the oldest of its groups' newest), 0 without one."""
    groups = sorted(folder.glob("replica_*")) or [folder]
    newest = [(complete_steps(str(g / "checkpoint")) or [0])[-1] for g in groups]
    return min(newest)


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

    def show(self, p: Planned, step: int, elapsed: float, from_step: int = 0) -> None:
        """``from_step``: where this invocation picked the run up (its newest complete checkpoint
        before a resume); only the steps after it were trained in ``elapsed``."""
        steps = p.steps
        work_now = _work(p) * step // max(steps, 1)
        left = self.total_work - self.done_work - work_now
        trained_now = _work(p) * max(step - from_step, 0) // max(steps, 1)
        eta = self._left(left, self.measured_work + trained_now, self.measured_seconds + elapsed)
        line = f"[{self.done_runs}/{self.total_runs} runs done] {p.row.label} seed {p.seed}: step {step}/{steps}, {eta}"
        if self.out.isatty():
            self.out.write("\r\033[K" + line)
        else:
            decile = 10 * step // max(steps, 1)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.out.write(line + "\n")
        self.out.flush()

    def finished(self, p: Planned, seconds: float | None, state: str, from_step: int = 0) -> None:
        self.done_runs += 1
        self.done_work += _work(p)
        if seconds is not None:
            self.measured_work += _work(p) * max(p.steps - from_step, 0) // max(p.steps, 1)
            self.measured_seconds += seconds
        self._last_decile = -1
        prefix = "\r\033[K" if self.out.isatty() else ""
        took = f" in {int(seconds // 60)}m{int(seconds % 60):02d}s" if seconds is not None else ""
        self.out.write(
            f"{prefix}[{self.done_runs}/{self.total_runs} runs done] {p.row.label} seed {p.seed}: {state}{took}\n"
        )
        self.out.flush()


def _entry(p: Planned, folder: Path, state: str, jobs: list[str]) -> Entry:
    kind = "ddp" if p.row.ddp else "groups"
    return Entry(
        name=p.name,
        kind=kind,
        config=p.row.config,
        overrides=p.overrides,
        options={"replicas": p.row.replicas, "label": p.row.label, "seed": p.seed},
        run_dir=str(folder),
        jobs=jobs,
        state=state,
    )


def stop_on_sigterm() -> None:
    """SIGTERM and SIGHUP (a closed terminal) raise SystemExit in the main thread, so
    :func:`run_all` stops the running child (and the manifest keeps what finished) instead of
    leaving it orphaned in its own session."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))


def run_all(
    planned: list[Planned],
    suite_dir: Path,
    *,
    extra_env: dict[str, str] | None = None,
    share_gpus: bool = False,
    progress_out: TextIO | None = None,
) -> dict[str, str]:
    """Train every planned run not yet finished (with ``extra_env`` set on top of this process's
    environment); {name: COMPLETED | FAILED (log path)}; the progress line goes to
    ``progress_out`` (default: sys.stderr as it is when called)."""
    suite_dir.mkdir(parents=True, exist_ok=True)
    (suite_dir / "logs").mkdir(exist_ok=True)
    manifest = read_manifest(str(suite_dir))
    progress = Progress(len(planned), sum(_work(p) for p in planned), progress_out or sys.stderr)
    states: dict[str, str] = {}
    todo: list[Planned] = []
    entries: dict[str, Entry] = {}
    for p in planned:
        folder = suite_dir / p.name
        jobs = list(manifest[p.name].jobs) if p.name in manifest else []  # every earlier job of the run
        if run_finished(str(folder)):
            states[p.name] = "COMPLETED"
            manifest[p.name] = _entry(p, folder, "COMPLETED", jobs)
            progress.finished(p, None, "finished before, reused")
            continue
        entries[p.name] = _entry(p, folder, "NEW", jobs)
        todo.append(p)
    by_name = {p.name: p for p in todo}
    picked_up_at = {p.name: resume_step(suite_dir / p.name) for p in todo}  # > 0: a resume

    def record(event: RunEvent) -> None:  # its manifest line is kept by LocalRuns
        if event.state not in ("COMPLETED", "FAILED"):
            return
        p = by_name[event.name]
        states[p.name] = event.state
        ok = event.state == "COMPLETED"
        progress.finished(
            p,
            event.seconds if ok else None,
            "done"
            if ok
            else f"FAILED ({event.error or 'no summary written'}); see {suite_dir / 'logs' / f'{p.name}.log'}",
            from_step=picked_up_at[p.name],
        )

    def watch(event: RunEvent) -> None:
        p = by_name[event.name]
        progress.show(p, current_step(suite_dir / p.name), event.seconds, from_step=picked_up_at[p.name])

    if todo:
        runs = LocalRuns(str(suite_dir), 1, manifest, record, say=lambda _: None, extra_env=extra_env)
        try:
            runs.run(
                [(entries[p.name], command(p, suite_dir / p.name, share_gpus=share_gpus)) for p in todo], watch=watch
            )
        except BaseException:  # Ctrl-C, SIGTERM: the running run was stopped where it stood
            print(
                f"\nstopped after {sum(s == 'COMPLETED' for s in states.values())} of {len(planned)} runs; the same "
                "command again reuses the finished ones and resumes the stopped run from its last checkpoint",
                file=progress_out or sys.stderr,
            )
            raise
    write_manifest(str(suite_dir), manifest)
    return states
