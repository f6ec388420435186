"""The local SLURM fixture runs real jobs: multi-task srun, arrays, failure, scancel and requeue.

Job outputs go to tmp_path; every wait polls the controller, none sleeps a fixed time, and
every deadline is only a hang timeout (HANG_S).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from progress import FolderProgress

pytestmark = pytest.mark.timeout(600)
HANG_S = 120


def _out(tmp_path, name: str) -> str:
    return f"--output={tmp_path / name}"


def test_multi_task_job_and_array(slurm, tmp_path):
    job = slurm.sbatch(
        "--ntasks=2", "--time=2", _out(tmp_path, "ranks.out"), "--wrap", "srun bash -c 'echo rank=$SLURM_PROCID'"
    )
    array = slurm.sbatch(
        "--array=0-2",
        "--time=2",
        "--partition=long",
        _out(tmp_path, "arr_%A_%a.out"),
        "--wrap",
        "echo task=$SLURM_ARRAY_TASK_ID",
    )
    states = slurm.wait_jobs_done([job, array], timeout=HANG_S)
    assert states == {job: "COMPLETED", **{f"{array}_{i}": "COMPLETED" for i in range(3)}}
    assert sorted((tmp_path / "ranks.out").read_text().split()) == ["rank=0", "rank=1"]
    for i in range(3):
        assert (tmp_path / f"arr_{array}_{i}.out").read_text().split() == [f"task={i}"]
    assert slurm.job_state(f"{array}_1") == "COMPLETED"


def test_nonzero_exit_is_failed(slurm, tmp_path):
    job = slurm.sbatch("--time=2", _out(tmp_path, "fail.out"), "--wrap", "exit 3")
    assert slurm.wait_jobs_done([job], timeout=HANG_S) == {job: "FAILED"}
    sacct = slurm.run(["sacct", "-o", "JobID,State,NodeList", "--parsable2", "-j", job]).stdout
    assert sacct.splitlines() == ["JobID|State|NodeList", f"{job}|FAILED|localhost"]


def test_scancel_running_job(slurm, tmp_path):
    job = slurm.sbatch("--time=2", _out(tmp_path, "cancel.out"), "--wrap", "sleep 100")
    slurm.wait_state(job, ["RUNNING"], timeout=HANG_S)
    slurm.run(["scancel", job])
    assert slurm.wait_jobs_done([job], timeout=HANG_S) == {job: "CANCELLED"}


def test_a_job_wait_fails_when_its_run_stops_writing_and_not_while_it_writes(slurm, tmp_path):
    """The hang timeout of a training job's wait (tests/progress.py): a job that keeps writing
    is waited for past the quiet time, a silent one fails once the quiet time has passed."""
    writes, silent = tmp_path / "writes.out", tmp_path / "silent.out"
    job = slurm.sbatch(
        "--time=2", f"--output={writes}", "--wrap", "for i in $(seq 18); do echo line $i; sleep 0.5; done"
    )  # 9 s, a line every 0.5 s
    assert _poll(lambda: writes.exists() and "line 1" in writes.read_text())
    assert slurm.wait_jobs_done([job], progress=FolderProgress(6, writes)) == {job: "COMPLETED"}
    job = slurm.sbatch("--time=2", f"--output={silent}", "--wrap", "echo started; sleep 100")
    assert _poll(lambda: silent.exists() and "started" in silent.read_text())
    with pytest.raises(TimeoutError, match=r"nothing under .*silent\.out changed for 2 s"):
        slurm.wait_jobs_done([job], progress=FolderProgress(2, silent))
    slurm.run(["scancel", job])
    assert slurm.wait_jobs_done([job], timeout=HANG_S) == {job: "CANCELLED"}


def test_requeue_runs_job_again(slurm, tmp_path):
    out = tmp_path / "requeue.out"
    script = 'echo restart=${SLURM_RESTART_COUNT:-0}; [ "${SLURM_RESTART_COUNT:-0}" = 0 ] && sleep 100; true'
    job = slurm.sbatch("--requeue", "--open-mode=append", "--time=2", f"--output={out}", "--wrap", script)
    slurm.wait_state(job, ["RUNNING"], timeout=HANG_S)
    assert _poll(lambda: out.exists() and "restart=0" in out.read_text())
    slurm.run(["scontrol", "requeue", job])
    assert slurm.wait_jobs_done([job], timeout=HANG_S) == {job: "COMPLETED"}
    runs = [line for line in out.read_text().splitlines() if line.startswith("restart=")]
    assert runs == ["restart=0", "restart=1"]
    assert "DUE TO JOB REQUEUE" in out.read_text()


def _poll(check, timeout: float = HANG_S) -> bool:
    """Wait for something only the job's output shows (that the script really began)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


OWNER = """
import json, signal, sys
from pathlib import Path
from slurm_cluster import LocalSlurm
cluster = LocalSlurm(Path(sys.argv[1]), cpus=1)
cluster.start()
job = cluster.sbatch("--time=5", "--output=/dev/null", "--wrap", "sleep 300")
cluster.wait_state(job, ["RUNNING"], timeout=120)
print(json.dumps([*cluster._pids.values(), *cluster._leftover_pids()]), flush=True)
signal.pause()
"""


def test_a_killed_owner_leaves_no_daemon_or_job_of_its_cluster_behind(tmp_path_factory):
    """A suite killed by SIGKILL runs no fixture finalizer: the cluster's reaper stops its
    daemons and its running job (the daemons fork themselves away from the suite)."""
    from slurm_cluster import LocalSlurm, _wait_until, ensure_slurm_installed, pid_alive

    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(f"no local SLURM: {reason}")
    root = tmp_path_factory.mktemp("reap")  # short: SLURM's socket paths under it have 108 bytes
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(root)], cwd=Path(__file__).parent, stdout=subprocess.PIPE, text=True
    )
    try:
        pids = json.loads(owner.stdout.readline() or "[]")
        assert len(pids) >= 4, "munged, slurmctld, slurmd and the job's processes"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert _wait_until(lambda: not any(pid_alive(p) for p in pids), HANG_S), (
            root / "log" / "reaper.log"
        ).read_text()
        assert "stopping the cluster" in (root / "log" / "reaper.log").read_text()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        LocalSlurm(root, cpus=1).stop()  # whatever the reaper missed, by PID
