"""No orphans: whatever happens to the launcher, nothing it started outlives it.

The launcher runs as a real process (``tests/launch_sleeper_job.py``: the CLI with sleeping
replicas, each with a sleeping child of its own, like a data loader worker). Every process
of the run is recorded by PID before the launcher is killed; cleanup kills only those PIDs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from progress import until

from muloco.launch.parent_death import die_with_launcher

REPO = Path(__file__).resolve().parents[1]
SLEEPER_JOB = REPO / "tests" / "launch_sleeper_job.py"
HANG_S = 240
"""Only a hang timeout (the run's processes would sleep for an hour): starting the launcher,
the lighthouse and torchrun, which import torch, can take 30 s and more on one busy core."""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc are Linux")


def state(pid: int) -> str | None:
    """The /proc state letter, None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """Running; a zombie is dead (it only waits for a parent to reap it)."""
    return state(pid) not in (None, "Z", "X")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def command_of(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def children_of(ppid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == ppid:
                found.append(int(entry))
    return found


class SleeperJob:
    """The launcher with K sleeping replicas; ``pids()`` is every process of the run."""

    def __init__(self, tmp: Path, replicas: int = 2):
        self.pid_dir = tmp / "pids"
        self.pid_dir.mkdir()
        self.out = tmp / "launcher.txt"
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(SLEEPER_JOB),
                    str(self.pid_dir),
                    "--replicas",
                    str(replicas),
                    "--log-dir",
                    str(tmp / "logs"),
                ],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.replicas = replicas
        self.run_pids: set[int] = set()

    def wait_until_up(self, timeout: float = HANG_S) -> None:
        """Until every replica recorded itself and its child; then record the rank processes
        that torchrun started them through, and the launcher's direct children (torchrun
        agents, watchdog)."""

        def up():
            assert self.proc.poll() is None, self.out.read_text()
            return len(os.listdir(self.pid_dir)) >= self.replicas

        until("every replica to record itself and its child", up, timeout, detail=self.out.read_text)
        for name in os.listdir(self.pid_dir):
            replica, child = map(int, name.split("-"))
            self.run_pids.update((replica, child, parent_of(replica)))
        self.direct = children_of(self.proc.pid)
        self.run_pids.update(self.direct)

    def survivors(self, within_s: float = HANG_S) -> tuple[list[int], float]:
        """PIDs of the run still alive after waiting up to ``within_s`` (they would sleep for an
        hour), and the time waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < within_s:
            left = [p for p in self.run_pids if alive(p)]
            if not left:
                break
            time.sleep(0.01)
        return left, time.monotonic() - t0

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(HANG_S)
        for pid in self.run_pids:  # only the processes of this run, by PID
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(900)
def test_sigkilled_launcher_takes_every_process_with_it(tmp_path):
    job = SleeperJob(tmp_path)
    try:
        job.wait_until_up()
        # 2 torchrun agents + the watchdog (the lighthouse is a thread of the launcher); per
        # replica its rank process, the replica and the replica's own child
        assert len(job.direct) == 3 and len(job.run_pids) == 9, (job.direct, job.run_pids)
        assert all(alive(p) for p in job.run_pids)
        os.kill(job.proc.pid, signal.SIGKILL)
        assert job.proc.wait(HANG_S) == -signal.SIGKILL
        left, waited = job.survivors()
        print(f"\nlauncher SIGKILLed: all {len(job.run_pids)} processes of the run gone after {waited * 1000:.0f} ms")
        assert not left, {p: state(p) for p in left}
        for log in ("replica_0.log", "replica_1.log", "lighthouse.log"):  # the run's logs say why they stop
            last = (tmp_path / "logs" / log).read_text().splitlines()[-1]
            assert f"the launcher (pid {job.proc.pid}) died without stopping the run" in last, (log, last)
            assert "its watchdog kills the 2 process group(s) still running" in last
    finally:
        job.cleanup()


@pytest.mark.timeout(900)
def test_sigterm_stops_everything_and_the_watchdog_leaves_quietly(tmp_path):
    job = SleeperJob(tmp_path)
    try:
        job.wait_until_up()
        job.proc.send_signal(signal.SIGTERM)
        assert job.proc.wait(HANG_S) == 143, job.out.read_text()
        left, _ = job.survivors()
        assert not left, {p: state(p) for p in left}
        assert "local job stopped: interrupted (exit 143)" in job.out.read_text()
    finally:
        job.cleanup()


@pytest.mark.timeout(900)
def test_a_sigkilled_torchrun_agent_takes_its_ranks_with_it(tmp_path):
    """torchrun starts ranks in sessions of their own and cannot stop them once SIGKILLed:
    each rank runs under muloco.launch.rank_process, which kills its group when the agent
    dies. The launcher then fails the job with the agent's status and stops the rest."""
    job = SleeperJob(tmp_path)
    try:
        job.wait_until_up()
        agents = [p for p in job.direct if "muloco.launch.replica_group" in command_of(p)]
        assert len(agents) == 2, [command_of(p) for p in job.direct]
        os.kill(agents[0], signal.SIGKILL)
        assert job.proc.wait(HANG_S) == 128 + signal.SIGKILL, job.out.read_text()
        left, _ = job.survivors()
        assert not left, {p: (state(p), command_of(p)) for p in left}
        assert "exited with signal SIGKILL" in job.out.read_text()
    finally:
        job.cleanup()


@pytest.mark.timeout(600)
def test_a_child_whose_launcher_died_before_it_was_armed_exits(monkeypatch):
    """The launcher can die between fork and prctl; then no signal would ever come, so the
    child checks that its parent is still the launcher and exits if not."""
    ok = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=die_with_launcher(), timeout=HANG_S)
    assert ok.returncode == 0
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: 1)  # "the launcher" is someone else than our parent
        arm = die_with_launcher()
    orphaned = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=arm, timeout=HANG_S)
    assert orphaned.returncode == 1
