"""Several hosts on one machine: a network namespace per replica group and lighthouse, joined
by shaped links, to rehearse what a cluster's network does to a run (a cut link, a lighthouse one
site cannot reach, a slow WAN) without a cluster.

Layout (every name starts with the testbed's prefix, ``mlc<launcher pid>``)::

    <prefix>-hub          a bridge (br0) and one port per host (h0, h1, ...)
    <prefix>-<host>       eth0 at 198.18.0.<n>/24, lo; its processes run inside (``ip netns exec``)

198.18.0.0/15 is the range set aside for network benchmarks (RFC 2544), and it exists only inside
these namespaces: the machine's own namespace gets no interface, route or address, so nothing a
run sends can leave the testbed. A link is shaped with ``tc tbf`` at both ends (the host's egress
is its upload, the hub port's egress its download; ``netem`` is not in every kernel, so delay comes
from the queue). ``cut`` sets the hub's port down (the host reaches nobody), ``block`` drops one
pair of hosts both ways (blackhole routes: a lighthouse one group cannot reach).

Nothing outlives its testbed: ``close()`` deletes the namespaces (their veths and addresses go with
them); a watchdog process in a session of its own deletes them if the owner dies in any way,
SIGKILL included (the same end-of-file rule as ``children.GroupReaper``); and a new testbed first
deletes any ``mlc<pid>-`` namespace whose pid is no longer alive.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from muloco.utils.command_line import failed
from muloco.utils.errors import BAD_INPUT, MulocoError

PREFIX = "mlc"
SUBNET = "198.18.0"
STATE_FILE = "testbed.json"
_OURS = re.compile(rf"^{PREFIX}(\d+)-")
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit)$")


class TestbedError(MulocoError):
    """The testbed cannot be built here, or a request names what does not exist; the message
    says why and what to do."""

    __test__ = False  # not a pytest class (its name starts with Test)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root, or drop --netns"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (iproute2); install it, or drop --netns"
    return None


def bits_per_second(rate: str) -> float:
    """A tc rate (100mbit, 1gbit) in bits per second."""
    m = _RATE.match(rate)
    if m is None:
        raise TestbedError(f"link rate {rate!r} is not a tc rate; give e.g. 100mbit or 1gbit")
    unit = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}[m.group(2)]
    return float(rate[: -len(m.group(2))]) * unit


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode:
        raise TestbedError(f"{' '.join(args)} failed: {(done.stderr or done.stdout).strip()}")
    return done


def namespaces() -> list[str]:
    listed = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_orphans() -> list[str]:
    """Delete the namespaces of testbeds whose owner is dead (a SIGKILLed launcher whose
    watchdog was killed too); what was deleted."""
    gone = [ns for ns in namespaces() if (m := _OURS.match(ns)) and not _alive(int(m.group(1)))]
    for ns in gone:
        _run("ip", "netns", "delete", ns, check=False)
    return gone


@dataclass(frozen=True)
class Link:
    """A host's link to the hub: ``up`` the host's sending rate, ``down`` its receiving rate
    (tc rates: 100mbit, 1gbit; None: unshaped), ``queue_ms`` tbf's queue (its latency bound)."""

    up: str | None = None
    down: str | None = None
    queue_ms: int = 50

    def __post_init__(self) -> None:
        for rate in (self.up, self.down):
            if rate is not None and not _RATE.match(rate):
                raise TestbedError(f"link rate {rate!r} is not a tc rate; give e.g. 100mbit or 1gbit")
        if self.queue_ms <= 0:
            raise TestbedError(f"link queue {self.queue_ms} ms must be positive")

    @classmethod
    def parse(cls, text: str | None, queue_ms: int = 50) -> Link:
        """``RATE`` (both ways) or ``UP/DOWN``; empty: unshaped."""
        if not text:
            return cls(queue_ms=queue_ms)
        up, _, down = text.partition("/")
        return cls(up=up, down=down or up, queue_ms=queue_ms)


@dataclass
class Testbed:
    """Hosts in namespaces on one bridge; ``with Testbed(["lighthouse", "r0", "r1"]) as tb:``."""

    __test__ = False  # not a pytest class

    hosts: list[str]
    links: dict[str, Link] = field(default_factory=dict)
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")

    def __post_init__(self) -> None:
        if len(set(self.hosts)) != len(self.hosts) or not self.hosts or len(self.hosts) > 250:
            raise TestbedError(f"testbed hosts must be 1..250 distinct names, got {self.hosts}")
        self._watchdog: subprocess.Popen | None = None
        self._built: list[str] = []

    # -- names and addresses ------------------------------------------------------------------
    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{self._index(host)}"

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self._index(host) + 1}"

    def port(self, host: str) -> str:
        """The hub's port to ``host`` (what ``cut`` sets down)."""
        return f"h{self._index(host)}"

    def exec_prefix(self, host: str) -> list[str]:
        """Prepended to a command, runs it inside ``host``'s namespace (``ip`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def _index(self, host: str) -> int:
        try:
            return self.hosts.index(host)
        except ValueError:
            raise TestbedError(f"no host {host!r} in this testbed (hosts: {', '.join(self.hosts)})") from None

    # -- life ---------------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        return self.build()

    def __exit__(self, *exc) -> None:
        self.close()

    def build(self) -> Testbed:
        why = unavailable()
        if why:
            raise TestbedError(why)
        sweep_orphans()
        self._start_watchdog()
        try:
            self._add_namespace(self.hub)
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
            for host in self.hosts:
                self._add_host(host)
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, ns: str) -> None:
        self._tell(f"+{ns}")
        _run("ip", "netns", "add", ns)
        self._built.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _add_host(self, host: str) -> None:
        ns, port = self.namespace(host), self.port(host)
        self._add_namespace(ns)
        _run("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", self.hub, "link", "set", port, "master", "br0")
        _run("ip", "-n", self.hub, "link", "set", port, "up")
        _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        link = self.links.get(host, Link())
        self._shape(ns, "eth0", link.up, link.queue_ms)
        self._shape(self.hub, port, link.down, link.queue_ms)

    @staticmethod
    def _shape(ns: str, dev: str, rate: str | None, queue_ms: int) -> None:
        """tbf at ``rate``; its bucket holds 10 ms of the rate (at least 32 KiB): a bucket smaller than
        what the rate sends per kernel tick (rate / HZ) caps the link below its rate (a 64 KiB bucket
        held a 1 Gbit link to ~0.6 Gbit)."""
        if rate is None:
            return
        burst = max(32 * 1024, int(bits_per_second(rate) / 8 / 100))
        _run(
            "ip",
            "netns",
            "exec",
            ns,
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            str(burst),
            "latency",
            f"{queue_ms}ms",
        )

    def close(self) -> None:
        """Delete every namespace (their veths and addresses with them); then stop the watchdog."""
        for ns in reversed(self._built):
            _run("ip", "netns", "delete", ns, check=False)
        self._built.clear()
        if self._watchdog is not None:
            self._tell("bye")
            try:
                assert self._watchdog.stdin is not None
                self._watchdog.stdin.close()
                self._watchdog.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self._watchdog.kill()
            self._watchdog = None

    def _start_watchdog(self) -> None:
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", "from muloco.launch.netns import delete_on_eof; delete_on_eof()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            text=True,
        )

    def _tell(self, line: str) -> None:
        if self._watchdog is None or self._watchdog.stdin is None:
            return
        try:
            self._watchdog.stdin.write(line + "\n")
            self._watchdog.stdin.flush()
        except (OSError, ValueError):
            pass  # the watchdog was killed: sweep_orphans catches what is left

    # -- faults -------------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        """``host`` reaches nobody and nobody reaches it (its hub port down)."""
        _run("ip", "-n", self.hub, "link", "set", self.port(host), "down")

    def restore(self, host: str) -> None:
        """``host``'s link up again; every host forgets the neighbours it failed to find while it was
        down (else the first connections after the cut still fail: "No route to host")."""
        _run("ip", "-n", self.hub, "link", "set", self.port(host), "up")
        for other in self.hosts:
            _run("ip", "-n", self.namespace(other), "neigh", "flush", "all", check=False)

    def block(self, a: str, b: str) -> None:
        """``a`` and ``b`` cannot reach each other; both still reach everyone else."""
        _run("ip", "-n", self.namespace(a), "route", "replace", "blackhole", f"{self.address(b)}/32")
        _run("ip", "-n", self.namespace(b), "route", "replace", "blackhole", f"{self.address(a)}/32")

    def unblock(self, a: str, b: str) -> None:
        _run("ip", "-n", self.namespace(a), "route", "del", "blackhole", f"{self.address(b)}/32", check=False)
        _run("ip", "-n", self.namespace(b), "route", "del", "blackhole", f"{self.address(a)}/32", check=False)

    # -- a record for drills run from another process -----------------------------------------
    def describe(self) -> dict:
        return {
            "prefix": self.prefix,
            "hosts": {
                h: {
                    "namespace": self.namespace(h),
                    "address": self.address(h),
                    "hub_port": self.port(h),
                    **asdict(self.links.get(h, Link())),
                }
                for h in self.hosts
            },
        }

    def write_state(self, folder: str) -> str:
        path = os.path.join(folder, STATE_FILE)
        with open(path, "w") as f:
            json.dump(self.describe(), f, indent=1)
        return path

    @classmethod
    def attach(cls, folder: str) -> Testbed:
        """The testbed a running job recorded in ``folder`` (to cut its links from outside); it is
        not owned: ``close()`` on it deletes nothing."""
        try:
            with open(os.path.join(folder, STATE_FILE)) as f:
                state = json.load(f)
        except (OSError, ValueError) as err:
            raise TestbedError(f"no testbed recorded in {folder} ({err}); is a --netns job running there?") from None
        hosts = list(state["hosts"])
        return cls(hosts=hosts, prefix=state["prefix"])


def delete_on_eof(stream: IO[str] | None = None) -> None:
    """The watchdog: read ``+NAMESPACE`` and ``bye`` lines; at end of input without ``bye`` (the
    owner died), delete every namespace it was told of."""
    import signal

    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    names: list[str] = []
    for line in stream or sys.stdin:
        line = line.strip()
        if line == "bye":
            return
        if line.startswith("+"):
            names.append(line[1:])
    for ns in reversed(names):
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


ACTIONS = {  # action: (how many hosts it names, what it does, what ends it after --seconds)
    "cut": (1, lambda tb, hosts: tb.cut(*hosts), "restore"),
    "restore": (1, lambda tb, hosts: tb.restore(*hosts), None),
    "block": (2, lambda tb, hosts: tb.block(*hosts), "unblock"),
    "unblock": (2, lambda tb, hosts: tb.unblock(*hosts), None),
}


def _drill(args) -> int:
    """One change to a running job's testbed, ended ``--seconds`` later (also when interrupted:
    a drill never leaves a link down behind it); a timestamped line per change, for the record."""
    import time
    from datetime import datetime

    if args.action == "show":
        Testbed.attach(args.log_dir)  # the error if there is none
        print(Path(args.log_dir, STATE_FILE).read_text().strip())
        return 0
    tb = Testbed.attach(args.log_dir)
    count, act, end = ACTIONS[args.action]
    if len(args.hosts) != count:
        raise TestbedError(
            f"{args.action} takes {count} host(s) (e.g. {'r1' if count == 1 else 'lighthouse r1'}), got {args.hosts}"
        )
    target = " and ".join(args.hosts)

    def say(what: str) -> None:
        print(f"{datetime.now().isoformat(timespec='milliseconds')} netns: {what}", flush=True)

    act(tb, args.hosts)
    say(f"{args.action} {target}")
    if not args.seconds or end is None:
        return 0
    started = time.monotonic()
    try:
        time.sleep(args.seconds)
    finally:
        ACTIONS[end][1](tb, args.hosts)
        say(f"{end} {target} after {time.monotonic() - started:.3g} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m muloco.launch.netns",
        description="Cut or block the links of a running `muloco.launch.local --netns` job (a partition drill).",
    )
    parser.add_argument("action", choices=["cut", "restore", "block", "unblock", "show"])
    parser.add_argument("log_dir", help="the job's log folder (<dump folder>/logs), where it recorded its testbed")
    parser.add_argument("hosts", nargs="*", help="cut/restore: one host (r0, r1, lighthouse); block/unblock: two")
    parser.add_argument("--seconds", type=float, default=0.0, help="cut/block: restore after this long (0: stay)")
    args = parser.parse_args(argv)
    try:
        return _drill(args)
    except TestbedError as e:
        return failed("netns", e, BAD_INPUT)


if __name__ == "__main__":
    sys.exit(main())
