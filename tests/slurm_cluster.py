"""A real single-node SLURM (munged + slurmctld + slurmd) on localhost, private to one directory.

Everything (slurm.conf, munge key and socket, state, pid files, logs) lives under ``root``; clients
and daemons find the config through ``SLURM_CONF``, so nothing system-wide is touched and the
cluster can run beside another one (own port pair). Debian 12's Slurm 22.05 without systemd, run
as root; see /work/shared/reference/local-slurm-facts.md for why each setting is there.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from progress import until

REPO = Path(__file__).resolve().parents[1]
INSTALL_SCRIPT = REPO / "scripts" / "install_test_slurm.sh"
BINARIES = ("slurmctld", "slurmd", "sbatch", "munged")
# Daemons live in /usr/sbin, which a non-login PATH may lack.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
_MARKER = ".local_slurm"  # only a directory carrying this (or an empty one) is ever wiped
START_TIMEOUT = 120.0  # only a hang timeout for a daemon to come up
KILL_AFTER = 15.0

# A requeued job may start again only cred_expire (default 120 s) later, and nothing wakes the
# scheduler then: only its periodic pass (sched_interval, default 60 s) starts it. 5 s (22.05
# rejects less: "AuthInfo=cred_expire=1 invalid", and falls back to 120) and 1 s make a requeue
# take ~6 s.
CRED_EXPIRE = 5

SLURM_CONF = """\
ClusterName=localtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
KillWait=5
MinJobAge=3600
SchedulerParameters=batch_sched_delay=0,sched_interval=1
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
JobRequeue=1
NodeName=localhost CPUs={cpus} RealMemory={memory} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
PartitionName=long Nodes=localhost MaxTime=INFINITE State=UP
PartitionName=short Nodes=localhost MaxTime=30 State=UP
"""

# submitit asks `sacct -o JobID,State,NodeList --parsable2 -j ID`; without an accounting database
# sacct fails and submitit's result() can hang forever, so answer from squeue (MinJobAge keeps
# finished jobs there for an hour).
SACCT = '''#!{python}
"""sacct substitute for a test cluster without accounting: answers from squeue."""
import subprocess, sys

COLUMNS = {{"jobid": ("JobID", "%i"), "jobname": ("JobName", "%j"), "partition": ("Partition", "%P"),
           "state": ("State", "%T"), "nodelist": ("NodeList", "%N")}}
fields, jobs, header, trail = ["jobid", "jobname", "partition", "state", "nodelist"], set(), True, ""
args = iter(sys.argv[1:])
for arg in args:
    key, _, val = arg.partition("=")
    if key in ("-o", "--format"):
        fields = [f.lower() for f in (val or next(args)).split(",")]
    elif key in ("-j", "--jobs"):
        jobs.update((val or next(args)).split(","))
    elif key in ("-n", "--noheader"):
        header = False
    elif key in ("-p", "--parsable"):
        trail = "|"
out = subprocess.run(["squeue", "--states=all", "--array", "--noheader", "-o",
                      "|".join(COLUMNS[f][1] if f in COLUMNS else "" for f in fields)],
                     capture_output=True, text=True)
if out.returncode:
    sys.stderr.write(out.stderr)
    sys.exit(out.returncode)
if header:
    print("|".join(COLUMNS.get(f, (f,))[0] for f in fields) + trail)
jid = fields.index("jobid") if "jobid" in fields else None
for line in out.stdout.splitlines():
    cells = [c.strip() for c in line.split("|")]
    if not jobs or jid is None or cells[jid] in jobs or cells[jid].split("_")[0] in jobs:
        print("|".join(cells) + trail)
'''


class SlurmError(RuntimeError):
    """A cluster that failed to start or stop, or a client command that failed."""


def which(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def ensure_slurm_installed() -> str | None:
    """None when the binaries are there; otherwise run the install script (the suite's only
    way to get them) and return why it failed, for the fixture's skip message."""
    if all(which(b) for b in BINARIES):
        return None
    try:
        proc = subprocess.run([str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{INSTALL_SCRIPT.name} failed: {e}"
    if proc.returncode:
        why = (proc.stderr or proc.stdout).strip()[-500:]
        return f"{INSTALL_SCRIPT.name} exited {proc.returncode}: {why}"
    missing = [b for b in BINARIES if not which(b)]
    return f"still missing after install: {', '.join(missing)}" if missing else None


def port_free(port: int) -> bool:
    """The daemons bind 0.0.0.0 (22.05 has no bind address), so check that, not localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_ports(n: int, host: str) -> list[int]:
    from muloco.utils.ports import free_ports as free

    return free(n, host=host)


RDZV_PORTS = range(26400, 29400)
"""Where muloco.launch.slurm.group puts its rendezvous stores: no daemon may sit there."""


def _daemon_ports(n: int) -> list[int]:
    """``n`` distinct free ports (0.0.0.0, where the daemons bind) outside the rendezvous range."""
    for _ in range(50):
        ports = free_ports(n, host="0.0.0.0")
        if len(set(ports)) == n and all(port_free(p) and p not in RDZV_PORTS for p in ports):
            return ports
    raise SlurmError(f"no {n} free ports found")


def free_port_pair() -> tuple[int, int]:
    for _ in range(50):
        ports = free_ports(2, host="0.0.0.0")
        if all(port_free(p) for p in ports):
            return ports[0], ports[1]
    raise SlurmError("no free port pair found")


def pid_alive(pid: int) -> bool:
    """kill -0 says a zombie is alive; PID 1 here reaps orphans late, so read the state."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def proc_comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def proc_environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _wait_until(check, timeout: float, interval: float = 0.1, progress=None) -> bool:
    """Poll ``check`` until true (True) or the wait is over (False): ``timeout`` seconds, or with
    ``progress`` (``tests/progress.py``) once it says the runs stopped making progress."""
    try:
        until("", check, timeout, interval, progress=progress)
    except AssertionError:  # the wait is over: the caller says what did not happen
        return False
    return True


def _parse_record(line: str) -> dict[str, str]:
    """One `scontrol show job -o` line as KEY=VALUE pairs (values with spaces are not needed)."""
    return dict(tok.split("=", 1) for tok in line.split() if "=" in tok)


class LocalSlurm:
    """munged + slurmctld + slurmd under ``root``, started and stopped by PID, never by name."""

    def __init__(self, root: Path, cpus: int = 8, ports: tuple[int, int] | None = None, nodes: int = 1):
        """``nodes`` > 1: that many slurmd on localhost (Debian's build allows it), named n1..nN,
        each with ``cpus`` CPUs, its own port and NodeAddr=127.0.0.1 (the names do not resolve:
        what runs on them must use SLURM's NodeAddr)."""
        self.root = Path(root).resolve()
        self.cpus = cpus
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)] if nodes > 1 else ["localhost"]
        drawn = _daemon_ports(2 + (nodes if nodes > 1 else 0))
        self.ports = ports or (drawn[0], drawn[1])
        self.node_ports = drawn[2:]
        self.DAEMONS = ("munged", "slurmctld", *(("slurmd",) if nodes == 1 else (f"slurmd-{n}" for n in self.nodes)))
        self.conf = self.root / "etc" / "slurm.conf"
        self.bin = self.root / "bin"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self._pids: dict[str, int] = {}
        self._reaper: subprocess.Popen | None = None

    # ---- environment and clients -------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """What clients (and jobs, which inherit it) need: our conf, and our sacct first on PATH."""
        return {"SLURM_CONF": str(self.conf), "PATH": os.pathsep.join([str(self.bin), _SEARCH_PATH])}

    def run(
        self, cmd: Sequence[str], check: bool = True, timeout: float = 30, **kw
    ) -> subprocess.CompletedProcess[str]:
        """A client command against this cluster; a failure raises with its stderr in the message."""
        env = {**os.environ, **self.env, **kw.pop("env", {})}
        proc = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and proc.returncode:
            raise SlurmError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def sbatch(self, *args: str) -> str:
        """Submit; the job id (``--parsable`` prints ``id`` or ``id;cluster``)."""
        return self.run(["sbatch", "--parsable", *args]).stdout.strip().split(";")[0]

    def job_states(self, job_id: str) -> dict[str, str]:
        """State of each record of a job: one for a plain job or one array task (``12_1``), one per
        task for an array id (plus a pending meta record ``12_[..]``); {} when unknown."""
        proc = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        states = {}
        for line in proc.stdout.splitlines():
            rec = _parse_record(line)
            if "JobState" not in rec:
                continue
            name = rec["JobId"]
            if rec.get("ArrayJobId") and rec.get("ArrayTaskId"):
                task = rec["ArrayTaskId"]
                name = f"{rec['ArrayJobId']}_{task if task.isdigit() else f'[{task}]'}"
            states[name] = rec["JobState"]
        return states

    def job_state(self, job_id: str) -> str | None:
        """State of one job or array task; None when unknown; an array id needs job_states."""
        states = self.job_states(job_id)
        if str(job_id) in states:
            return states[str(job_id)]
        if len(states) > 1:
            raise ValueError(f"{job_id} has several records {sorted(states)}; use job_states")
        return next(iter(states.values()), None)

    def wait_state(self, job_id: str, states: Iterable[str], timeout: float = 30) -> str:
        """Poll until the job reaches one of ``states`` (e.g. RUNNING before a scancel)."""
        wanted = set(states)
        if not _wait_until(lambda: self.job_state(job_id) in wanted, timeout):
            raise TimeoutError(
                f"job {job_id} not in {wanted} after {timeout}s: {self.job_state(job_id)}\n" + self.logs()
            )
        return self.job_state(job_id)

    def wait_jobs_done(self, job_ids: Iterable[str], timeout: float = 30, progress=None) -> dict[str, str]:
        """Poll until every record of every job is terminal; {job or task id: state}. Jobs that
        train are given their runs' ``progress`` (``tests/progress.py``): they are hung when it
        stops, however long they take; ``timeout`` is for jobs that write nothing to watch."""
        ids = [str(j) for j in job_ids]
        seen: dict[str, str] = {}

        def done() -> bool:
            seen.clear()
            for jid in ids:
                seen.update(self.job_states(jid) or {jid: "UNKNOWN"})
            return all(s in TERMINAL for s in seen.values())

        if not _wait_until(done, timeout, interval=0.2, progress=progress):
            queue = self.run(["squeue", "-t", "all", "--array"], check=False).stdout
            why = progress if progress is not None else f"after {timeout}s"
            raise TimeoutError(f"jobs not done ({why}): {seen}\n{queue}\n{self.logs()}")
        return dict(seen)

    def logs(self, lines: int = 30) -> str:
        """Tails of the daemon logs and the jobcomp file, for failure messages."""
        parts = []
        slurmd_logs = ["slurmd.log"] if not self.node_ports else [f"slurmd-{n}.log" for n in self.nodes]
        for name in ("munged.log", "slurmctld.log", *slurmd_logs, "jobcomp.txt", "start.log"):
            path = self.root / "log" / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(parts) or f"(no logs under {self.root / 'log'})"

    # ---- start ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start munged, slurmctld, slurmd in order, each polled until ready; on failure stop what
        was started and raise with the log tails."""
        self._check_can_start()
        self._prepare_dirs()
        self._write_files()
        self._start_reaper()
        try:
            self._start_munged()
            self._start_daemon("slurmctld", [which("slurmctld")], self._ctld_up)
            for node, daemon in zip(self.nodes, self.DAEMONS[2:]):
                self._start_daemon(daemon, [which("slurmd"), "-N", node], lambda node=node: self._node_idle(node))
        except BaseException as e:
            logs = self.logs()
            self.stop()
            raise SlurmError(f"local slurm failed to start: {e}\n{logs}") from e

    def _start_reaper(self) -> None:
        """A watcher in its own session that stops this cluster once the process that started it
        is gone without stopping it: a suite killed by SIGTERM or SIGKILL runs no fixture
        finalizer, and the daemons, which fork themselves away, would run on."""
        nodes = len(self.nodes) if self.node_ports else 1
        with open(self.root / "log" / "reaper.log", "a") as log:
            self._reaper = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--stop-when-gone",
                    str(os.getpid()),
                    str(self.root),
                    str(self.cpus),
                    str(nodes),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _check_can_start(self) -> None:
        missing = [b for b in BINARIES if not which(b)]
        if missing:
            raise SlurmError(f"not installed: {', '.join(missing)} (run {INSTALL_SCRIPT})")
        running = [n for n in self.DAEMONS if self._pid_of(n)]
        if running:
            raise SlurmError(f"already running under {self.root}: {', '.join(running)}")
        busy = [p for p in self.ports if not port_free(p)]
        if busy:
            raise SlurmError(f"port(s) busy: {busy}")

    def _prepare_dirs(self) -> None:
        """A fresh cluster each time (job ids restart at 1), but only wipe a directory we made."""
        if self.root.exists() and any(self.root.iterdir()):
            if not (self.root / _MARKER).exists():
                raise SlurmError(f"{self.root} is not empty and not a LocalSlurm directory")
            shutil.rmtree(self.root)
        for sub in ("etc", "bin", "state", "spool", "run", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / _MARKER).touch()
        # munged wants a socket dir everyone may enter and logs that are not world-writable.
        (self.root / "munge").chmod(0o755)
        (self.root / "log").chmod(0o755)

    def _write_files(self) -> None:
        conf = SLURM_CONF.format(
            root=self.root,
            cpus=self.cpus,
            memory=_real_memory_mb(),
            ctld_port=self.ports[0],
            slurmd_port=self.ports[1],
            munge_socket=self.munge_socket,
            cred_expire=CRED_EXPIRE,
        )
        if self.node_ports:
            conf = self._several_nodes(conf)
        self.conf.write_text(conf)
        sacct = self.bin / "sacct"
        sacct.write_text(SACCT.format(python=sys.executable))
        sacct.chmod(0o755)
        (self.root / "env").write_text("".join(f"export {k}={v}\n" for k, v in self.env.items()))

    def _several_nodes(self, conf: str) -> str:
        """The one-node config with ``self.nodes`` slurmd instead: per-node pid, log and spool
        (``%n``), port and the address they all share."""
        for key, path in (("SlurmdPidFile", "run/slurmd"), ("SlurmdLogFile", "log/slurmd")):
            ext = ".pid" if key == "SlurmdPidFile" else ".log"
            conf = conf.replace(f"{key}={self.root}/{path}{ext}", f"{key}={self.root}/{path}-%n{ext}")
        conf = conf.replace(f"SlurmdSpoolDir={self.root}/spool", f"SlurmdSpoolDir={self.root}/spool/%n")
        lines = [ln for ln in conf.splitlines() if not ln.startswith(("NodeName=", "PartitionName="))]
        memory = max(256, _real_memory_mb() // len(self.nodes))
        lines += [
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} "
            f"RealMemory={memory} State=UNKNOWN"
            for n, p in zip(self.nodes, self.node_ports)
        ]
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        for n in self.nodes:
            (self.root / "spool" / n).mkdir(parents=True, exist_ok=True)
        return "\n".join(lines) + "\n"

    def _start_munged(self) -> None:
        munge = self.root / "munge"
        key = munge / "munge.key"
        self._call([which("mungekey"), "--create", f"--keyfile={key}"])
        key.chmod(0o600)
        # --force: munged also wants every parent of the socket enterable by all users, and
        # pytest's basetemp is 0700; only root uses this cluster, so that check does not apply.
        self._start_daemon(
            "munged",
            [
                which("munged"),
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self.root / 'run' / 'munged.pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
            self._munge_ok,
        )

    def _call(self, cmd: list) -> None:
        """Run a setup command, its output appended to log/start.log."""
        with open(self.root / "log" / "start.log", "a") as log:
            log.write(f"$ {' '.join(map(str, cmd))}\n")
            log.flush()
            subprocess.run(
                [str(c) for c in cmd],
                env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=START_TIMEOUT,
                check=True,
                start_new_session=True,
            )

    def _start_daemon(self, name: str, cmd: list, ready) -> None:
        """Each daemon forks itself away and writes its pid file; poll that, then ``ready``."""
        self._call(cmd)
        deadline = time.monotonic() + START_TIMEOUT
        if not _wait_until(lambda: self._pid_of(name), START_TIMEOUT):
            raise SlurmError(f"{name} wrote no live pid file")
        pid = self._pids[name] = self._pid_of(name)
        _wait_until(lambda: not pid_alive(pid) or ready(), max(1.0, deadline - time.monotonic()))
        if not pid_alive(pid):
            raise SlurmError(f"{name} (pid {pid}) exited while starting")
        if not ready():
            raise SlurmError(f"{name} (pid {pid}) not ready after {START_TIMEOUT}s")

    def _munge_ok(self) -> bool:
        cred = subprocess.run([which("munge"), "-S", str(self.munge_socket), "-n"], capture_output=True)
        if cred.returncode:
            return False
        return (
            subprocess.run(
                [which("unmunge"), "-S", str(self.munge_socket)], input=cred.stdout, capture_output=True
            ).returncode
            == 0
        )

    def _ctld_up(self) -> bool:
        return "UP" in self.run(["scontrol", "ping"], check=False, timeout=10).stdout

    def _node_idle(self, node: str = "localhost") -> bool:
        out = self.run(["sinfo", "-h", "-n", node, "-o", "%t"], check=False, timeout=10).stdout
        return out.split()[:1] == ["idle"]

    # ---- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel all jobs (slurmstepd outlives the daemons), stop the daemons by PID, then kill
        any job process of this cluster that is left (SLURM_CONF=<our conf> in its environment)."""
        if self._pid_of("slurmctld"):
            self._cancel_all()
        for name in reversed(self.DAEMONS):
            pid = self._pid_of(name) or self._pids.get(name)
            if pid and pid_alive(pid) and proc_comm(pid) == name.split("-")[0][:15]:
                self._terminate(pid)
        self._pids.clear()
        self._kill_leftovers()
        if self._reaper is not None and self._reaper.poll() is None:
            self._reaper.terminate()
            self._reaper.wait()

    def job_ids(self, *, ended_too: bool = False) -> set[str]:
        """The ids of the jobs in the queue (each array task its own id); with ``ended_too``, also
        the ended ones slurmctld still lists; empty when squeue fails."""
        proc = self.run(["squeue", "-h", "-o", "%A", *(["-t", "all"] if ended_too else [])], check=False, timeout=10)
        return set(proc.stdout.split()) if proc.returncode == 0 else set()

    def cancel(self, jobs: Iterable[str]) -> None:
        """Cancel ``jobs`` and wait (a bounded while) until they left the queue."""
        jobs = set(jobs)
        if jobs:
            self.run(["scancel", *sorted(jobs)], check=False, timeout=10)
            _wait_until(lambda: not (self.job_ids() & jobs), 5 + KILL_AFTER, interval=0.2)

    def _cancel_all(self) -> None:
        self.cancel(self.job_ids())

    @staticmethod
    def _terminate(pid: int) -> None:
        os.kill(pid, signal.SIGTERM)
        if not _wait_until(lambda: not pid_alive(pid), KILL_AFTER, interval=0.05):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait_until(lambda: not pid_alive(pid), 5, interval=0.05)

    def _kill_leftovers(self) -> None:
        """SIGKILL slurmstepd and job processes of this cluster (a job may fork meanwhile, hence
        a few rounds) and wait until they are gone; never ourselves or our ancestors."""
        for _ in range(5):
            pids = self._leftover_pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _wait_until(lambda: not any(pid_alive(p) for p in pids), 5, interval=0.05)

    def _leftover_pids(self) -> list[int]:
        spare = _ancestors(os.getpid())
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in spare or not pid_alive(int(entry.name)):
                continue
            env = proc_environ(int(entry.name))
            if env.get("SLURM_CONF") == str(self.conf) and (
                proc_comm(int(entry.name)) == "slurmstepd" or "SLURM_JOB_ID" in env
            ):
                pids.append(int(entry.name))
        return pids

    def _pid_of(self, name: str) -> int | None:
        """The PID in the daemon's pid file if that process is alive and really that daemon."""
        try:
            pid = int((self.root / "run" / f"{name}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if pid_alive(pid) and proc_comm(pid) == name.split("-")[0][:15] else None

    def status(self) -> str:
        """'up', 'down' or 'partly up: ...' from the pid files."""
        up = [n for n in self.DAEMONS if self._pid_of(n)]
        return "up" if len(up) == len(self.DAEMONS) else "down" if not up else f"partly up: {', '.join(up)}"

    def __enter__(self) -> LocalSlurm:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _ancestors(pid: int) -> set[int]:
    out = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def _real_memory_mb() -> int:
    """RealMemory from `slurmd -C` so that --mem requests are accepted; 1024 if it says nothing."""
    try:
        out = subprocess.run([which("slurmd"), "-C"], capture_output=True, text=True, timeout=10).stdout
        return int(out.split("RealMemory=")[1].split()[0])
    except (OSError, IndexError, ValueError, TypeError, subprocess.TimeoutExpired):
        return 1024


def stop_when_gone(owner: int, root: str, cpus: str, nodes: str) -> None:
    """Wait for ``owner`` to exit (an event on its pidfd; polled where there is none), then stop the cluster
    under ``root`` as :meth:`LocalSlurm.stop` does: jobs, daemons, leftovers, all by PID."""
    try:
        fd = os.pidfd_open(owner)
        select.select([fd], [], [])
    except ProcessLookupError:
        pass  # gone already
    except OSError:  # no pidfd here (an old kernel, a sandbox): ask once a second instead
        while pid_alive(owner):
            time.sleep(1.0)
    print(f"process {owner} is gone; stopping the cluster under {root}", flush=True)
    LocalSlurm(Path(root), int(cpus), nodes=int(nodes)).stop()


if __name__ == "__main__" and sys.argv[1:2] == ["--stop-when-gone"]:
    stop_when_gone(*(int(sys.argv[2]), *sys.argv[3:6]))
