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
``--account``). ``check_against(sinfo)`` refuses, before anything is written or submitted, a
partition the cluster does not have, more GPUs or CPUs per node than its nodes have, and more
nodes than the partition holds.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import tomli

CLUSTER_FILE_VAR = "MULOCO_CLUSTER_FILE"
ENV_PREFIX = "MULOCO_SLURM_"
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
_MEM = re.compile(r"^\d+[KMGT]?B?$", re.IGNORECASE)
_SECRET = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD)", re.IGNORECASE)


class ClusterError(ValueError):
    """Bad cluster settings; the message names the setting, where it came from, and the fix."""


class ClusterUnreachable(ClusterError):
    """sinfo is missing or fails: the settings cannot be checked from this machine."""


def default_cluster_file() -> Path:
    return Path(os.environ.get(CLUSTER_FILE_VAR) or Path.home() / ".config" / "muloco" / "cluster.toml")


@dataclass
class ClusterSettings:
    """What an sbatch header needs from the cluster. None: let SLURM (or sinfo) decide."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "04:00:00"
    """Wall-clock limit, SLURM's format (``MM``, ``HH:MM:SS``, ``D-HH:MM:SS``)."""
    gpus_per_node: int | None = None
    """None: what the partition's nodes have (sinfo); 0 runs on CPUs."""
    cpus_per_node: int | None = None
    """None: what the partition's nodes have (sinfo)."""
    mem: str | None = None
    constraint: str | None = None
    exclusive: bool = False
    exclude: str | None = None
    reservation: str | None = None
    gres: str | None = None
    mail_type: str | None = None
    mail_user: str | None = None
    setup: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        if not _TIME.match(self.time):
            raise ClusterError(f"time {self.time!r} is not a SLURM time: use MM, HH:MM:SS or D-HH:MM:SS")
        if self.mem is not None and not _MEM.match(self.mem.strip()):
            raise ClusterError(f"mem {self.mem!r} is not SLURM's format (a number with an optional K, M, G or "
                               f"T: 64G)")
        for key in ("gpus_per_node", "cpus_per_node"):
            value = getattr(self, key)
            if value is not None and value < (0 if key == "gpus_per_node" else 1):
                raise ClusterError(f"{key} must be {'>= 0' if key == 'gpus_per_node' else '>= 1'}, got {value}")
        secrets = sorted(k for k in self.env if _SECRET.search(k))
        if secrets:
            raise ClusterError(f"cluster env sets {', '.join(secrets)}: secrets are never written into job "
                               f"files; export them in your shell before submitting (sbatch passes the "
                               f"environment on) and drop them from the [env] table")


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

    def settings(self) -> ClusterSettings:
        """Defaults, the user's file and MULOCO_SLURM_*, then these options."""
        flags = dataclasses.asdict(self)
        flags["exclusive"] = flags["exclusive"] or None  # the flag only turns it on
        return load_cluster_settings(flags)


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


def load_cluster_settings(flags: dict | None = None, path: Path | None = None,
                          environ: dict[str, str] | None = None) -> ClusterSettings:
    """Defaults, then the user's file, then ``MULOCO_SLURM_*``, then ``flags`` (None: unset)."""
    settings = ClusterSettings()
    path = path or default_cluster_file()
    if path.is_file():
        try:
            _merge(settings, tomli.loads(path.read_text()), str(path))
        except tomli.TOMLDecodeError as e:
            raise ClusterError(f"{path}: not valid TOML ({e}); fix or remove it") from None
    environ = os.environ if environ is None else environ
    from_env = {k[len(ENV_PREFIX):].lower(): v for k, v in environ.items()
                if k.startswith(ENV_PREFIX) and k != CLUSTER_FILE_VAR}
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


def _gpus(gres: str) -> int:
    """GPUs in a gres string such as ``gpu:h100:8(S:0-1),shard:2`` (0 for ``(null)``)."""
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def query_sinfo(env: dict[str, str] | None = None) -> list[NodeInfo]:
    """Every (partition, node) of the cluster; a missing or failing sinfo is a ClusterError."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%P|%N|%c|%G"], capture_output=True, text=True,
                             timeout=60, env=env, check=True).stdout
    except FileNotFoundError:
        raise ClusterUnreachable("sinfo was not found: run this on a SLURM login node, or use --dry-run "
                           "to print the job without checking the cluster") from None
    except subprocess.CalledProcessError as e:
        raise ClusterUnreachable(f"sinfo failed ({(e.stderr.strip().splitlines() or [str(e)])[-1]}): is "
                                 f"SLURM reachable from here (SLURM_CONF, slurmctld)?") from None
    nodes = []
    for line in out.splitlines():
        partition, name, cpus, gres = line.split("|")
        nodes.append(NodeInfo(partition.rstrip("*"), name, int(cpus), _gpus(gres)))
    return nodes


@dataclass(frozen=True)
class Partition:
    """What the generator needs to know about the partition a job goes to."""

    name: str
    nodes: int
    cpus_per_node: int
    gpus_per_node: int


def resolve_partition(settings: ClusterSettings, nodes: list[NodeInfo], default: str | None) -> Partition:
    """The partition a job goes to (the cluster's default when none is set), its smallest node."""
    name = settings.partition or default
    members = [n for n in nodes if n.partition == name]
    if not members:
        known = sorted({n.partition for n in nodes})
        raise ClusterError(f"unknown partition {name!r}: this cluster has {', '.join(known)}; set "
                           f"--partition or partition in {default_cluster_file()}")
    return Partition(name, len({n.name for n in members}), min(n.cpus for n in members),
                     min(n.gpus for n in members))


def default_partition(env: dict[str, str] | None = None) -> str | None:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60,
                             env=env).stdout
    except FileNotFoundError:
        return None
    return next((p.rstrip("*") for p in out.split() if p.endswith("*")), None)


def check_request(partition: Partition, *, nodes: int, gpus_per_node: int, cpus_per_node: int) -> None:
    """Refuse a request the partition can never satisfy (SLURM would queue it forever or reject
    it after the files were written)."""
    if nodes > partition.nodes:
        raise ClusterError(f"the job needs {nodes} node(s) but partition {partition.name!r} has "
                           f"{partition.nodes}: use fewer replica groups or nodes per group")
    if gpus_per_node > partition.gpus_per_node:
        raise ClusterError(f"--gpus-per-node {gpus_per_node} is more than the {partition.gpus_per_node} "
                           f"GPU(s) a node of partition {partition.name!r} has")
    if cpus_per_node > partition.cpus_per_node:
        raise ClusterError(f"--cpus-per-node {cpus_per_node} is more than the {partition.cpus_per_node} "
                           f"CPUs a node of partition {partition.name!r} has")
