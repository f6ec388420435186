"""Run K DiLoCo replica groups and their torchft lighthouse on one machine.

    python -m muloco.launch.local --config diloco/diloco --replicas 2 -- --training.steps 50

Before starting anything it parses and checks the trainer config once (a non-DiLoCo config or
a bad override is refused with one message, exit 2) and locks the dump folder (a second launch
on a folder a live run holds is refused, exit 2, without touching it). Then it starts the
lighthouse inside the launcher's own process (torchft's server thread; loopback only; a quorum is a majority
of the K groups unless ``--min-replicas`` says otherwise), then K replica groups, each one ``torchrun``
(``muloco.launch.replica_group``)
with N ranks on its own slice of the GPUs (``CUDA_VISIBLE_DEVICES``; one rank per GPU, FSDP
inside the group) and its own rendezvous store on a free loopback port. torchrun restarts a
failed group up to ``--max-restarts`` times (it heals from a peer) and tees the ranks' output;
every line is shown prefixed (``[r0]``, ``[r1.1]``) and kept raw in
``<log_dir>/replica_<i>.log`` (``replica_<i>_rank<r>.log`` for ranks r > 0). A group that
fails for good, and Ctrl-C, stop everything: SIGTERM to each child's process group (torchrun
passes it to its ranks), 10 s grace, then SIGKILL. The exit status is 0 only if every
replica exited 0, else the failed rank's own exit status.

If the launcher itself is killed, even by SIGKILL, nothing it started survives (the lighthouse
dies with it, being part of it): the kernel
kills its direct children (Linux's parent-death signal), a watchdog process kills their
process groups, and each rank dies with its torchrun agent (see ``parent_death``,
``children.GroupReaper`` and ``rank_process``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import IO, Callable

from muloco.components.stop_request import EXIT_PREEMPTED, clear_stop_request
from muloco.launch.children import Console, GroupReaper, ManagedProcess, stop_processes
from muloco.launch.exits import describe_exit, shell_status
from muloco.launch.gpu_slices import GpuLayoutError, gpu_slices, visible_gpus
from muloco.launch.group import (
    TRAINER,
    TrainerConfigError,
    group_variables,
    load_trainer_config,
    torchrun_args,
    torchrun_group,
    trainer_command,
)
from muloco.launch.lighthouse import (
    DEFAULT_JOIN_TIMEOUT_MS,
    Lighthouse,
    LighthouseError,
    below_majority_warning,
    majority,
    start_lighthouse,
)
from muloco.launch.netns import STATE_FILE, Link, Testbed, TestbedError, unavailable
from muloco.launch.replica_group import TAG as GROUP_TAG
from muloco.runs.facts import dump_folder_in
from muloco.runs.lock import DumpFolderBusy, DumpFolderLock
from muloco.utils.command_line import UsageError, failed, parse, run_main
from muloco.utils.created_dirs import make_dirs, remove_dirs
from muloco.utils.errors import MulocoError

DEFAULT_DUMP_FOLDER = "./outputs/local-diloco"
LIGHTHOUSE_PORT = 29510  # inside the testbed's own namespace (--netns), where no other service listens
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\] ")  # torchrun's tee, TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE
_RESTART = re.compile(r"exited with (.+); restart (\d+)/\d+$")
_FAILED_RANK = re.compile(r"^rank (\d+) ")
# Set by torchrun/torchelastic in a parent shell; stale values would confuse the children.
_INHERITED_DIST_VARS = (
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)


class LaunchError(MulocoError):
    """A failure to start the job, with a message meant for the user as is and an exit status."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


class GroupOutput:
    """A replica group's torchrun output, split by rank: raw lines to ``replica_<i>.log``
    (rank 0 and torchrun itself) or ``replica_<i>_rank<r>.log``, prefixed lines to the
    console; the agent's ``[muloco]`` failure lines go to ``on_failure`` (not the console)."""

    def __init__(
        self,
        index: int,
        log_paths: list[str],
        console: Console,
        on_failure: Callable[[str], None],
        prefix: str | None = None,
    ):
        self.index, self.ranks = index, len(log_paths)
        self._console, self._on_failure, self._prefix = console, on_failure, prefix
        self._logs = [open(path, "ab") for path in log_paths]

    def prefix(self, rank: int | None) -> str:
        if self._prefix is not None:
            return self._prefix
        return f"[r{self.index}]" if rank is None or self.ranks == 1 else f"[r{self.index}.{rank}]"

    def write(self, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        rank = None
        m = _RANK_PREFIX.match(text) if self.ranks > 1 else None
        if m and int(m.group(1)) < self.ranks:
            rank, text = int(m.group(1)), text[m.end() :]
            raw = text.encode() + b"\n"
        log = self._logs[rank or 0]
        log.write(raw)
        log.flush()  # so `tail -f` shows progress as it happens
        if rank is None and text.startswith(GROUP_TAG):
            self._on_failure(text[len(GROUP_TAG) :])
        else:
            self._console.line(f"{self.prefix(rank)} {text}")

    def mark(self, line: str) -> None:
        """A separator line in each rank's log (called from the pump: in order with output)."""
        for log in self._logs:
            log.write(line.encode() + b"\n")
            log.flush()

    def close(self) -> None:
        for log in self._logs:
            log.close()


@dataclass
class ReplicaGroup:
    """One replica group: its torchrun agent, and what the agent said about failed attempts."""

    index: int
    agent: ManagedProcess | None = None
    restarts: int = 0
    preempted: bool = False
    """Stopped on request (MULOCO_STOP_FILE) after writing a checkpoint."""
    failed_rank: int = 0  # the rank that failed last (for the log named in the final message)
    done: bool = False


@dataclass
class LaunchOptions:
    """Run K DiLoCo replica groups (one torchrun each) and a torchft lighthouse on this machine."""

    config: str = "diloco/diloco"
    """muloco config module with an outer loop (diloco/*), or a path to a .py file."""
    replicas: int = 2
    """Replica groups K."""
    procs_per_replica: int | None = None
    """Ranks per replica group, started by its torchrun (default: one per GPU of its slice; 1 on CPU)."""
    gpus_per_replica: int | None = None
    """GPUs per replica group; group i gets the i-th slice of CUDA_VISIBLE_DEVICES (default: the
    visible GPUs split evenly over --replicas)."""
    share_gpus: bool = False
    """Let replica groups share GPUs (e.g. K groups on one GPU) instead of refusing when there are
    fewer GPUs than groups x --gpus-per-replica."""
    dry_run: bool = False
    """Print every process's command and environment (CUDA_VISIBLE_DEVICES included); start nothing."""
    max_restarts: int = 0
    """torchrun restarts a failed replica group up to N times; it heals from a peer."""
    log_dir: str | None = None
    """Per-replica logs (default <dump_folder>/logs, the trainer's dump folder after the overrides;
    the dump folder is locked while the job runs)."""
    min_replicas: int | None = None
    """Replica groups a quorum needs (default: a majority, K//2+1, unless the config sets
    --fault_tolerance.min_replica_size; 0 also means a majority). 1..K are allowed; below a
    majority, two disjoint sets of groups could both commit (split brain)."""
    heartbeat_timeout_ms: int = 5000
    """Drop a silent replica group after this long."""
    join_timeout_ms: int | None = None
    """How long the lighthouse waits for heartbeating groups that have not joined a forming quorum
    yet (default: 90% of the trainer's --fault_tolerance.quorum_timeout_seconds, 270000 for 300 s)."""
    quorum_tick_ms: int = 100
    """Lighthouse tick."""
    lighthouse_bind: str = "127.0.0.1:0"
    """Lighthouse HOST:PORT (loopback and a free port by default)."""
    threads: int | None = None
    """OMP_NUM_THREADS per process (default: the cores shared out over every rank)."""
    netns: bool = False
    """Several hosts on this machine: the lighthouse and each replica group in a network namespace
    of its own (198.18.0.x on one bridge; needs root and iproute2), to rehearse a multi-site run.
    Cut a group's link from another shell: python -m muloco.launch.netns cut <log dir> r1 --seconds 15."""
    link: str = ""
    """With --netns, each replica group's link: RATE both ways or UP/DOWN, as tc writes rates
    (100mbit, 1gbit/100mbit); empty: unshaped."""
    link_queue_ms: int = 50
    """With --netns and --link, the shaper's queue (tbf latency): the most a packet waits in it."""


@dataclass
class LocalJob(LaunchOptions):
    """K replica groups plus a lighthouse on this machine; ``run()`` blocks and returns the status.

    ``min_replicas`` None or 0 means a majority of ``replicas`` (or the trainer config's
    ``fault_tolerance.min_replica_size`` when it sets one); ``join_timeout_ms`` None means 90%
    of the trainer's ``fault_tolerance.quorum_timeout_seconds``. Each rank of a replica group
    runs ``entry`` (the trainer; a test may give a wrapper script) with ``--config``, its
    replica id, K, the ``overrides`` and the quorum size; ``command``, when given, replaces
    that whole command line (and the config is then not parsed). torchrun starts the ranks.
    With ``dry_run``, ``main`` prints the launch (``show_launch()``) instead of running it.
    """

    overrides: list[str] = field(default_factory=list)
    visible_gpus: list[str] | None = None
    """Devices to hand out; None: CUDA_VISIBLE_DEVICES, else every CUDA device (gpu_slices.py)."""
    command: list[str] | None = None
    entry: list[str] = field(default_factory=lambda: list(TRAINER))
    env: dict[str, str] = field(default_factory=dict)
    term_grace_s: float = 10.0
    console: IO[str] | None = None  # default sys.stdout

    def __post_init__(self) -> None:
        self.slices: list[list[str]] | None = None  # per group, its CUDA_VISIBLE_DEVICES (None: CPU)
        self.lighthouse_url: str | None = None
        self.pids: list[int] = []  # every replica process started, restarts included
        self.started = threading.Event()  # set once the lighthouse and all groups are up
        self._stop_code: int | None = None
        self._stop_requests = 0
        self._out = Console(self.console)
        self._lighthouse: Lighthouse | None = None
        self._groups: list[ReplicaGroup] = []
        self._lock: DumpFolderLock | None = None
        self._reaper: GroupReaper | None = None
        self._created_dirs: list[str] = []  # what this launch wrote, undone if it is refused
        self._created_files: list[str] = []
        self.testbed: Testbed | None = None  # --netns: built when the job starts
        self._lighthouse_process: ManagedProcess | None = None

    # -- public helpers -------------------------------------------------------------------

    @cached_property
    def trainer_config(self):
        """Replica 0's trainer config, parsed and checked (None for a custom ``command``)."""
        if self.command is not None:
            return None
        try:
            return load_trainer_config(
                self.config,
                self.overrides,
                replicas=self.replicas,
                who="the local launcher",
                prog="python -m muloco.launch.local",
            )
        except TrainerConfigError as e:
            raise LaunchError(str(e), e.status) from None

    @cached_property
    def dump_folder(self) -> str:
        """The folder this job owns and locks: the trainer config's ``dump_folder`` (overrides
        applied); for a custom ``command``, ``--dump_folder`` if given, else the log folder."""
        if self.trainer_config is not None:
            return self.trainer_config.dump_folder
        return dump_folder_in(self.overrides) or self.log_dir or DEFAULT_DUMP_FOLDER

    @cached_property
    def resolved_log_dir(self) -> str:
        """``log_dir``, else ``<dump folder>/logs``: logs sit next to the replicas' outputs."""
        return self.log_dir or os.path.join(self.dump_folder, "logs")

    @cached_property
    def quorum_size(self) -> int:
        """Replica groups a quorum needs: ``min_replicas``, else the trainer config's
        ``fault_tolerance.min_replica_size``, else a majority (no split brain)."""
        if self.min_replicas:
            return self.min_replicas
        return (
            self.trainer_config.fault_tolerance.quorum_size(self.replicas)
            if self.trainer_config
            else majority(self.replicas)
        )

    @cached_property
    def resolved_join_timeout_ms(self) -> int:
        """``join_timeout_ms``, else 90% of how long a replica itself waits for a quorum."""
        if self.join_timeout_ms is not None:
            return self.join_timeout_ms
        if self.trainer_config is None:
            return DEFAULT_JOIN_TIMEOUT_MS
        return self.trainer_config.fault_tolerance.join_timeout_ms()

    def replica_command(self, i: int) -> list[str]:
        """The child command line: ``entry`` with the config, replica id, K, the overrides and
        the quorum size last (so trainers and lighthouse agree), or ``command`` as given."""
        if self.command is not None:
            return list(self.command)
        command = trainer_command(self.config, i, self.replicas, self.overrides, self.quorum_size, self.entry)
        if self.netns:  # its peers reach it at its namespace's address, not at this machine's name
            command += ["--fault_tolerance.advertise_address", self._testbed().address(f"r{i}")]
        return command

    def group_command(self, i: int) -> list[str]:
        """Group ``i``'s torchrun: N ranks, restarts, a rendezvous store on a free loopback
        port; each rank runs ``replica_command(i)`` through ``rank_process`` (it dies with
        its agent). With N > 1 torchrun tees each rank's output, prefixed with its rank, and
        keeps its own per-attempt copies under ``<log_dir>/torchrun/replica_<i>``."""
        address = self._testbed().address(f"r{i}") if self.netns else "127.0.0.1"
        torchrun = torchrun_args(
            i,
            procs=self.procs_per_replica,
            max_restarts=self.max_restarts,
            tee_dir=os.path.join(self.resolved_log_dir, "torchrun", f"replica_{i}"),
            address=address,
        )
        inside = self._testbed().exec_prefix(f"r{i}") if self.netns else []
        return [*inside, *torchrun_group(torchrun, self.replica_command(i))]

    def _testbed(self) -> Testbed:
        """The hosts of ``--netns``: the lighthouse, then r0..r(K-1), each group with ``--link``."""
        if self.testbed is None:
            try:
                link = Link.parse(self.link, self.link_queue_ms)
            except TestbedError as e:
                raise LaunchError(f"--link: {e}", 2) from None
            groups = [f"r{i}" for i in range(self.replicas)]
            self.testbed = Testbed(["lighthouse", *groups], links={g: link for g in groups})
        return self.testbed

    def group_env(self, i: int) -> dict[str, str]:
        """Group ``i``'s environment (torchrun adds each rank's RANK, LOCAL_RANK, WORLD_SIZE,
        MASTER_ADDR/PORT): its GPU slice, the torchft/DiLoCo variables, threads per rank."""
        env = {k: v for k, v in os.environ.items() if k not in _INHERITED_DIST_VARS}
        threads = self.threads or (
            None
            if "OMP_NUM_THREADS" in os.environ
            else max(1, (os.cpu_count() or 1) // (self.replicas * self.procs_per_replica))
        )
        if threads:  # by default share the cores: K·N processes each with all cores thrash
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        env.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO
        env.update(self.env)
        if self.slices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.slices[i])
        env.update(group_variables(str(self.lighthouse_url), i, self.replicas))
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
        if self.replicas < 1 or (self.procs_per_replica is not None and self.procs_per_replica < 1):
            raise LaunchError("--replicas and --procs-per-replica must be at least 1", 2)
        self._slice_gpus()
        if self.max_restarts < 0:
            raise LaunchError("--max-restarts must be >= 0", 2)
        if not 0 <= (self.min_replicas or 0) <= self.replicas:
            raise LaunchError(
                f"--min-replicas must be between 1 and --replicas "
                f"({self.replicas}) (0: a majority), got {self.min_replicas}: a "
                f"larger value means the quorum could never form",
                2,
            )
        if self.join_timeout_ms is not None and self.join_timeout_ms < 0:
            raise LaunchError(f"--join-timeout-ms must be >= 0, got {self.join_timeout_ms}", 2)
        if self.threads is not None and self.threads < 1:
            raise LaunchError("--threads must be at least 1", 2)
        if (self.link or self.link_queue_ms != 50) and not self.netns:
            raise LaunchError(
                "--link and --link-queue-ms shape the links of --netns; add --netns (or use the "
                "emulated link: compare --link)",
                2,
            )
        if self.netns:
            self._testbed()  # --link's own check first: bad input whatever the machine
            why = unavailable()
            if why:
                raise LaunchError(f"--netns: {why}", 2)

    def _slice_gpus(self) -> None:
        """Give each group its GPUs, and as many ranks as it has GPUs."""
        visible = self.visible_gpus if self.visible_gpus is not None else visible_gpus()
        try:
            self.slices = gpu_slices(visible, self.replicas, self.gpus_per_replica, self.share_gpus)
        except GpuLayoutError as e:
            raise LaunchError(str(e), 2) from None
        n = len(self.slices[0]) if self.slices else 1
        if self.procs_per_replica is None:
            self.procs_per_replica = n
        elif self.slices and self.procs_per_replica != n:
            raise LaunchError(
                f"--procs-per-replica {self.procs_per_replica} does not match the "
                f"{n} GPU(s) of each replica group (one rank per GPU); pass "
                f"--gpus-per-replica {self.procs_per_replica} instead",
                2,
            )

    def _check_quorum(self) -> None:
        """A quorum size taken from the trainer config gets the same range check."""
        if not 1 <= self.quorum_size <= self.replicas:
            raise LaunchError(
                f"--fault_tolerance.min_replica_size {self.quorum_size} must be "
                f"between 0 (a majority) and --replicas ({self.replicas})",
                2,
            )

    def run(self) -> int:
        """Check, lock, start everything, supervise until done or failed, always tear down.

        Bad input (exit 2) found before any replica started leaves no trace: what this launch
        created in the dump folder (the folder itself included) is removed again.
        """
        restore = self._install_signal_handlers()
        undo = False
        try:
            self.validate()
            self.trainer_config  # noqa: B018 - parse and check it now, before anything starts
            self._check_quorum()
            if self._stop_code is not None:  # Ctrl-C while torchtitan was being imported
                return self._stopped()
            self._lock_dump_folder()
            self._start()
            return self._supervise()
        except LaunchError as e:
            if str(e):
                self._out.line(f"local job failed: {e}")
            undo = e.status == 2 and not self.pids
            return e.status
        finally:
            self._teardown()
            self._release(undo)
            restore()

    def show_launch(self) -> int:
        """Print every process's command and the environment the launcher sets for it
        (CUDA_VISIBLE_DEVICES included); start nothing, write nothing."""
        try:
            self.validate()
            self.trainer_config  # noqa: B018 - the same checks as a real launch
            self._check_quorum()
        except LaunchError as e:
            self._out.line(f"local job failed: {e}")
            return e.status
        self.lighthouse_url = "<lighthouse url>"
        layout = (
            "CPU (no GPU visible)"
            if self.slices is None
            else f"{len(self.slices[0])} GPU(s) per group" + (", shared" if self.share_gpus else "")
        )
        self._out.line(
            f"dry run: {self.replicas} replica group(s) x {self.procs_per_replica} rank(s), "
            f"{layout}; dump folder {os.path.abspath(self.dump_folder)}; nothing is started"
        )
        self._out.line(f"[lh] {self._lighthouse_settings()}")
        for i in range(self.replicas):
            env = self.group_env(i)
            shown = {k: v for k, v in env.items() if os.environ.get(k) != v}
            self._out.line(f"[r{i}] " + " ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items()))
            self._out.line(f"[r{i}]   {shlex.join(self.group_command(i))}")
            for rank in range(self.procs_per_replica):
                device = "" if self.slices is None else f"  (cuda:{rank} = GPU {self.slices[i][rank]} of this machine)"
                self._out.line(
                    f"{self._prefix(i, rank)}   rank {rank}: torchrun sets RANK={rank} "
                    f"LOCAL_RANK={rank} WORLD_SIZE={self.procs_per_replica}{device}"
                )
        return 0

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

    def _lock_dump_folder(self) -> None:
        """Take the dump folder before writing anything into it: one live run per folder."""
        lock = DumpFolderLock(self.dump_folder)
        try:
            lock.acquire()
        except DumpFolderBusy as e:
            raise LaunchError(str(e), 2) from None
        except OSError as e:
            raise LaunchError(
                f"cannot create or lock the dump folder {self.dump_folder}: {e.strerror or e}", 2
            ) from None
        self._lock = lock
        if lock.stale is not None:
            self._out.line(f"local job: taking over a stale lock left by PID {lock.stale.pid}")

    def _announce_quorum(self) -> None:
        size, k, join_ms = self.quorum_size, self.replicas, self.resolved_join_timeout_ms
        rule = f"majority {size} of {k}" if size == majority(k) else f"{size} of {k}"
        self._out.line(
            f"local job: quorum = {rule} replica groups; the lighthouse waits up to "
            f"{join_ms / 1000:g} s for heartbeating groups"
        )
        source = "--min-replicas" if self.min_replicas else "--fault_tolerance.min_replica_size"
        warning = below_majority_warning(source, size, k)
        if warning:
            self._out.line(f"local job: warning: {warning}")
        cfg = self.trainer_config
        quorum_s = cfg.fault_tolerance.quorum_timeout_seconds if cfg is not None else None
        if quorum_s is not None and join_ms >= quorum_s * 1000:
            self._out.line(
                f"local job: warning: --join-timeout-ms {join_ms} is not below the "
                f"replicas' quorum timeout ({quorum_s:g} s): a replica gives up on "
                f"its quorum before the lighthouse stops waiting for a late group"
            )

    def _start(self) -> None:
        self._announce_quorum()
        try:
            self._created_dirs = make_dirs(self.resolved_log_dir)
        except OSError as e:
            raise LaunchError(f"cannot create the log folder {self.resolved_log_dir}: {e.strerror or e}", 2) from None
        self._reaper = GroupReaper()
        self._reaper.note_log(os.path.join(self.resolved_log_dir, "lighthouse.log"))  # if this launcher dies: why
        clear_stop_request()  # a request that stopped the last launch must not stop this one
        if self.netns:
            self._build_testbed()
        self._start_lighthouse()
        self._out.line(f"local job: logs in {os.path.abspath(self.resolved_log_dir)}")
        self._out.line(
            f"local job: {self.replicas} replica group(s) x {self.procs_per_replica} "
            f"rank(s), one torchrun each; replica 0's ranks run: "
            f"{shlex.join(self.replica_command(0))}"
        )
        self._groups = [ReplicaGroup(i) for i in range(self.replicas)]
        for g in self._groups:
            self._launch_group(g)
        self._out.line(
            "local job: torchrun pids " + " ".join(f"r{g.index}={g.agent.pid}" for g in self._groups if g.agent)
        )
        self.started.set()

    def _lighthouse_settings(self) -> str:
        return (
            f"torchft lighthouse in the launcher's process: bind {self.lighthouse_bind}, min_replicas "
            f"{self.quorum_size}, join_timeout_ms {self.resolved_join_timeout_ms}, quorum_tick_ms "
            f"{self.quorum_tick_ms}, heartbeat_timeout_ms {self.heartbeat_timeout_ms}"
        )

    def _build_testbed(self) -> None:
        tb = self._testbed()
        try:
            tb.build()
        except TestbedError as e:
            raise LaunchError(f"--netns: {e}", 2) from None
        state = tb.write_state(self.resolved_log_dir)
        self._created_files.append(state)
        shaped = f", links {self.link} (queue {self.link_queue_ms} ms)" if self.link else ", links unshaped"
        self._out.line(
            f"local job: hosts in network namespaces {tb.prefix}-*: "
            + ", ".join(f"{h} {tb.address(h)}" for h in tb.hosts)
            + f"{shaped}; recorded in {state}"
        )

    def _start_lighthouse(self) -> None:
        """The lighthouse runs in this process (torchft's server is a thread): its address is
        known when it returns, and it cannot outlive the launcher. ``lighthouse.log`` says where
        it listened, for each launch. With ``--netns`` it is a child inside its own namespace."""
        if self.netns:
            self._start_lighthouse_host()
            return
        try:
            self._lighthouse = start_lighthouse(
                self.lighthouse_bind,
                self.quorum_size,
                self.resolved_join_timeout_ms,
                self.quorum_tick_ms,
                self.heartbeat_timeout_ms,
            )
        except LighthouseError as e:
            raise LaunchError(f"the lighthouse refused to start: {e}", 2) from None
        self.lighthouse_url = self._lighthouse.url
        self._mark(
            [os.path.join(self.resolved_log_dir, "lighthouse.log")],
            f"=== launch {datetime.now().isoformat(timespec='seconds')} ===\n"
            f"{self._lighthouse_settings()}\nlighthouse listening on {self.lighthouse_url} "
            f"(status page: {self.lighthouse_url}/)",
        )
        self._out.line(
            f"local job: lighthouse {self.lighthouse_url} (in this process; status page: {self.lighthouse_url}/)"
        )

    def _start_lighthouse_host(self) -> None:
        """``python -m muloco.launch.lighthouse`` on the testbed's lighthouse host; up once it
        wrote its URL file (it dies with the launcher, as the groups do)."""
        tb = self._testbed()
        url_file = os.path.join(self.resolved_log_dir, "lighthouse.url")
        log = os.path.join(self.resolved_log_dir, "lighthouse.log")
        self._mark(
            [log], f"=== launch {datetime.now().isoformat(timespec='seconds')} ===\n{self._lighthouse_settings()}"
        )
        command = [
            *tb.exec_prefix("lighthouse"),
            sys.executable,
            "-m",
            "muloco.launch.lighthouse",
            "--bind",
            f"{tb.address('lighthouse')}:{LIGHTHOUSE_PORT}",
            "--min_replicas",
            str(self.quorum_size),
            "--join_timeout_ms",
            str(self.resolved_join_timeout_ms),
            "--quorum_tick_ms",
            str(self.quorum_tick_ms),
            "--heartbeat_timeout_ms",
            str(self.heartbeat_timeout_ms),
            "--url_file",
            url_file,
        ]
        output = GroupOutput(-1, [log], self._out, lambda text: None, prefix="[lh]")
        self._lighthouse_process = ManagedProcess(command, dict(os.environ), output, self._reaper, name="lh")
        self.pids.append(self._lighthouse_process.pid)
        while not os.path.exists(url_file):
            rc = self._lighthouse_process.poll()
            if rc is not None:
                self._lighthouse_process.join_pump()
                raise LaunchError(f"the lighthouse exited with {describe_exit(rc)} before it listened (log: {log})", 2)
            time.sleep(0.05)
        self._created_files.append(url_file)
        with open(url_file) as f:
            self.lighthouse_url = f.read().strip()
        self._out.line(
            f"local job: lighthouse {self.lighthouse_url} (host 'lighthouse', pid "
            f"{self._lighthouse_process.pid}; status page: {self.lighthouse_url}/ from inside the testbed)"
        )

    def _group_logs(self, g: ReplicaGroup) -> list[str]:
        return [self.log_path(g.index, r) for r in range(self.procs_per_replica)]

    def _mark(self, paths: list[str], line: str) -> None:
        """A separator line in each log, so relaunches are easy to find."""
        for path in paths:
            if not os.path.exists(path):
                self._created_files.append(path)
            with open(path, "a") as f:
                f.write(line + "\n")

    def _prefix(self, i: int, rank: int) -> str:
        return f"[r{i}]" if self.procs_per_replica == 1 else f"[r{i}.{rank}]"

    def _launch_group(self, g: ReplicaGroup) -> None:
        """Start group ``g``'s torchrun; its output is split by rank into the group's logs."""
        logs = self._group_logs(g)
        self._mark(logs, f"=== launch {datetime.now().isoformat(timespec='seconds')} ===")
        for log in logs:
            self._reaper.note_log(log)
        output = GroupOutput(g.index, logs, self._out, lambda text: self._on_failure(g, output, text))
        g.agent = ManagedProcess(
            self.group_command(g.index), self.group_env(g.index), output, self._reaper, name=f"r{g.index}"
        )
        self.pids.append(g.agent.pid)

    def _on_failure(self, g: ReplicaGroup, output: GroupOutput, text: str) -> None:
        """The agent's report of a failed attempt: a console line, and a restart mark."""
        m = _FAILED_RANK.match(text)
        g.failed_rank = int(m.group(1)) if m else 0
        restart = _RESTART.search(text)
        if restart is None:
            return  # no restart left: the agent exits with that status, _check_group says so
        g.restarts = int(restart.group(2))
        self._out.line(
            f"local job: replica {g.index} exited with {restart.group(1)}; restart {g.restarts}/{self.max_restarts}"
        )
        output.mark(f"=== restart {g.restarts} ===")

    def _stopped(self) -> int:
        assert self._stop_code is not None
        self._out.line(f"local job stopped: interrupted (exit {self._stop_code})")
        return self._stop_code

    def _supervise(self) -> int:
        """Poll the torchrun agents every 0.1 s (they restart their own ranks); stop at the first
        agent that fails for good."""
        while True:
            if self._stop_code is not None:
                return self._stopped()
            for g in self._groups:
                failed = self._check_group(g)
                if failed is not None:
                    return failed
            if all(g.done for g in self._groups):
                stopped = [g.index for g in self._groups if g.preempted]
                if stopped:
                    self._out.line(
                        f"local job stopped on request: replica(s) {', '.join(map(str, stopped))} "
                        f"wrote a checkpoint and stopped; the same command resumes"
                    )
                    return EXIT_PREEMPTED
                self._out.line(f"local job finished: {self.replicas} replicas ok")
                return 0
            time.sleep(0.1)

    def _check_group(self, g: ReplicaGroup) -> int | None:
        """Whether group ``g`` finished; an exit status only when the job must fail (its
        torchrun has no restart left, and exits with the failed rank's status)."""
        if g.done or g.agent is None:
            return None
        rc = g.agent.poll()
        if rc is None:
            return None
        if rc in (0, EXIT_PREEMPTED):  # finished, or stopped on request with a checkpoint
            g.done, g.preempted = True, rc == EXIT_PREEMPTED
            return None
        g.agent.join_pump()  # its last lines (and the failed rank) first
        self._out.line(
            f"local job failed: replica {g.index} exited with {describe_exit(rc)} "
            f"(log: {self.log_path(g.index, g.failed_rank)})"
        )
        return shell_status(rc) or 1

    def _hurry(self) -> bool:
        """A second Ctrl-C skips the grace period."""
        return self._stop_requests >= 2

    def _teardown(self) -> None:
        """Children first (they may still talk to the lighthouse while saving), then the lighthouse."""
        stop_processes([g.agent for g in self._groups if g.agent], self.term_grace_s, self._hurry)
        if self._lighthouse:
            self._lighthouse.shutdown()
            self._lighthouse = None
        if self._lighthouse_process is not None:
            stop_processes([self._lighthouse_process], self.term_grace_s, self._hurry)
            self._lighthouse_process = None
        if self.testbed is not None:
            self.testbed.close()  # its namespaces, veths and addresses
            try:  # and its record: a drill against a finished job is told there is none
                os.unlink(os.path.join(self.resolved_log_dir, STATE_FILE))
            except OSError:
                pass

    def _release(self, undo: bool) -> None:
        """After teardown: dismiss the watchdog, then unlock the dump folder; with ``undo``
        (a refused launch), first remove the files and folders this launch created."""
        if self._reaper:
            self._reaper.close()
            self._reaper = None
        if undo:
            for path in self._created_files:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            remove_dirs(self._created_dirs)
        if self._lock:
            self._lock.release(remove_created=undo)
            self._lock = None


def job_from_args(argv: list[str]) -> LocalJob:
    """The command line to a LocalJob: the launcher's options, and the trainer overrides after ``--``."""
    options, overrides = parse(
        LaunchOptions, argv, prog="python -m muloco.launch.local", description=LaunchOptions.__doc__
    )
    return LocalJob(**dataclasses.asdict(options), overrides=overrides)


def main(argv: list[str] | None = None) -> int:
    try:
        job = job_from_args(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        return failed("local", e)
    return job.show_launch() if job.dry_run else job.run()


if __name__ == "__main__":
    run_main(main)
