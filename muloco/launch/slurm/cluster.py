"""Cluster settings for generated SLURM jobs, and their check against the live cluster.

Where a value comes from, last wins:

1. built-in defaults (nothing cluster-specific: no partition, account or QOS is assumed);
2. the user's file, ``~/.config/muloco/cluster.toml`` (or ``$MULOCO_CLUSTER_FILE``)::

       partition = "gpu"
       account = "my-lab"
       qos = "normal"
       time = "24:00:00"
       gpus_per_node = 8
       cpus_per_node = 96
       reservation = "lab-week"               # also exclusive, exclude, gres, mail_type, mail_user
       setup = ["module load cuda/12.8"]      # shell lines run before the job; one failing stops it
       [env]                                   # exported in every job (NCCL, EFA, ...)
       NCCL_IB_DISABLE = "0"

3. environment variables ``MULOCO_SLURM_<KEY>`` (``MULOCO_SLURM_PARTITION=gpu``);
4. the generator's command-line flags.

Nothing cluster-specific is written into the repository, and a key this module does not know
is an error naming the known ones (MuLoCo's generator silently ignored ``--partition`` and
``--account``). :func:`check_request` refuses, before anything is written or submitted, a
partition the cluster does not have, a time over its MaxTime, more GPUs, CPUs or memory per node
than its nodes have, and more nodes than it holds; it warns when too few of them are up now.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path

import tomli

from muloco.launch.slurm.commands import SlurmCommandError, slurm
from muloco.utils.errors import BadInput

CLUSTER_FILE_VAR = "MULOCO_CLUSTER_FILE"
ENV_PREFIX = "MULOCO_SLURM_"
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
_SECRET = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD)", re.IGNORECASE)
_IFNAME = re.compile(r"^[\^=]?[A-Za-z0-9_.:@-]+(,[A-Za-z0-9_.:@-]+)*$")
"""NCCL_SOCKET_IFNAME's syntax: interface names or prefixes, comma-separated, ^ to exclude, = for exact."""


class ClusterError(BadInput, ValueError):
    """Bad cluster settings; the message names the setting, where it came from, and the fix."""


class ClusterUnreachable(ClusterError):
    """sinfo is missing or fails: the settings cannot be checked from this machine."""


def default_cluster_file() -> Path:
    return Path(os.environ.get(CLUSTER_FILE_VAR) or Path.home() / ".config" / "muloco" / "cluster.toml")


@dataclass
class ClusterOptions:
    """The cluster settings a command line may give (the last of the four sources); None: unset."""

    partition: str | None = None
    """SLURM partition (default: the cluster file, MULOCO_SLURM_PARTITION, else the cluster's default)."""
    account: str | None = None
    """SLURM account (default: the cluster file or MULOCO_SLURM_ACCOUNT)."""
    qos: str | None = None
    """SLURM QOS (default: the cluster file or MULOCO_SLURM_QOS)."""
    time: str | None = None
    """Wall-clock limit, MM, HH:MM:SS or D-HH:MM:SS (default: the cluster file, else 04:00:00)."""
    mem: str | None = None
    """Memory per node, SLURM's format (default: the cluster file, else SLURM's)."""
    constraint: str | None = None
    """Node features, SLURM's --constraint (default: the cluster file)."""
    exclusive: bool = False
    """Whole nodes only, SLURM's --exclusive (also on when the cluster file sets it)."""
    exclude: str | None = None
    """Nodes never to use, SLURM's --exclude (default: the cluster file)."""
    reservation: str | None = None
    """SLURM reservation (default: the cluster file or MULOCO_SLURM_RESERVATION)."""
    gres: str | None = None
    """Generic resources per node, SLURM's --gres, e.g. gpu:h100:8 (default: the cluster file)."""
    mail_type: str | None = None
    """SLURM --mail-type, e.g. END,FAIL (default: the cluster file)."""
    mail_user: str | None = None
    """SLURM --mail-user (default: the cluster file)."""
    gpus_per_node: int | None = None
    """GPUs per node (default: what the partition's nodes have; 0 runs on CPUs)."""
    cpus_per_node: int | None = None
    """CPUs per node (default: what the partition's nodes have)."""
    socket_ifname: str | None = None
    """Network interface for gloo and NCCL sockets between nodes, e.g. ib0 or eth0 (exported as
    GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME; default: the cluster file, else their own choice)."""
    lighthouse_partition: str | None = None
    """The lighthouse job's partition, e.g. a CPU one (default: the cluster file, else the groups')."""
    lighthouse_qos: str | None = None
    """The lighthouse job's QOS (default: the cluster file, else the groups')."""
    lighthouse_time: str | None = None
    """The lighthouse job's time limit; longer than the groups' keeps it in place (default: theirs)."""

    def settings(self) -> ClusterSettings:
        """Defaults, the user's file and MULOCO_SLURM_*, then these options."""
        flags = dataclasses.asdict(self)
        flags["exclusive"] = flags["exclusive"] or None  # the flag only turns it on
        return load_cluster_settings(flags)


@dataclass
class ClusterSettings(ClusterOptions):
    """The settings resolved (defaults, the user's file, MULOCO_SLURM_*, the flags): what an
    sbatch header needs from the cluster. None: let SLURM (or sinfo) decide."""

    time: str = "04:00:00"
    """Wall-clock limit, SLURM's format (``MM``, ``HH:MM:SS``, ``D-HH:MM:SS``)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before the job; one failing stops it (the cluster file's ``setup``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Exported in every job (the cluster file's ``[env]`` table)."""

    def validate(self) -> None:
        for key in ("time", "lighthouse_time"):
            value = getattr(self, key)
            if value is not None and not _TIME.match(value):
                raise ClusterError(f"{key} {value!r} is not a SLURM time: use MM, HH:MM:SS or D-HH:MM:SS")
        if self.mem is not None:
            mem_mb(self.mem)
        for key in ("gpus_per_node", "cpus_per_node"):
            value = getattr(self, key)
            if value is not None and value < (0 if key == "gpus_per_node" else 1):
                raise ClusterError(f"{key} must be {'>= 0' if key == 'gpus_per_node' else '>= 1'}, got {value}")
        if self.socket_ifname is not None and not _IFNAME.match(self.socket_ifname):
            raise ClusterError(
                f"socket_ifname {self.socket_ifname!r} is not a list of network interfaces: names (or "
                "prefixes) separated by commas, no spaces, optionally led by ^ (all but these, NCCL "
                "only) or = (exact names), e.g. ib0, eth0,eth1 or ^docker,lo"
            )
        secrets = sorted(k for k in self.env if _SECRET.search(k))
        if secrets:
            raise ClusterError(
                f"cluster env sets {', '.join(secrets)}: secrets are never written into job "
                f"files; export them in your shell before submitting (sbatch passes the "
                f"environment on) and drop them from the [env] table"
            )


_FIELDS = {f.name: f for f in dataclasses.fields(ClusterSettings)}


def _coerce(key: str, value, source: str):
    """A value from a file or the environment, as the field's type; a wrong type names both."""
    kind = _FIELDS[key].type
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if str(value).strip().lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).strip().lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError
        if "int" in kind:
            return None if value in ("", None) else int(value)
        if key == "setup":
            return [value] if isinstance(value, str) else [str(v) for v in value]
        if key == "env":
            if not isinstance(value, dict):
                raise TypeError
            return {str(k): str(v) for k, v in value.items()}
        return None if value == "" else str(value)
    except (TypeError, ValueError):
        raise ClusterError(f"{source}: {key} = {value!r} is not a valid {kind}") from None


def _merge(settings: ClusterSettings, values: dict, source: str) -> None:
    for key, value in values.items():
        if key not in _FIELDS:
            raise ClusterError(f"{source}: unknown cluster setting {key!r}; known: {', '.join(_FIELDS)}")
        setattr(settings, key, _coerce(key, value, source))


def load_cluster_settings(
    flags: dict | None = None, path: Path | None = None, environ: dict[str, str] | None = None
) -> ClusterSettings:
    """Defaults, then the user's file, then ``MULOCO_SLURM_*``, then ``flags`` (None: unset)."""
    settings = ClusterSettings()
    path = path or default_cluster_file()
    if path.is_file():
        try:
            _merge(settings, tomli.loads(path.read_text()), str(path))
        except tomli.TOMLDecodeError as e:
            raise ClusterError(f"{path}: not valid TOML ({e}); fix or remove it") from None
    environ = os.environ if environ is None else environ
    from_env = {
        k[len(ENV_PREFIX) :].lower(): v
        for k, v in environ.items()
        if k.startswith(ENV_PREFIX) and k != CLUSTER_FILE_VAR
    }
    _merge(settings, from_env, "environment " + ENV_PREFIX + "*")
    _merge(settings, {k: v for k, v in (flags or {}).items() if v is not None}, "command line")
    settings.validate()
    return settings


@dataclass(frozen=True)
class NodeInfo:
    """One node of a partition as sinfo reports it."""

    partition: str
    name: str
    cpus: int
    gpus: int
    mem_mb: int | None = None
    """The node's memory for jobs (sinfo %m); None: not reported."""
    state: str = "idle"
    """sinfo's short state (idle, mix, alloc, drain, down, ...; a trailing * means not responding)."""
    max_time_min: int | None = None
    """The partition's MaxTime in minutes; None: unlimited."""
    default: bool = False
    """The partition is the cluster's default (sinfo marks it with ``*``)."""

    @property
    def usable(self) -> bool:
        """A node a new job can start on (not down, drained, draining, failed or unresponsive)."""
        base = self.state.rstrip("~#%!$@^-+")
        return not base.endswith("*") and base not in UNUSABLE_STATES


UNUSABLE_STATES = {
    "down",
    "drain",
    "drng",
    "drained",
    "draining",
    "fail",
    "failg",
    "failing",
    "inval",
    "maint",
    "unk",
    "unknown",
    "futr",
    "future",
}


def _gpus(gres: str) -> int:
    """GPUs in a gres string such as ``gpu:h100:8(S:0-1),shard:2`` (0 for ``(null)``)."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def slurm_minutes(value: str) -> int | None:
    """Minutes of a SLURM time (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``); None for
    ``infinite``/``UNLIMITED``."""
    text = value.strip().lower()
    if text in ("infinite", "unlimited", "n/a", ""):
        return None
    days, _, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:
        parts += [0] * (3 - len(parts))
        hours, minutes, seconds = parts
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return int(days or 0) * 1440 + hours * 60 + minutes + (1 if seconds else 0)


def mem_mb(value: str) -> int:
    """Megabytes of a SLURM ``--mem`` value (MB without a unit)."""
    m = re.match(r"^(\d+)([KMGT]?)B?$", value.strip(), re.IGNORECASE)
    if not m:
        raise ClusterError(f"mem {value!r} is not SLURM's format (a number with an optional K, M, G or T: 64G)")
    return int(int(m.group(1)) * {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2, "": 1}[m.group(2).upper()])


SINFO_TIMEOUT_S = 60.0
"""How long sinfo may take to answer (a controller that is down makes it retry for minutes)."""


CONTROLLER_PROBE_S = 3.0
"""How long a connection to slurmctld may take before the cluster counts as down."""


def controllers(env: dict[str, str] | None = None) -> tuple[Path, list[tuple[str, int]]] | None:
    """(slurm.conf, the controllers it names as (address, port)), or None without a readable
    slurm.conf (a configless cluster: sinfo finds the controller through DNS itself)."""
    conf = Path((os.environ if env is None else env).get("SLURM_CONF") or "/etc/slurm/slurm.conf")
    try:
        text = conf.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    hosts, port = [], 6817
    for line in text.splitlines():
        key, _, value = line.split("#", 1)[0].strip().partition("=")
        key, value = key.strip().lower(), value.strip()
        if key in ("slurmctldhost", "controlmachine") and value:  # name(address): the address if given
            hosts.append(value[value.index("(") + 1 : value.rindex(")")] if "(" in value and ")" in value else value)
        elif key == "slurmctldport" and value.split("-")[0].isdigit():
            port = int(value.split("-")[0])
    return (conf, [(host, port) for host in hosts]) if hosts else None


def probe_controllers(env: dict[str, str] | None = None, timeout: float = CONTROLLER_PROBE_S) -> None:
    """Fail at once when no controller slurm.conf names accepts a connection: sinfo would retry
    for minutes before saying so."""
    found = controllers(env)
    if found is None:
        return
    conf, addresses = found
    reasons = []
    for host, port in addresses:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            return
        except OSError as e:
            reasons.append(f"{host}:{port} ({e.strerror or type(e).__name__})")
    raise ClusterUnreachable(
        f"slurmctld does not answer at {', '.join(reasons)}, the controller {conf} names: "
        f"is it up, and is this the cluster's slurm.conf (SLURM_CONF)?"
    )


def query_sinfo(env: dict[str, str] | None = None, timeout: float = SINFO_TIMEOUT_S) -> list[NodeInfo]:
    """Every (partition, node) of the cluster; a missing, failing or silent sinfo is a ClusterError,
    and a controller that refuses connections one at once."""
    if shutil.which("sinfo", path=(os.environ if env is None else env).get("PATH")) is not None:
        probe_controllers(env)
    try:
        out = slurm("sinfo", "-h", "-N", "-o", "%P|%N|%c|%G|%m|%t|%l", env=env, timeout=timeout)
    except SlurmCommandError as e:
        raise ClusterUnreachable(
            {
                "missing": "sinfo was not found: run this on a SLURM login node, or use --dry-run to print the job "
                "without checking the cluster",
                "failed": f"sinfo failed ({(e.stderr.splitlines() or [str(e)])[-1]}): is SLURM reachable from here "
                "(SLURM_CONF, slurmctld)?",
                "timeout": f"sinfo did not answer in {timeout:g} s: is slurmctld up (SLURM_CONF)? Use --dry-run to "
                "print the job without checking the cluster",
            }[e.kind]
        ) from None
    nodes = []
    for line in out.splitlines():
        partition, name, cpus, gres, mem, state, limit = line.split("|")
        nodes.append(
            NodeInfo(
                partition.rstrip("*"),
                name,
                int(cpus),
                _gpus(gres),
                int(mem.rstrip("+")) if mem.rstrip("+").isdigit() else None,
                state,
                slurm_minutes(limit),
                partition.endswith("*"),
            )
        )
    return nodes


@dataclass(frozen=True)
class Partition:
    """What the generator needs to know about the partition a job goes to: its usable nodes."""

    name: str
    nodes: int
    cpus_per_node: int
    """The default CPU request: what the partition's largest GPU nodes (or its nodes) have."""
    gpus_per_node: int
    """The default GPU request: the most GPUs a node has (a mixed partition's GPU nodes)."""
    members: tuple[NodeInfo, ...] = ()
    max_time_min: int | None = None


def resolve_partition(settings: ClusterSettings, nodes: list[NodeInfo], default: str | None) -> Partition:
    """The partition a job goes to (the cluster's default when none is set) and its usable nodes;
    defaults are those of its nodes with the most GPUs."""
    name = settings.partition or default
    if name is None:
        raise ClusterError(
            f"this cluster has no default partition: set --partition or partition in "
            f"{default_cluster_file()} (partitions: {', '.join(sorted({n.partition for n in nodes}))})"
        )
    members = [n for n in nodes if n.partition == name]
    if not members:
        known = sorted({n.partition for n in nodes})
        raise ClusterError(
            f"unknown partition {name!r}: this cluster has {', '.join(known)}; set "
            f"--partition or partition in {default_cluster_file()}"
        )
    usable = [n for n in members if n.usable]
    pool = usable or members
    gpus = max(n.gpus for n in pool)
    cpus = min(n.cpus for n in pool if n.gpus == gpus)
    return Partition(name, len({n.name for n in members}), cpus, gpus, tuple(members), members[0].max_time_min)


def default_partition(nodes: list[NodeInfo]) -> str | None:
    """The cluster's default partition, from the one sinfo query (None: it has none)."""
    return next((n.partition for n in nodes if n.default), None)


def check_request(
    partition: Partition,
    *,
    nodes: int,
    gpus_per_node: int,
    cpus_per_node: int,
    mem: str | None = None,
    time: str | None = None,
    warn=None,
) -> None:
    """Refuse a request the partition can never satisfy (SLURM would queue it forever or reject
    it after the files were written): its MaxTime, nodes with enough GPUs, CPUs and memory, and
    enough of them. Nodes that are down or drained now count (they may come back: SLURM queues
    the job); if too few of the ones that hold the request are up, ``warn`` says so."""
    where = f"partition {partition.name!r}"
    wanted = slurm_minutes(time) if time else None
    if wanted is not None and partition.max_time_min is not None and wanted > partition.max_time_min:
        raise ClusterError(
            f"--time {time} is more than {where}'s MaxTime of {partition.max_time_min} minutes: "
            f"ask for less (the job requeues itself at its limit and resumes) or pick another "
            f"partition"
        )
    members = partition.members
    if not members:
        return
    if gpus_per_node > max(n.gpus for n in members):
        raise ClusterError(
            f"--gpus-per-node {gpus_per_node} is more than the {max(n.gpus for n in members)} "
            f"GPU(s) a node of {where} has"
        )
    fit = [n for n in members if n.gpus >= gpus_per_node]
    if cpus_per_node > max(n.cpus for n in fit):
        raise ClusterError(
            f"--cpus-per-node {cpus_per_node} is more than the {max(n.cpus for n in fit)} CPUs a node of {where} has"
        )
    fit = [n for n in fit if n.cpus >= cpus_per_node]
    mem_need = mem_mb(mem) if mem else None
    known_mem = [n.mem_mb for n in fit if n.mem_mb is not None]
    if mem_need and known_mem and mem_need > max(known_mem):
        raise ClusterError(f"--mem {mem} is more than the {max(known_mem)} MB a node of {where} has")
    fit = [n for n in fit if not mem_need or n.mem_mb is None or n.mem_mb >= mem_need]
    holding = len({n.name for n in fit})
    if nodes > holding:
        raise ClusterError(
            f"the job needs {nodes} node(s) but {where} has {holding} that hold the request: "
            f"use fewer replica groups or nodes per group"
        )
    up = len({n.name for n in fit if n.usable})
    if nodes > up and warn is not None:
        warn(
            f"{where} has {up} node(s) up that hold the request ({holding - up} down or drained); the job "
            f"waits in the queue until {nodes} are back"
        )
