"""The loopback relay a SLURM replica group reaches its lighthouse through: it follows the URL
file to a lighthouse that moved, holds a connection that arrives while none answers, reaches a
real torchft lighthouse (gRPC and status page), and as a process dies with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest

from muloco import compat

compat.apply()

from torchft.coordination import LighthouseClient  # noqa: E402

from muloco.launch.lighthouse import start_lighthouse  # noqa: E402
from muloco.launch.lighthouse_relay import LighthouseRelay, read_target  # noqa: E402
from muloco.outer.lighthouse_status import fetch_status  # noqa: E402
from muloco.utils.atomic_file import write_atomically  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _heartbeat_seen(relay_url: str, replica: str) -> bool:
    """A torchft client heartbeats through the relay; the lighthouse behind it lists the replica."""
    LighthouseClient(relay_url, connect_timeout=timedelta(seconds=10)).heartbeat(replica)
    return replica in fetch_status(relay_url).heartbeats


def test_the_relay_follows_the_url_file_to_a_lighthouse_that_moved(tmp_path):
    url_file = str(tmp_path / "lighthouse.url")
    first = start_lighthouse("127.0.0.1:0", min_replicas=1)
    write_atomically(url_file, first.url + "\n")
    relay = LighthouseRelay(url_file, wait_s=30)
    try:
        assert relay.url.startswith("http://127.0.0.1:")
        assert _heartbeat_seen(relay.url, "muloco_replica_0:a")
        first.shutdown()
        second = start_lighthouse("127.0.0.1:0", min_replicas=1)  # another port: the lighthouse moved
        try:
            assert second.url != first.url
            write_atomically(url_file, second.url + "\n")
            assert _heartbeat_seen(relay.url, "muloco_replica_1:b")
            assert "muloco_replica_0:a" not in fetch_status(relay.url).heartbeats  # a new lighthouse
            assert [f"http://{h}:{p}" for h, p in relay.targets] == [first.url, second.url]
        finally:
            second.shutdown()
    finally:
        relay.close()


def test_a_connection_made_while_no_lighthouse_answers_waits_for_the_next_one(tmp_path):
    """The request is sent before any lighthouse exists; it is answered once one starts."""
    import socket

    url_file = str(tmp_path / "lighthouse.url")
    relay = LighthouseRelay(url_file, wait_s=60)
    lighthouse = None
    try:
        port = int(relay.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            conn.sendall(b"GET /status HTTP/1.1\r\nHost: lighthouse\r\nConnection: close\r\n\r\n")
            lighthouse = start_lighthouse("127.0.0.1:0", min_replicas=1)
            write_atomically(url_file, lighthouse.url + "\n")
            reply = conn.recv(64)
        assert reply.startswith(b"HTTP/1.1 200"), reply
    finally:
        relay.close()
        if lighthouse is not None:
            lighthouse.shutdown()


def test_with_no_lighthouse_for_wait_s_the_connection_is_closed_and_a_bad_file_is_named(tmp_path, capfd):
    from muloco.outer.lighthouse_status import LighthouseUnreachable

    url_file = tmp_path / "lighthouse.url"
    relay = LighthouseRelay(str(url_file), wait_s=1)
    try:
        with pytest.raises(LighthouseUnreachable) as closed:
            fetch_status(relay.url, timeout=30)
        assert closed.value.reason != "did not answer in time"  # closed by the relay, not timed out
        url_file.write_text("not a url\n")
        with pytest.raises(LighthouseUnreachable):
            fetch_status(relay.url, timeout=30)
        assert "not a lighthouse URL" in capfd.readouterr().err
    finally:
        relay.close()
    with pytest.raises(ValueError, match="not a lighthouse URL"):
        read_target(str(url_file))


def test_the_relay_process_prints_its_url_ignores_sigterm_and_dies_with_its_parent(tmp_path):
    """The group's relay outlives a SIGTERM (its ranks may still be stopping) and ends with the
    process that started it (the group's torchrun, by PID)."""
    url_file = tmp_path / "lighthouse.url"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from muloco.launch.slurm.group import start_relay\n"
            f"print(start_relay({str(url_file)!r}, 5), flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    relay_pid = None
    try:
        url = parent.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        relay_pid = int(
            subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout.split()[0]
        )
        os.kill(relay_pid, signal.SIGTERM)
        lighthouse = start_lighthouse("127.0.0.1:0", min_replicas=1)
        try:
            write_atomically(str(url_file), lighthouse.url + "\n")
            fetch_status(url, timeout=30)  # served after the SIGTERM: the relay ignored it
        finally:
            lighthouse.shutdown()
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(relay_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the relay outlived the process that started it")
        relay_pid = None
    finally:
        for pid in (relay_pid, parent.pid):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        parent.wait(10)
