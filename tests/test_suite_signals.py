"""The suite stops every process it started when it is terminated (SIGTERM: a CI time limit, a
``kill``), as when interrupted with Ctrl-C: tests/conftest.py turns SIGTERM into an interrupt
that the xdist workers receive too, so each test's ``finally`` runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import QUIET_S, REPO


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_terminated_suite_stops_the_processes_its_tests_started(tmp_path):
    """As CI runs it, on two xdist workers (the controller passes SIGTERM on to them)."""
    workers = "2"
    pids = tmp_path / "pids"
    pids.mkdir()
    suite = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers, "tests/sigterm_target.py"],
        cwd=REPO,
        env={**os.environ, "SIGTERM_TARGET_PIDS": str(pids)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    children: list[int] = []
    try:
        last, seen = time.monotonic(), 0
        while len(children) < 2:  # both tests are running, each with its child (watchdog: no progress)
            children = [int(p.name.split("-")[1]) for p in pids.iterdir()]
            if len(children) != seen:
                last, seen = time.monotonic(), len(children)
            assert suite.poll() is None and time.monotonic() - last < QUIET_S, suite.stdout.read()
            if workers == "0" and len(children) == 1:
                break  # one test at a time: the first one runs
            time.sleep(0.05)
        suite.send_signal(signal.SIGTERM)
        out, _ = suite.communicate(timeout=QUIET_S)
        assert suite.returncode != 0 and "KeyboardInterrupt" in out, out
        assert not [pid for pid in children if _alive(pid)], out
    finally:
        if suite.poll() is None:
            os.killpg(suite.pid, signal.SIGKILL)
            suite.wait()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
