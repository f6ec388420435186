"""Multi-process DiLoCo runs for tests: a lighthouse process and K replica-group processes.

Every process is started in its own session and killed by PID when the test ends,
whatever happened. A wait on a process fails when its log stops growing for HANG_S seconds (a
hang), never because the wait is long: starting a process that imports torch takes 30 s and more
on one busy core, and a loaded machine slows every line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, TINY
from progress import HANG_S, FolderProgress, until  # noqa: F401 - HANG_S: the tests take it from here too

from muloco.utils.ports import free_ports

DRILL_ENTRY = [sys.executable, str(REPO / "tests" / "drill_train.py")]

DILOCO_TINY = [
    *TINY,
    "--metrics.log_freq",
    "5",
    "--metrics.no-enable-tensorboard",
    "--outer.fingerprint",
]


class Cluster:
    """A lighthouse and replica groups on this machine, one process per group."""

    def __init__(
        self,
        tmp: Path,
        k: int,
        heartbeat_timeout_ms: int = 1000,
        join_timeout_ms: int = 60000,
        min_replicas: int | None = None,
    ):
        self.tmp, self.k = tmp, k
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.ports = dict(enumerate(free_ports(k)))
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.join_timeout_ms = join_timeout_ms
        self.min_replicas = min_replicas or k // 2 + 1  # a majority, as the launcher does
        self.url = ""

    def start_lighthouse(self) -> str:
        cmd = [
            sys.executable,
            "-m",
            "muloco.launch.lighthouse",
            "--bind",
            "127.0.0.1:0",
            "--min_replicas",
            str(self.min_replicas),
            "--join_timeout_ms",
            str(self.join_timeout_ms),
            "--heartbeat_timeout_ms",
            str(self.heartbeat_timeout_ms),
        ]
        proc = self._spawn("lighthouse", cmd, {})

        def listening():
            assert proc.poll() is None, (
                f"the lighthouse exited {proc.returncode}: {self.logs['lighthouse'].read_text()}"
            )
            return re.search(r"listening on (http://\S+)", self.logs["lighthouse"].read_text())

        until("the lighthouse to listen", listening, detail=lambda: self.logs["lighthouse"].read_text())
        self.url = listening().group(1)
        return self.url

    def start_replica(
        self, i: int, args: list[str], tag: str | None = None, env: dict | None = None, entry: list[str] | None = None
    ) -> subprocess.Popen:
        """Replica group ``i`` (one process): the trainer, or ``entry`` (e.g. the drill wrapper)."""
        env = {
            **(env or {}),
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.ports[i]),
            "TORCHFT_LIGHTHOUSE": self.url,
            "OMP_NUM_THREADS": "1",
        }
        cmd = [
            *(entry or [sys.executable, "-m", "muloco.train"]),
            *args,
            "--fault_tolerance.replica_id",
            str(i),
            "--fault_tolerance.group_size",
            str(self.k),
        ]
        return self._spawn(tag or f"r{i}", cmd, env)

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        with open(log, "w") as f:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=full_env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs[name], self.logs[name] = proc, log
        return proc

    def _progress(self, name: str, quiet_s: float):
        """A check to call while waiting on ``name``: it fails once the process's log has not
        grown for ``quiet_s`` seconds (a hang), and never because the wait as a whole is long."""
        log = FolderProgress(quiet_s, self.logs[name])

        def check(waiting_for: str) -> None:
            if log.expired():
                raise AssertionError(
                    f"{name}: no {waiting_for}, and nothing new in its log for {quiet_s:g} s (hung):\n{self.tail(name)}"
                )

        return check

    def wait_for(self, name: str, pattern: str, timeout: float) -> re.Match:
        """The first match of ``pattern`` in ``name``'s log; ``timeout``: seconds without a new line."""
        progress = self._progress(name, timeout)
        while True:
            m = re.search(pattern, self.logs[name].read_text())
            if m:
                return m
            if self.procs[name].poll() is not None:
                raise AssertionError(
                    f"{name} exited {self.procs[name].returncode} before /{pattern}/:\n{self.tail(name)}"
                )
            progress(f"/{pattern}/")
            time.sleep(0.05)

    def wait(self, name: str, timeout: float) -> int:
        """``name``'s exit status; ``timeout``: seconds without a new line in its log."""
        progress = self._progress(name, timeout)
        while self.procs[name].poll() is None:
            progress("exit")
            time.sleep(0.1)
        return self.procs[name].returncode

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)  # the process and any children, by its own group id
            if sig == signal.SIGKILL:
                proc.wait(timeout=30)

    def tail(self, name: str, n: int = 40) -> str:
        return "\n".join(self.logs[name].read_text().splitlines()[-n:])

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)


def waiting_in_quorum(url: str) -> int:
    """Replica groups in the quorum the lighthouse at ``url`` is forming now (its status page;
    -1 if it does not say): a test releases the groups it holds once a late one waits there."""
    from muloco.outer.lighthouse_status import LighthouseUnreachable, fetch_status

    try:
        status = fetch_status(url)
    except LighthouseUnreachable:
        return -1
    m = re.search(r"\[(\d+)/\d+ participants healthy\]", status.next_quorum)
    return int(m.group(1)) if m else -1


def syncs(dump: Path, replica: int) -> list[dict]:
    """The sync records of one replica's metrics.jsonl."""
    rows = [json.loads(x) for x in (dump / f"replica_{replica}" / "metrics.jsonl").read_text().splitlines()]
    return [
        {k[5:]: v for k, v in r.items() if k.startswith("sync/")} | {"at": r["step"]} for r in rows if "sync/step" in r
    ]


def losses(dump: Path, replica: int) -> dict[int, float]:
    rows = [json.loads(x) for x in (dump / f"replica_{replica}" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def summary(dump: Path, replica: int) -> dict:
    return json.loads((dump / f"replica_{replica}" / "summary.json").read_text())
