"""Run K DiLoCo replica groups and their torchft lighthouse on one machine.

    python -m muloco.launch.local --config diloco/diloco --replicas 2 -- --training.steps 50

Starts the lighthouse (loopback only), then K replica groups, each with its own store port
and the torchrun-style environment a static ``torchrun`` would set. Every line a child prints
is shown prefixed (``[r0]``, ``[r1.1]``, ``[lh]``) and kept raw in ``<log_dir>/replica_<i>.log``.
A replica group that fails is restarted up to ``--max-restarts`` times (it heals from a peer);
otherwise, and on Ctrl-C, everything is stopped: SIGTERM to each child's process group, 10 s
grace, then SIGKILL. The exit status is 0 only if every replica exited 0.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from datetime import datetime
from typing import IO, Callable

from muloco.launch.ports import free_port, free_ports  # noqa: F401 - re-exported for callers

DEFAULT_DUMP_FOLDER = "./outputs/local-diloco"
LIGHTHOUSE_START_TIMEOUT_S = 30.0
_URL_LINE = re.compile(r"^lighthouse listening on (http://\S+) \(status page")
# Set by torchrun/torchelastic in a parent shell; stale values would confuse the children.
_INHERITED_DIST_VARS = ("GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


class LaunchError(Exception):
    """A failure to start the job, with a message meant for the user as is and an exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def config_dump_folder(config: str) -> str:
    """The dump folder a config module sets (loading it imports torchtitan: a few seconds)."""
    from muloco import compat

    compat.apply()
    from muloco.config import load_config

    try:
        return load_config(config).dump_folder
    except Exception:  # noqa: BLE001 - a bad config is reported by the replicas themselves
        return DEFAULT_DUMP_FOLDER


def dump_folder_from(overrides: list[str], default: str = DEFAULT_DUMP_FOLDER) -> str:
    """The ``--dump_folder`` the replicas will get (last one wins, as in the trainer's CLI)."""
    folder = default
    for i, arg in enumerate(overrides):
        if arg == "--dump_folder" and i + 1 < len(overrides):
            folder = overrides[i + 1]
        elif arg.startswith("--dump_folder="):
            folder = arg.split("=", 1)[1]
    return folder


def describe_exit(code: int) -> str:
    """Exit codes as people read them: 'code 3', or 'signal SIGKILL' for a killed process."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def shell_status(code: int) -> int:
    """Map Popen's negative 'killed by signal N' to the shell's 128+N, so it fits an exit status."""
    return 128 - code if code < 0 else code


class Console:
    """Serialises lines from many pump threads so prefixed lines never interleave mid-line."""

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream
        self.lock = threading.Lock()

    def line(self, text: str) -> None:
        stream = self.stream or sys.stdout
        with self.lock:
            try:
                stream.write(text + "\n")
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass  # a closed console must not kill the launcher (logs still get everything)


class ManagedProcess:
    """One child in its own session, its output pumped to the console (prefixed) and a log (raw).

    Its own session means Ctrl-C at the terminal reaches only the launcher, which then stops
    each child *with its children* (dataloader workers, torchft helpers) via its process group.
    """

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: str, prefix: str,
                 console: Console, on_line: Callable[[str], None] | None = None):
        self.cmd, self.log_path, self.prefix = cmd, log_path, prefix
        self._console, self._on_line = console, on_line
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self._returncode: int | None = None
        self._pump = threading.Thread(target=self._pump_lines, daemon=True,
                                      name=f"pump-{prefix}-{self.pid}")
        self._pump.start()

    def _pump_lines(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "ab") as log:
            for raw in iter(self.proc.stdout.readline, b""):
                log.write(raw)
                log.flush()  # so `tail -f` shows progress as it happens
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                self._console.line(f"{self.prefix} {text}")
                if self._on_line:
                    self._on_line(text)
        self.proc.stdout.close()

    def poll(self) -> int | None:
        """Exit code once exited; the first time, also reap leftovers in its process group."""
        if self._returncode is None:
            rc = self.proc.poll()
            if rc is not None:
                self._returncode = rc
                self.signal_group(signal.SIGKILL)  # orphans would hold the log pipe open
        return self._returncode

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def join_pump(self, timeout: float = 5.0) -> None:
        self._pump.join(timeout)


def stop_processes(procs: list[ManagedProcess], grace_s: float = 10.0,
                   hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM every live group, wait up to ``grace_s`` (or until ``hurry()``), then SIGKILL."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while live and time.monotonic() < deadline and not hurry():
        time.sleep(0.05)
        live = [p for p in live if p.poll() is None]
    for p in live:
        p.signal_group(signal.SIGKILL)
    for p in live:
        p.proc.wait()
        p.poll()
    for p in procs:
        p.join_pump()


class LighthouseProcess:
    """The lighthouse as a child process; ``start()`` returns once it printed its URL."""

    def __init__(self, bind: str = "127.0.0.1:0", min_replicas: int = 1,
                 join_timeout_ms: int = 2000, quorum_tick_ms: int = 100,
                 heartbeat_timeout_ms: int = 5000):
        self.cmd = [sys.executable, "-m", "muloco.launch.lighthouse", "--bind", bind,
                    "--min_replicas", str(min_replicas), "--join_timeout_ms", str(join_timeout_ms),
                    "--quorum_tick_ms", str(quorum_tick_ms),
                    "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]
        self.url: str | None = None
        self.process: ManagedProcess | None = None
        self._ready = threading.Event()

    def _watch(self, text: str) -> None:
        m = _URL_LINE.match(text)
        if m and not self._ready.is_set():
            self.url = m.group(1)
            self._ready.set()

    def start(self, log_path: str, console: Console,
              timeout_s: float = LIGHTHOUSE_START_TIMEOUT_S) -> str:
        env = {"RUST_LOG": "warn", **os.environ, "PYTHONUNBUFFERED": "1"}  # quorum INFO lines are noise
        self.process = ManagedProcess(self.cmd, env, log_path, "[lh]", console, self._watch)
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.05):
            rc = self.process.poll()
            if rc is not None or time.monotonic() > deadline:
                self.stop()
                why = (f"exited with {describe_exit(rc)}" if rc is not None
                       else f"did not report its address within {timeout_s:.0f} s")
                raise LaunchError(f"the lighthouse {why} (log: {log_path})",
                                  2 if rc == 2 else 1)
        assert self.url is not None
        return self.url

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process:
            stop_processes([self.process], grace_s)


@dataclass
class ReplicaGroup:
    """The processes of one replica group; restarted as a whole with the same id and store port."""

    index: int
    port: int
    procs: list[ManagedProcess] = field(default_factory=list)
    restarts: int = 0
    restart_at: float | None = None  # monotonic time of a pending restart
    done: bool = False

    def failure(self) -> tuple[int, int] | None:
        """(rank, exit code) of the first process that failed, if any."""
        for rank, p in enumerate(self.procs):
            rc = p.poll()
            if rc not in (None, 0):
                return rank, rc
        return None

    def all_ok(self) -> bool:
        return bool(self.procs) and all(p.poll() == 0 for p in self.procs)


@dataclass
class LocalJob:
    """K replica groups plus a lighthouse on this machine; ``run()`` blocks and returns the status."""

    config: str = "diloco/diloco"
    replicas: int = 2
    procs_per_replica: int = 1
    overrides: list[str] = field(default_factory=list)
    log_dir: str | None = None
    max_restarts: int = 0
    lighthouse_bind: str = "127.0.0.1:0"
    min_replicas: int = 1
    join_timeout_ms: int = 2000
    heartbeat_timeout_ms: int = 5000
    quorum_tick_ms: int = 100
    threads_per_proc: int | None = None
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    restart_delay_s: float = 1.0
    term_grace_s: float = 10.0
    console: IO[str] | None = None  # default sys.stdout

    def __post_init__(self) -> None:
        self.lighthouse_url: str | None = None
        self.lighthouse_pid: int | None = None
        self.pids: list[int] = []  # every replica process started, restarts included
        self.started = threading.Event()  # set once the lighthouse and all groups are up
        self._stop_code: int | None = None
        self._stop_requests = 0
        self._out = Console(self.console)
        self._lighthouse: LighthouseProcess | None = None
        self._groups: list[ReplicaGroup] = []

    # -- public helpers -------------------------------------------------------------------

    @cached_property
    def resolved_log_dir(self) -> str:
        """``log_dir``, else ``<dump folder>/logs``: the overrides' ``--dump_folder`` or, for the
        trainer, the config's own dump folder (logs sit next to the replicas' outputs)."""
        if self.log_dir:
            return self.log_dir
        if self.command is None and dump_folder_from(self.overrides, "") == "":
            return os.path.join(config_dump_folder(self.config), "logs")
        return os.path.join(dump_folder_from(self.overrides), "logs")

    def replica_command(self, i: int) -> list[str]:
        """The child command line: the trainer with its replica id, or ``command`` as given."""
        if self.command is not None:
            return list(self.command)
        return [sys.executable, "-m", "muloco.train", "--config", self.config,
                "--fault_tolerance.replica_id", str(i),
                "--fault_tolerance.group_size", str(self.replicas), *self.overrides]

    def replica_env(self, i: int, rank: int, port: int) -> dict[str, str]:
        """What a static torchrun would set for this rank, plus the torchft/DiLoCo variables."""
        env = {k: v for k, v in os.environ.items() if k not in _INHERITED_DIST_VARS}
        threads = self.threads_per_proc or (
            None if "OMP_NUM_THREADS" in os.environ
            else max(1, (os.cpu_count() or 1) // (self.replicas * self.procs_per_replica))
        )
        if threads:  # by default share the cores: K·N processes each with all cores thrash
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        env.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO
        env.update(self.env)
        n = str(self.procs_per_replica)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=n, LOCAL_WORLD_SIZE=n,
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHFT_LIGHTHOUSE=str(self.lighthouse_url), REPLICA_GROUP_ID=str(i),
                   NUM_REPLICA_GROUPS=str(self.replicas), PYTHONUNBUFFERED="1")
        return env

    def log_path(self, i: int, rank: int = 0) -> str:
        name = f"replica_{i}.log" if rank == 0 else f"replica_{i}_rank{rank}.log"
        return os.path.join(self.resolved_log_dir, name)

    def stop(self, code: int = 130) -> None:
        """Ask a running ``run()`` (from another thread or a signal handler) to stop everything."""
        self._stop_requests += 1
        if self._stop_code is None:
            self._stop_code = code

    # -- running --------------------------------------------------------------------------

    def validate(self) -> None:
        """Catch settings that would fail late or hang (e.g. a quorum that can never form)."""
        if self.replicas < 1 or self.procs_per_replica < 1:
            raise LaunchError("--replicas and --procs-per-replica must be at least 1", 2)
        if self.max_restarts < 0:
            raise LaunchError("--max-restarts must be >= 0", 2)
        if not 1 <= self.min_replicas <= self.replicas:
            raise LaunchError(f"--min-replicas must be between 1 and --replicas "
                              f"({self.replicas}), got {self.min_replicas}: a larger value "
                              f"means the quorum could never form", 2)
        if self.threads_per_proc is not None and self.threads_per_proc < 1:
            raise LaunchError("--threads must be at least 1", 2)

    def run(self) -> int:
        """Start everything, supervise until done or failed, always tear down; return the status."""
        restore = self._install_signal_handlers()
        try:
            self.validate()
            self._start()
            return self._supervise()
        except LaunchError as e:
            self._out.line(f"local job failed: {e}")
            return e.status
        finally:
            self._teardown()
            restore()

    def _install_signal_handlers(self) -> Callable[[], None]:
        """Ctrl-C/SIGTERM become a clean stop; only possible when run() is on the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        codes = {signal.SIGINT: 130, signal.SIGTERM: 143}
        old = {sig: signal.signal(sig, lambda s, _f: self.stop(codes[s])) for sig in codes}

        def restore() -> None:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        return restore

    def _start(self) -> None:
        os.makedirs(self.resolved_log_dir, exist_ok=True)
        self._lighthouse = LighthouseProcess(self.lighthouse_bind, self.min_replicas,
                                             self.join_timeout_ms, self.quorum_tick_ms,
                                             self.heartbeat_timeout_ms)
        lh_log = os.path.join(self.resolved_log_dir, "lighthouse.log")
        self._mark([lh_log], f"=== launch {datetime.now().isoformat(timespec='seconds')} ===")
        self.lighthouse_url = self._lighthouse.start(lh_log, self._out)
        self.lighthouse_pid = self._lighthouse.pid
        self._out.line(f"local job: lighthouse {self.lighthouse_url} (status page: "
                       f"{self.lighthouse_url}/)")
        self._out.line(f"local job: logs in {os.path.abspath(self.resolved_log_dir)}")
        self._out.line(f"local job: {self.replicas} replica(s) x {self.procs_per_replica} "
                       f"process(es); replica 0 runs: {shlex.join(self.replica_command(0))}")
        ports = free_ports(self.replicas)
        self._groups = [ReplicaGroup(i, port) for i, port in enumerate(ports)]
        for g in self._groups:
            self._mark(self._group_logs(g),
                       f"=== launch {datetime.now().isoformat(timespec='seconds')} ===")
            self._launch_group(g)
        self.started.set()

    def _group_logs(self, g: ReplicaGroup) -> list[str]:
        return [self.log_path(g.index, r) for r in range(self.procs_per_replica)]

    @staticmethod
    def _mark(paths: list[str], line: str) -> None:
        """A separator line in each log, so restarts and relaunches are easy to find."""
        for path in paths:
            with open(path, "a") as f:
                f.write(line + "\n")

    def _launch_group(self, g: ReplicaGroup) -> None:
        cmd = self.replica_command(g.index)
        g.procs = []
        for rank in range(self.procs_per_replica):
            prefix = f"[r{g.index}]" if self.procs_per_replica == 1 else f"[r{g.index}.{rank}]"
            p = ManagedProcess(cmd, self.replica_env(g.index, rank, g.port),
                               self.log_path(g.index, rank), prefix, self._out)
            g.procs.append(p)
            self.pids.append(p.pid)

    def _supervise(self) -> int:
        """Poll children every 0.1 s; restart failed groups while restarts remain."""
        while True:
            if self._stop_code is not None:
                self._out.line(f"local job stopped: interrupted (exit {self._stop_code})")
                return self._stop_code
            assert self._lighthouse and self._lighthouse.process
            lh_rc = self._lighthouse.process.poll()
            if lh_rc is not None:
                self._out.line(f"local job failed: the lighthouse exited with "
                               f"{describe_exit(lh_rc)} (log: {self._lighthouse.process.log_path})")
                return 1
            for g in self._groups:
                failed = self._check_group(g)
                if failed is not None:
                    return failed
            if all(g.done for g in self._groups):
                self._out.line(f"local job finished: {self.replicas} replicas ok")
                return 0
            time.sleep(0.1)

    def _check_group(self, g: ReplicaGroup) -> int | None:
        """Advance one group's state; returns an exit status only when the job must fail."""
        if g.done:
            return None
        if g.restart_at is not None:
            if time.monotonic() >= g.restart_at:
                g.restart_at = None
                self._launch_group(g)
            return None
        if g.all_ok():
            g.done = True
            return None
        failure = g.failure()
        if failure is None:
            return None
        rank, rc = failure
        if g.restarts < self.max_restarts:
            g.restarts += 1
            self._out.line(f"local job: replica {g.index} exited with {describe_exit(rc)}; "
                           f"restart {g.restarts}/{self.max_restarts}")
            stop_processes(g.procs, self.term_grace_s, self._hurry)
            self._mark(self._group_logs(g), f"=== restart {g.restarts} ===")
            g.restart_at = time.monotonic() + self.restart_delay_s
            return None
        self._out.line(f"local job failed: replica {g.index} exited with {describe_exit(rc)} "
                       f"(log: {self.log_path(g.index, rank)})")
        return shell_status(rc) or 1

    def _hurry(self) -> bool:
        """A second Ctrl-C skips the grace period."""
        return self._stop_requests >= 2

    def _teardown(self) -> None:
        """Children first (they may still talk to the lighthouse while saving), then the lighthouse."""
        stop_processes([p for g in self._groups for p in g.procs], self.term_grace_s, self._hurry)
        if self._lighthouse:
            self._lighthouse.stop(self.term_grace_s)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m muloco.launch.local", allow_abbrev=False,
        description="Run K DiLoCo replica groups and a torchft lighthouse on this machine.",
        epilog="Everything after `--` (and any option not listed here) is passed to every "
               "replica, e.g. `-- --training.steps 50 --dump_folder outputs/my-run`.")
    a = p.add_argument
    a("--config", default="diloco/diloco", help="muloco config name (default %(default)s)")
    a("--replicas", type=int, default=2, help="replica groups K (default %(default)s)")
    a("--procs-per-replica", type=int, default=1,
      help="processes per replica group (default %(default)s)")
    a("--max-restarts", type=int, default=0,
      help="restart a failed replica group up to N times; it heals from a peer "
           "(default %(default)s)")
    a("--log-dir", default=None,
      help=f"per-replica logs (default <dump_folder>/logs, dump_folder from the overrides or "
           f"{DEFAULT_DUMP_FOLDER})")
    a("--min-replicas", type=int, default=1,
      help="replica groups needed for a quorum (default %(default)s)")
    a("--heartbeat-timeout-ms", type=int, default=5000,
      help="drop a silent replica group after this long (default %(default)s)")
    a("--join-timeout-ms", type=int, default=2000,
      help="how long a new quorum waits for more groups (default %(default)s)")
    a("--quorum-tick-ms", type=int, default=100, help="lighthouse tick (default %(default)s)")
    a("--lighthouse-bind", default="127.0.0.1:0",
      help="lighthouse HOST:PORT (default %(default)s: loopback, free port)")
    a("--threads", type=int, default=None,
      help="OMP_NUM_THREADS per process (default: unset, torch decides)")
    return p


def job_from_args(argv: list[str]) -> LocalJob:
    """CLI arguments to a LocalJob: our options parsed, the rest (and all after `--`) passed on."""
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args, unknown = _parser().parse_known_args(argv)
    return LocalJob(config=args.config, replicas=args.replicas,
                    procs_per_replica=args.procs_per_replica, overrides=unknown + extra,
                    log_dir=args.log_dir, max_restarts=args.max_restarts,
                    lighthouse_bind=args.lighthouse_bind, min_replicas=args.min_replicas,
                    join_timeout_ms=args.join_timeout_ms,
                    heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                    quorum_tick_ms=args.quorum_tick_ms, threads_per_proc=args.threads)


def main(argv: list[str] | None = None) -> int:
    return job_from_args(sys.argv[1:] if argv is None else argv).run()


if __name__ == "__main__":
    sys.exit(main())
