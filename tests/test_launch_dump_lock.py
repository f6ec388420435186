"""One live run per dump folder: the lock module, and the launcher refusing a held folder."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_watched

from muloco.launch.local import LocalJob
from muloco.runs.lock import LOCK_NAME, DumpFolderBusy, DumpFolderLock
from muloco.utils.created_dirs import make_dirs

REPO = Path(__file__).resolve().parents[1]
HOLDER = REPO / "tests" / "launch_lock_holder.py"


def alive(pid: int) -> bool:
    """Running (a zombie is dead: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


class Holder:
    """A separate process holding ``folder``'s lock, with a child of its own; killed by PID."""

    def __init__(self, folder: Path):
        self.proc = subprocess.Popen(
            [sys.executable, str(HOLDER), str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline()
        assert line, "the lock holder did not start"
        self.pid, self.child = map(int, line.split())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(120)

    def cleanup(self) -> None:
        self.kill()
        if alive(self.child):
            os.kill(self.child, signal.SIGKILL)


def snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every path under ``folder`` with size, mtime and content: 'nothing was written'."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
        for p in sorted(folder.rglob("*"))
    }


# -- the module ------------------------------------------------------------------------------


def test_lock_records_its_holder_and_release_removes_it(tmp_path):
    folder = tmp_path / "run"
    with DumpFolderLock(folder) as lock:
        data = json.loads((folder / LOCK_NAME).read_text())
        assert (data["pid"], data["host"]) == (os.getpid(), socket.gethostname())
        assert data["started"][:4].isdigit() and lock.stale is None and lock.held
        assert not os.get_inheritable(lock._fd)  # children never keep it alive
    assert not (folder / LOCK_NAME).exists() and folder.is_dir()
    DumpFolderLock(folder).acquire().release()  # free again


def test_second_lock_is_refused_without_touching_the_folder(tmp_path):
    folder = tmp_path / "run"
    first = DumpFolderLock(folder).acquire()
    try:
        before = snapshot(folder)
        with pytest.raises(DumpFolderBusy) as err:
            DumpFolderLock(folder).acquire()
        msg = str(err.value)
        assert msg == (
            f"dump folder {folder} is in use by PID {os.getpid()} on "
            f"{socket.gethostname()} (started {json.loads((folder / LOCK_NAME).read_text())['started']}): "
            f"stop that run (kill {os.getpid()}) or pass another --dump_folder"
        )
        assert err.value.holder.pid == os.getpid()
        assert snapshot(folder) == before
    finally:
        first.release()


@pytest.mark.timeout(300)
def test_lock_of_a_live_process_then_of_a_sigkilled_one_is_stale(tmp_path):
    """The kernel drops the flock of a SIGKILLed holder, even while its child still runs."""
    folder = tmp_path / "run"
    holder = Holder(folder)
    try:
        with pytest.raises(DumpFolderBusy, match=f"in use by PID {holder.pid} on .*kill {holder.pid}"):
            DumpFolderLock(folder).acquire()
        holder.kill()
        assert alive(holder.child)  # its child lives on, without the lock
        lock = DumpFolderLock(folder).acquire()
        assert lock.stale is not None and lock.stale.pid == holder.pid
        assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.release()
    finally:
        holder.cleanup()


def test_unreadable_leftover_is_taken_over_silently(tmp_path):
    (tmp_path / LOCK_NAME).write_text("garbage")
    lock = DumpFolderLock(tmp_path).acquire()
    assert lock.stale is None
    lock.release()


def test_release_can_remove_the_folders_acquire_created(tmp_path):
    (tmp_path / "kept").mkdir()
    lock = DumpFolderLock(tmp_path / "kept" / "a" / "b").acquire()
    assert lock.created_dirs == [str(tmp_path / "kept" / "a"), str(tmp_path / "kept" / "a" / "b")]
    lock.release(remove_created=True)
    assert sorted(os.listdir(tmp_path)) == ["kept"] and os.listdir(tmp_path / "kept") == []

    lock = DumpFolderLock(tmp_path / "c").acquire()
    (tmp_path / "c" / "someone-elses").write_text("x")
    lock.release(remove_created=True)  # not empty: kept
    assert sorted(os.listdir(tmp_path / "c")) == ["someone-elses"]
    assert make_dirs(tmp_path / "c") == []


# -- the launcher ----------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_launcher_refuses_a_folder_a_live_run_holds(tmp_path):
    """The real CLI (config parsed first): exit 2, one line naming the holder, nothing written."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("{}\n")
    holder = Holder(folder)
    try:
        before = snapshot(folder)
        res = run_watched(
            [
                sys.executable,
                "-m",
                "muloco.launch.local",
                "--config",
                "diloco/diloco",
                "--",
                "--dump_folder",
                str(folder),
            ],
            cwd=REPO,
        )
        assert res.returncode == 2, res.stdout + res.stderr
        assert res.stdout.splitlines() == [
            f"local job failed: dump folder {folder} is in use by PID {holder.pid} on "
            f"{socket.gethostname()} (started {json.loads((folder / LOCK_NAME).read_text())['started']}): "
            f"stop that run (kill {holder.pid}) or pass another --dump_folder"
        ]
        assert snapshot(folder) == before  # no logs, no lighthouse, lock file untouched
    finally:
        holder.cleanup()


@pytest.mark.timeout(600)
def test_launcher_takes_over_the_lock_of_a_killed_run(tmp_path):
    folder = tmp_path / "run"
    holder = Holder(folder)
    try:
        holder.kill()
        console = io.StringIO()
        job = LocalJob(
            command=[sys.executable, "-c", "print('ok')"],
            replicas=1,
            overrides=["--dump_folder", str(folder)],
            console=console,
        )
        assert job.run() == 0, console.getvalue()
        out = console.getvalue()
        assert f"local job: taking over a stale lock left by PID {holder.pid}\n" in out
        assert "[r0] ok" in out and (folder / "logs" / "replica_0.log").exists()
        assert not (folder / LOCK_NAME).exists()  # released at the end
    finally:
        holder.cleanup()


@pytest.mark.timeout(600)
def test_refused_launch_removes_what_it_created(tmp_path):
    """Bad input found after the lock (the lighthouse's port is taken): the new dump folder is
    gone again; a folder that existed keeps exactly its old content."""
    fresh, old = tmp_path / "new" / "run", tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("mine")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for folder in (fresh, old):
            console = io.StringIO()
            job = LocalJob(
                command=[sys.executable, "-c", "pass"],
                replicas=1,
                console=console,
                overrides=["--dump_folder", str(folder)],
                lighthouse_bind=f"127.0.0.1:{port}",
            )
            assert job.run() == 2
            failed = [ln for ln in console.getvalue().splitlines() if ln.startswith("local job failed")]
            assert failed == [
                f"local job failed: the lighthouse refused to start: port {port} on "
                f"127.0.0.1 is already in use (another lighthouse or job?): stop it, "
                f"or pass --bind 127.0.0.1:OTHER_PORT (port 0 picks a free one)"
            ]
            assert job.pids == []
    assert not (tmp_path / "new").exists()
    assert snapshot(old) == {"keep.txt": (4, (old / "keep.txt").stat().st_mtime_ns, b"mine")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(300)
def test_lock_is_not_inherited_by_children(tmp_path):
    """A child started while the lock is held has no descriptor of the lock file."""
    lock = DumpFolderLock(tmp_path / "run").acquire()
    code = textwrap.dedent("""
        import os
        for fd in os.listdir("/proc/self/fd"):
            try:
                print(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
    """)
    try:
        out = run_watched([sys.executable, "-c", code]).stdout.splitlines()
        assert out and str(tmp_path / "run" / LOCK_NAME) not in out
    finally:
        lock.release()
