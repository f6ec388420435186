"""The lighthouse and the local launcher, with tiny `python -c` children instead of the trainer."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import run_watched
from progress import until

from muloco.launch.lighthouse import LighthouseError, parse_bind, quorum_size, start_lighthouse
from muloco.launch.local import LocalJob, job_from_args, main
from muloco.utils.command_line import UsageError
from muloco.utils.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
HANG_S = 240
"""Only a hang timeout: a process that imports torch (the lighthouse, torchrun) can take 30 s
and more to start on one busy core. Tests wait for events, never for a time."""


def py(code: str) -> list[str]:
    """A child command: a short Python script (no torch import, so it starts in ~50 ms)."""
    return [sys.executable, "-c", textwrap.dedent(code)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def make_job(tmp_path: Path, code: str, **kw) -> tuple[LocalJob, io.StringIO]:
    console = io.StringIO()
    job = LocalJob(command=py(code), log_dir=str(tmp_path / "logs"), console=console, **kw)
    return job, console


def run_in_thread(job: LocalJob) -> tuple[threading.Thread, list[int]]:
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(job.run()), daemon=True)
    t.start()
    assert job.started.wait(HANG_S), "launcher did not start"
    return t, result


# -- lighthouse ------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_lighthouse_in_process_serves_status_and_shuts_down():
    lh = start_lighthouse("127.0.0.1:0")
    try:
        assert lh.url.startswith("http://127.0.0.1:") and not lh.url.endswith(":0")
        with urllib.request.urlopen(lh.url + "/status", timeout=HANG_S) as r:
            assert r.status == 200
            assert b"quorum" in r.read().lower()
    finally:
        lh.shutdown()
    from muloco.launch.lighthouse import node_address

    lh = start_lighthouse("node:0")  # as the local launcher's --lighthouse-bind may ask
    try:
        assert lh.host == node_address() and lh.port > 0
    finally:
        lh.shutdown()


def test_lighthouse_validates_inputs_before_starting():
    for bad in ("nonsense", "127.0.0.1:99999", ":29510", "::1:29510"):
        with pytest.raises(LighthouseError, match="invalid --bind"):
            parse_bind(bad)
    assert parse_bind("[::1]:0") == ("[::1]", 0)
    with pytest.raises(LighthouseError, match="min_replicas"):
        start_lighthouse(min_replicas=0)
    with pytest.raises(LighthouseError, match="heartbeat_timeout_ms"):
        start_lighthouse(heartbeat_timeout_ms=-1)


def lighthouse_cli(*args: str) -> subprocess.CompletedProcess:
    return run_watched([sys.executable, "-m", "muloco.launch.lighthouse", *args], cwd=REPO)


@pytest.mark.timeout(600)
def test_lighthouse_cli_prints_url_line_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "muloco.launch.lighthouse", "--bind", "127.0.0.1:0", "--replicas", "2"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        host_port = line.split("http://", 1)[1].split(" ", 1)[0]
        assert line == f"lighthouse listening on http://{host_port} (status page: http://{host_port}/)"
        assert host_port.startswith("127.0.0.1:") and not host_port.endswith(":0")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_lighthouse_on_node_writes_its_url_file_over_a_stale_one(tmp_path):
    """A SLURM job's lighthouse (``--bind node:0 --url_file F``): this node's address, the URL
    in F (a URL left by an earlier start replaced), said on its line."""
    from muloco.launch.lighthouse import node_address

    url_file = tmp_path / "lighthouse-1.url"
    url_file.write_text("http://stale:1\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "muloco.launch.lighthouse",
            "--bind",
            "node:0",
            "--replicas",
            "2",
            "--url_file",
            str(url_file),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        url = url_file.read_text().strip()
        assert url.startswith(f"http://{node_address()}:") and not url.endswith(":0")
        assert line == f"lighthouse listening on {url} (status page: {url}/); URL in {url_file}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=HANG_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(600)
def test_lighthouse_cli_rejects_bad_bind_and_busy_port():
    bad = lighthouse_cli("--bind", "nonsense")
    assert bad.returncode == 2 and bad.stdout == ""
    assert len(bad.stderr.strip().splitlines()) == 1 and "--bind" in bad.stderr

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = lighthouse_cli("--bind", f"127.0.0.1:{port}", "--min_replicas", "1")
    assert res.returncode == 2
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("muloco lighthouse: error")]
    assert len(err) == 1 and f"port {port}" in err[0] and "already in use" in err[0]


def test_lighthouse_quorum_is_a_majority_of_the_replicas():
    assert [quorum_size(k, None) for k in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]
    assert quorum_size(3, 1) == 1 and quorum_size(None, 2) == 2
    with pytest.raises(LighthouseError, match="--replicas K .* or --min_replicas N"):
        quorum_size(None, None)
    with pytest.raises(LighthouseError, match="--min_replicas 4 exceeds --replicas 3"):
        quorum_size(3, 4)


@pytest.mark.timeout(600)
def test_lighthouse_cli_needs_the_replica_count_and_explains_its_join_timeout():
    res = lighthouse_cli()
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == [
        "muloco lighthouse: error: give --replicas K (the number of replica groups; a quorum is then "
        "a majority, K//2+1) or --min_replicas N (the replica groups a quorum needs)"
    ]
    help_text = " ".join(lighthouse_cli("--help").stdout.split())
    assert "(default: 270000)" in help_text and "--fault_tolerance.quorum_timeout_seconds" in help_text
    assert "heal" in help_text


@pytest.mark.timeout(600)
def test_lighthouse_cli_warns_about_a_quorum_below_a_majority():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "muloco.launch.lighthouse",
            "--bind",
            "127.0.0.1:0",
            "--replicas",
            "3",
            "--min_replicas",
            "1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().startswith("lighthouse listening on http://127.0.0.1:")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_S)
        assert [ln for ln in err.splitlines() if ln.startswith("muloco lighthouse:")] == [
            "muloco lighthouse: warning: --min_replicas 1 is below a majority of 3: two disjoint groups "
            "of replicas could both commit (split brain)"
        ]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- a rank under torchrun -------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_rank_process_ends_as_its_rank_ended():
    """torchrun sees the rank's own exit through muloco.launch.rank_process: its code, or the
    signal that killed it."""

    def rank(code: str) -> int:
        return subprocess.run(
            [sys.executable, "-m", "muloco.launch.rank_process", *py(code)],
            cwd=REPO,
            timeout=HANG_S,
            start_new_session=True,
        ).returncode

    assert rank("pass") == 0
    assert rank("import sys; sys.exit(5)") == 5
    assert rank("import os, signal; os.kill(os.getpid(), signal.SIGKILL)") == -signal.SIGKILL


@pytest.mark.timeout(300)
def test_rank_process_whose_agent_is_already_gone_kills_its_group(tmp_path):
    """Started for an agent PID that is not its parent (the agent died before the rank could
    ask for its death signal): it stops at once instead of running unsupervised."""
    env = {**os.environ, "MULOCO_AGENT_PID": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "muloco.launch.rank_process", *py(f"open({str(tmp_path / 'ran')!r}, 'w').close()")],
        cwd=REPO,
        env=env,
        timeout=HANG_S,
        start_new_session=True,
    )  # as torchrun
    assert proc.returncode == -signal.SIGKILL and not (tmp_path / "ran").exists()


# -- launcher --------------------------------------------------------------------------------


def test_cli_arguments_split_into_options_and_overrides(tmp_path, capsys):
    job = job_from_args(
        [
            "--replicas",
            "3",
            "--max-restarts",
            "1",
            "--",
            "--training.steps",
            "60",
            "--dump_folder",
            str(tmp_path / "run"),
        ]
    )
    assert (job.replicas, job.max_restarts, job.config) == (3, 1, "diloco/diloco")
    assert job.overrides == ["--training.steps", "60", "--dump_folder", str(tmp_path / "run")]
    assert job.resolved_log_dir == str(tmp_path / "run" / "logs")
    assert job.replica_command(2) == [
        sys.executable,
        "-m",
        "muloco.train",
        "--config",
        "diloco/diloco",
        "--fault_tolerance.replica_id",
        "2",
        "--fault_tolerance.group_size",
        "3",
        *job.overrides,
        "--fault_tolerance.min_replica_size",
        "2",
    ]
    assert job.trainer_config.training.steps == 60
    assert job_from_args([]).resolved_log_dir == os.path.join("./outputs/diloco", "logs")  # the config's
    assert len(set(free_ports(8))) == 8
    wrapped = LocalJob(
        entry=[sys.executable, "tests/drill_train.py"], replicas=2, overrides=["--dump_folder", str(tmp_path / "run")]
    )
    assert wrapped.replica_command(1)[:4] == [sys.executable, "tests/drill_train.py", "--config", "diloco/diloco"]
    with pytest.raises(UsageError, match=r"unknown option '--training.steps'.*trainer overrides go after `--`"):
        job_from_args(["--replicas", "3", "--training.steps", "60"])  # a trainer override before `--`
    assert main(["--max-restart", "1"]) == 2
    assert capsys.readouterr().err == (
        "muloco local: error: unknown option '--max-restart'. "
        "Closest valid options: --max-restarts, --min-replicas. See python -m "
        "muloco.launch.local --help; trainer overrides go after `--`.\n"
    )


def test_quorum_defaults_follow_the_replicas_and_the_trainer_config(tmp_path):
    dump = ["--dump_folder", str(tmp_path / "run")]
    job = job_from_args(["--replicas", "3", "--", *dump])
    assert (job.quorum_size, job.resolved_join_timeout_ms) == (2, 270_000)
    job = job_from_args(["--replicas", "5", "--", *dump, "--fault_tolerance.quorum_timeout_seconds", "100"])
    assert (job.quorum_size, job.resolved_join_timeout_ms) == (3, 90_000)
    job = job_from_args(
        [
            "--replicas",
            "3",
            "--min-replicas",
            "1",
            "--join-timeout-ms",
            "500",
            "--",
            *dump,
            "--fault_tolerance.min_replica_size",
            "3",
        ]
    )
    assert (job.quorum_size, job.resolved_join_timeout_ms) == (1, 500)
    assert job.replica_command(0)[-2:] == ["--fault_tolerance.min_replica_size", "1"]  # wins
    job = job_from_args(
        ["--replicas", "3", "--min-replicas", "0", "--", *dump, "--fault_tolerance.min_replica_size", "3"]
    )
    assert job.quorum_size == 3  # the config's own choice, given to the lighthouse too


def refused(tmp_path: Path, **kw) -> list[str]:
    """Run a job that must be refused before starting anything; its console lines."""
    console = io.StringIO()
    job = LocalJob(console=console, **kw)
    assert job.run() == 2
    assert job.lighthouse_url is None and job.pids == []
    assert not (tmp_path / "run").exists()
    return console.getvalue().splitlines()


@pytest.mark.timeout(600)
def test_launcher_refuses_a_config_without_outer_loop_once(tmp_path):
    lines = refused(
        tmp_path, config="ddp/adamw", overrides=["--training.steps", "5", "--dump_folder", str(tmp_path / "run")]
    )
    assert lines == [
        "local job failed: the local launcher runs DiLoCo replica groups; --config ddp/adamw has "
        "no outer loop: use a diloco/* config (e.g. diloco/diloco, diloco/muloco_2bit), or run it as one "
        f"group: python -m muloco.train --config ddp/adamw --training.steps 5 --dump_folder "
        f"{tmp_path / 'run'}"
    ]


@pytest.mark.timeout(600)
def test_launcher_refuses_bad_overrides_once(tmp_path):
    dump = ["--dump_folder", str(tmp_path / "run")]
    lines = refused(tmp_path, overrides=["--outer.sync_evry", "5", *dump])
    assert len(lines) == 1 and lines[0].startswith(
        "local job failed: unknown config key '--outer.sync_evry'. Closest valid keys: --outer.sync_every"
    )
    lines = refused(tmp_path, overrides=["--training.steps", "31", *dump])
    assert len(lines) == 1 and "training.steps (31) must be a multiple" in lines[0]
    lines = refused(tmp_path, replicas=2, overrides=["--fault_tolerance.group_size", "3", *dump])
    assert lines == [
        "local job failed: --fault_tolerance.group_size 3 disagrees with --replicas 2: drop it, the launcher sets it"
    ]
    lines = refused(tmp_path, replicas=3, min_replicas=4, overrides=dump)
    assert len(lines) == 1 and "--min-replicas must be between 1 and --replicas (3)" in lines[0]


# -- launcher processes (tiny children) ------------------------------------------------------


@pytest.mark.timeout(600)
def test_replicas_get_torchrun_env_and_prefixed_logs(tmp_path):
    job, console = make_job(
        tmp_path,
        """
        import os
        e = os.environ
        print("hello", *(e[k] for k in ("REPLICA_GROUP_ID", "RANK", "WORLD_SIZE", "MASTER_PORT",
              "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", "MASTER_ADDR", "LOCAL_RANK")))
    """,
        replicas=2,
        procs_per_replica=2,
    )
    assert job.run() == 0
    out = console.getvalue()
    assert "local job finished: 2 replicas ok" in out
    ports = {}
    for i in range(2):
        for rank in range(2):
            name = f"replica_{i}.log" if rank == 0 else f"replica_{i}_rank{rank}.log"
            line = next(ln for ln in (tmp_path / "logs" / name).read_text().splitlines() if ln.startswith("hello"))
            _, rid, r, ws, port, k, url, addr, lr = line.split()
            assert (rid, r, ws, k, url, addr, lr) == (
                str(i),
                str(rank),
                "2",
                "2",
                job.lighthouse_url,
                "127.0.0.1",
                str(rank),
            )
            ports.setdefault(i, set()).add(port)
            assert f"[r{i}.{rank}] {line}" in out
    assert (
        "local job: quorum = majority 2 of 2 replica groups; the lighthouse waits up to 270 s "
        "for heartbeating groups\n" in out
    )
    assert all(len(p) == 1 for p in ports.values()) and ports[0] != ports[1]
    assert (tmp_path / "logs" / "lighthouse.log").read_text().count("lighthouse listening") == 1
    assert not any(alive(p) for p in job.pids)


@pytest.mark.timeout(600)
def test_quorum_below_a_majority_is_allowed_with_a_warning(tmp_path):
    job, console = make_job(tmp_path, "pass", replicas=3, min_replicas=1, join_timeout_ms=3000)
    assert job.run() == 0
    lines = console.getvalue().splitlines()
    assert lines[:2] == [
        "local job: quorum = 1 of 3 replica groups; the lighthouse waits up to 3 s for heartbeating groups",
        "local job: warning: --min-replicas 1 is below a majority of 3: two disjoint groups of "
        "replicas could both commit (split brain)",
    ]
    assert "min_replicas 1, join_timeout_ms 3000," in (tmp_path / "logs" / "lighthouse.log").read_text()


@pytest.mark.timeout(600)
def test_failing_replica_stops_the_others(tmp_path):
    """Replica 1 would run for an hour, longer than the test waits: that the job ends at all
    is the launcher stopping it."""
    job, console = make_job(
        tmp_path,
        """
        import os, sys, time
        if os.environ["REPLICA_GROUP_ID"] == "0":
            print("boom", flush=True); sys.exit(3)
        time.sleep(3600)
    """,
        replicas=2,
    )
    assert job.run() == 3
    assert "local job failed: replica 0 exited with code 3 (log: " in console.getvalue()
    assert "[r0] boom" in console.getvalue()
    assert not any(alive(p) for p in job.pids)


@pytest.mark.timeout(600)
def test_failed_replica_is_restarted(tmp_path):
    marker = tmp_path / "failed-once"
    job, console = make_job(
        tmp_path,
        f"""
        import os, sys
        marker = {str(marker)!r}
        if os.environ["REPLICA_GROUP_ID"] == "1" and not os.path.exists(marker):
            open(marker, "w").close(); print("first try fails"); sys.exit(5)
        print("ok")
    """,
        replicas=2,
        max_restarts=1,
    )
    assert job.run() == 0
    log = (tmp_path / "logs" / "replica_1.log").read_text()
    assert log.index("first try fails") < log.index("=== restart 1 ===") < log.rindex("ok")
    assert "replica 1 exited with code 5; restart 1/1" in console.getvalue()
    assert len(job.pids) == 2  # one torchrun per group; it restarted the failed rank itself
    assert not any(alive(p) for p in job.pids)


@pytest.mark.timeout(600)
def test_child_ignoring_sigterm_is_killed_after_grace(tmp_path):
    job, console = make_job(
        tmp_path,
        """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(3600)
    """,
        replicas=1,
        term_grace_s=1.0,
    )
    t, result = run_in_thread(job)
    until(
        "[r0] ready", lambda: "[r0] ready" in console.getvalue(), HANG_S, 0.05, console.getvalue
    )  # it ignores SIGTERM now
    t0 = time.monotonic()
    job.stop()
    t.join(HANG_S)
    assert result == [130]
    assert time.monotonic() - t0 >= 1.0  # it survived SIGTERM for the grace period
    assert not any(alive(p) for p in job.pids)


@pytest.mark.timeout(600)
def test_ctrl_c_stops_everything(tmp_path):
    """SIGINT to a launcher running in its own main thread: exit 130, no child left behind."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = textwrap.dedent(f"""
        import sys
        from muloco.launch.local import LocalJob
        child = [sys.executable, "-c", "import os, time; open(os.path.join({str(pid_dir)!r}, "
                 "str(os.getpid())), 'w').close(); time.sleep(3600)"]
        job = LocalJob(command=child, replicas=2, log_dir={str(tmp_path / "logs")!r})
        sys.exit(job.run())
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:

        def started():
            assert proc.poll() is None, "the launcher exited before its replicas started"
            return len(list(pid_dir.iterdir())) >= 2

        until("the replicas to start", started, HANG_S)
        pids = [int(p.name) for p in pid_dir.iterdir()]
        assert len(pids) == 2
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 130, out
        assert "local job stopped" in out
        assert not any(alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pid_dir.iterdir():  # only the PIDs our own children recorded
            if alive(int(p.name)):
                os.kill(int(p.name), signal.SIGKILL)


def test_muloco_job_script_defaults_to_2bit_muloco():
    out = run_watched([str(REPO / "jobs/local/muloco.sh"), "--help"])
    assert out.returncode == 0, out.stderr
    assert "Usage: jobs/local/muloco.sh" in out.stdout
    assert "Defaults: --config diloco/muloco_2bit --replicas 2" in out.stdout


def test_netns_is_refused_with_one_message_where_namespaces_cannot_be_made(tmp_path, monkeypatch):
    import muloco.launch.local as local

    monkeypatch.setattr(
        local, "unavailable", lambda: "network namespaces need root (ip netns add); run as root, or drop --netns"
    )
    lines = refused(tmp_path, netns=True, overrides=["--dump_folder", str(tmp_path / "run")])
    assert lines == [
        "local job failed: --netns: network namespaces need root (ip netns add); run as root, or drop --netns"
    ]
    lines = refused(tmp_path, link="100mbit", overrides=["--dump_folder", str(tmp_path / "run")])
    assert lines == [
        "local job failed: --link and --link-queue-ms shape the links of --netns; add --netns (or use "
        "the emulated link: compare --link)"
    ]
    lines = refused(tmp_path, netns=True, link="100mbps", overrides=["--dump_folder", str(tmp_path / "run")])
    assert lines[-1] == "local job failed: --link: link rate '100mbps' is not a tc rate; give e.g. 100mbit or 1gbit"
