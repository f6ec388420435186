"""The network testbed: hosts in namespaces on a shaped bridge, cut and blocked on demand, and
nothing left behind, even when its owner is SIGKILLed."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from muloco.launch.netns import Link, Testbed, TestbedError, namespaces, sweep_orphans, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"no network namespaces here: {unavailable()}")

SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5000)); s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    n = 0
    while (d := c.recv(1 << 16)):
        n += len(d)
    c.sendall(str(n).encode()); c.close()
"""

CLIENT = """
import socket, sys, time
t = time.monotonic()
try:
    c = socket.create_connection((sys.argv[1], 5000), timeout=3)
    c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR)
    print(c.recv(100).decode(), time.monotonic() - t)
except OSError as err:
    print("unreachable", err)
"""


def _send(tb: Testbed, host: str, to: str, size: int) -> tuple[str, float]:
    out = subprocess.run(
        [*tb.exec_prefix(host), sys.executable, "-c", CLIENT, tb.address(to), str(size)], capture_output=True, text=True
    ).stdout.split()
    return (out[0], float(out[1])) if out and out[0] != "unreachable" else ("unreachable", 0.0)


@pytest.fixture
def testbed():
    tb = Testbed(["lighthouse", "r0", "r1"], links={"r1": Link.parse("10mbit/100mbit")}).build()
    server = subprocess.Popen(
        [*tb.exec_prefix("r0"), sys.executable, "-c", SERVER, tb.address("r0")], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout.readline().strip() == "listening"
    yield tb
    server.kill()
    server.wait()
    tb.close()


def test_hosts_reach_each_other_at_their_links_rates_and_cuts_and_blocks_partition_them(testbed):
    tb = testbed
    received, seconds = _send(tb, "r1", "r0", 2_000_000)
    assert received == "2000000" and 1.3 < seconds < 4  # 16 Mbit through r1's 10 Mbit uplink: 1.6 s
    assert _send(tb, "lighthouse", "r0", 2_000_000)[1] < 1.0  # unshaped
    tb.cut("r1")
    assert _send(tb, "r1", "r0", 1000)[0] == "unreachable"
    tb.restore("r1")
    assert _send(tb, "r1", "r0", 1000)[0] == "1000"
    tb.block("lighthouse", "r0")
    assert _send(tb, "lighthouse", "r0", 1000)[0] == "unreachable"
    assert _send(tb, "r1", "r0", 1000)[0] == "1000"  # only that pair
    tb.unblock("lighthouse", "r0")
    assert _send(tb, "lighthouse", "r0", 1000)[0] == "1000"
    names = set(namespaces())
    assert {tb.hub, *(tb.namespace(h) for h in tb.hosts)} <= names
    tb.close()
    assert not {n for n in namespaces() if n.startswith(tb.prefix + "-")}


def test_a_sigkilled_owner_leaves_no_namespace():
    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "from muloco.launch.netns import Testbed\n"
                "tb = Testbed(['a', 'b']).build()\n"
                "print(tb.prefix, flush=True)\n"
                "import time; time.sleep(600)\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    prefix = owner.stdout.readline().strip()
    assert prefix and any(n.startswith(prefix + "-") for n in namespaces())
    owner.kill()
    owner.wait()
    last, left = time.monotonic(), None
    while left is None or left:  # the watchdog deletes them; progress: each deletion
        now = [n for n in namespaces() if n.startswith(prefix + "-")]
        if now != left:
            last, left = time.monotonic(), now
        assert time.monotonic() - last < 30, f"the watchdog left {left}"
        time.sleep(0.1)


def test_orphans_of_a_dead_owner_are_swept_and_a_live_owners_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = f"mlc{dead.pid}-x"
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    mine = Testbed(["a"]).build()
    try:
        assert orphan not in namespaces()  # build() swept it
        assert mine.namespace("a") in namespaces()
        assert sweep_orphans() == []  # a live owner's stay
    finally:
        mine.close()
        subprocess.run(["ip", "netns", "delete", orphan], capture_output=True)


def test_bad_links_and_hosts_are_one_clear_error():
    with pytest.raises(TestbedError, match="'100mbps' is not a tc rate; give e.g. 100mbit"):
        Link.parse("100mbps")
    with pytest.raises(TestbedError, match="no host 'r9' in this testbed"):
        Testbed(["r0"]).address("r9")


def test_the_drill_command_cuts_and_restores_a_recorded_testbed(testbed, tmp_path):
    """``python -m muloco.launch.netns cut LOG_DIR r1 --seconds S``, as a drill run beside a job does:
    it finds the testbed the job recorded, cuts the link, says when, and restores it."""
    tb = testbed
    tb.write_state(str(tmp_path))
    command = [sys.executable, "-m", "muloco.launch.netns"]
    cut = subprocess.Popen([*command, "cut", str(tmp_path), "r1", "--seconds", "3"], stdout=subprocess.PIPE, text=True)
    assert cut.stdout.readline().strip().endswith("netns: cut r1")
    assert _send(tb, "r1", "r0", 1000)[0] == "unreachable"
    assert re.search(r"netns: restore r1 after 3(\.\d+)? s$", cut.stdout.readline().strip())
    assert cut.wait() == 0
    assert _send(tb, "r1", "r0", 1000)[0] == "1000"
    shown = subprocess.run([*command, "show", str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert '"address": "198.18.0.3"' in shown
    bad = subprocess.run([*command, "cut", str(tmp_path / "nothing"), "r1"], capture_output=True, text=True)
    assert (
        bad.returncode == 2
        and "no testbed recorded in" in bad.stderr
        and "is a --netns job running there?" in bad.stderr
    )
