"""Stop on request (muloco.components.preemption), as a job script asks for it: the run writes a checkpoint
where it stands, exits 75, and the same command resumes from that checkpoint. A DDP run stops
after the step in progress; K=2 DiLoCo groups (the local launcher) stop at their next sync, both
at the same one, and end with one θ_g."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import QUIET_S, REPO, TINY, read_metrics
from progress import FolderProgress, until
from replicas import summary

pytestmark = pytest.mark.timeout(900)
RUN = [*TINY, "--metrics.log_freq", "1", "--checkpoint.interval", "1000", "--validator.freq", "1000"]


def _start(cmd: list[str], stop_file: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MULOCO_STOP_FILE": str(stop_file)}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, log: Path) -> int:
    """The run's exit status; a run whose log stops growing for QUIET_S seconds is hung."""
    try:
        until(
            "the run did not exit",
            lambda: proc.poll() is not None,
            progress=FolderProgress(QUIET_S, log),
            detail=lambda: log.read_text()[-3000:],
        )
        return proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _logged_steps(folder: Path) -> list[int]:
    return [r["step"] for r in read_metrics(folder) if "loss" in r] if (folder / "metrics.jsonl").exists() else []


def test_a_ddp_run_asked_to_stop_checkpoints_the_step_it_is_at_and_resumes_there(tmp_path):
    run, stop, log = tmp_path / "run", tmp_path / "stop", tmp_path / "log"
    cmd = [
        sys.executable,
        "-m",
        "muloco.train",
        "--config",
        "ddp/adamw",
        *RUN,
        "--training.steps",
        "400",
        "--dump_folder",
        str(run),
    ]
    proc = _start(cmd, stop, log)
    until(
        "step 3",
        lambda: max(_logged_steps(run), default=0) >= 3 or proc.poll() is not None,
        progress=FolderProgress(QUIET_S, log),
    )
    stop.touch()
    assert _finish(proc, log) == 75, log.read_text()[-3000:]
    stopped_at = max(_logged_steps(run))
    assert [p.name for p in (run / "checkpoint").iterdir()] == [f"step-{stopped_at}"]  # the step it was at
    assert not (run / "summary.json").exists() and stopped_at < 400
    assert f"stopped on request at step {stopped_at}" in log.read_text()
    stop.unlink()
    cmd[cmd.index("400")] = str(stopped_at + 3)  # the same command, shortened: it resumes, then ends
    proc = _start(cmd, stop, log)
    assert _finish(proc, log) == 0, log.read_text()[-3000:]
    assert (
        f"checkpoint/step-{stopped_at}" in log.read_text()
        and f"Training starts at step {stopped_at + 1}" in log.read_text()
    )


def test_diloco_groups_asked_to_stop_checkpoint_at_their_next_sync_and_resume(tmp_path):
    run, stop, log = tmp_path / "run", tmp_path / "stop", tmp_path / "log"
    cmd = [
        sys.executable,
        "-m",
        "muloco.launch.local",
        "--config",
        "diloco/muloco",
        "--replicas",
        "2",
        "--",
        *RUN,
        "--outer.sync_every",
        "4",
        "--training.steps",
        "400",
        "--dump_folder",
        str(run),
    ]
    proc = _start(cmd, stop, log)
    until(
        "step 5",
        lambda: max(_logged_steps(run / "replica_0"), default=0) >= 5 or proc.poll() is not None,
        progress=FolderProgress(QUIET_S, log),
    )
    stop.touch()
    assert _finish(proc, log) == 75, log.read_text()[-3000:]
    assert "local job stopped on request" in log.read_text()
    steps = [[p.name for p in (run / f"replica_{r}" / "checkpoint").iterdir()] for r in (0, 1)]
    assert steps[0] == steps[1] and len(steps[0]) == 1  # both groups at the same sync
    at = int(steps[0][0].split("-")[1])
    assert at % 4 == 0 and at >= 8
    stop.unlink()
    cmd[cmd.index("400")] = str(at + 4)
    proc = _start(cmd, stop, log)
    assert _finish(proc, log) == 0, log.read_text()[-3000:]
    a, b = summary(run, 0), summary(run, 1)
    assert a["steps"] == b["steps"] == at + 4
    assert a["diloco"]["final_global_sha256"] == b["diloco"]["final_global_sha256"]
