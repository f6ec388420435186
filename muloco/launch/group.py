"""One replica group, defined once for every way of starting a run.

The local launcher (and through it the benches), the SLURM group entry, and the job generators
and sweeps (which check a run's trainer config with it) start or check a replica group through
this module (the ``ddp`` kind's one group is a plain torchrun line of the job script):

- its trainer config, parsed and checked once before anything starts (``load_trainer_config``:
  a bad override or a config of the wrong kind is one message, not one per replica);
- its trainer command (``trainer_command``: the config, the replica id, K, the overrides, the
  quorum size last so trainers and lighthouse agree);
- its torchrun (``torchrun_args`` + ``torchrun_group``: ``muloco.launch.replica_group`` reports
  failed attempts and keeps the failed rank's exit status, each rank runs through
  ``muloco.launch.rank_process`` so it dies with its agent);
- its environment (``group_variables``: the lighthouse, the replica id and K).

The GPU slice a group gets on one machine is :mod:`muloco.launch.gpu_slices`.
"""

from __future__ import annotations

import shlex
import sys

from muloco.utils.errors import BadInput

TRAINER = [sys.executable, "-m", "muloco.train"]


class TrainerConfigError(BadInput, ValueError):
    """The trainer config cannot run as asked (the message says why and what to do);
    ``status`` is 0 when tyro only printed the trainer's --help."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


LAUNCHER_KEYS = (
    "--fault_tolerance.replica_id",
    "--fault_tolerance.group_size",
    "--fault_tolerance.min_replica_size",
    "--fault_tolerance.lighthouse_lost_seconds",
)
"""Trainer options the launchers add for each replica group (not the user's own settings)."""


def replica_args(i: int, replicas: int) -> list[str]:
    """What the launcher tells replica group ``i`` about its place in the job."""
    return ["--fault_tolerance.replica_id", str(i), "--fault_tolerance.group_size", str(replicas)]


def trainer_command(
    config: str, i: int, replicas: int, overrides: list[str], quorum: int, entry: list[str] | None = None
) -> list[str]:
    """Replica group ``i``'s trainer: ``entry`` (default ``python -m muloco.train``) with the
    config, replica id, K, the overrides and the quorum size last."""
    return [
        *(entry or TRAINER),
        "--config",
        config,
        *replica_args(i, replicas),
        *overrides,
        "--fault_tolerance.min_replica_size",
        str(quorum),
    ]


def torchrun_args(
    replica: int | str,
    *,
    procs: int,
    max_restarts: int,
    hosts: list[str] | None = None,
    port: int = 0,
    rdzv_id: str | None = None,
    tee_dir: str | None = None,
    is_host: bool | None = None,
    address: str = "127.0.0.1",
) -> list[str]:
    """torchrun's options for a group of ``procs`` ranks per node: on one node a c10d rendezvous
    on a free port of ``address`` (loopback; a testbed host's own address); over ``hosts``
    (several nodes) on the first host's ``port``. ``tee_dir``: torchrun tees each rank's output,
    prefixed, and keeps per-attempt copies there."""
    nodes = len(hosts) if hosts else 1
    endpoint = f"{hosts[0]}:{port}" if nodes > 1 else f"{address}:0"
    args = [
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        str(procs),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        *(["--rdzv-id", rdzv_id] if rdzv_id else []),
        "--max-restarts",
        str(max_restarts),
        "--role",
        f"replica_{replica}",
    ]
    if nodes == 1:
        args += ["--local-addr", address]
        if address != "127.0.0.1":  # torchrun's guess (is the address this machine's name?) misses a namespace's
            args += ["--rdzv-conf", "is_host=1"]
    elif is_host is not None:  # say which node serves the rendezvous store: torchrun's own guess
        args += ["--rdzv-conf", f"is_host={int(is_host)}"]  # (is the address mine?) fails for a second NIC
    if tee_dir and procs > 1:
        args += ["--tee", "3", "--log-dir", tee_dir]
    return args


def torchrun_group(torchrun: list[str], rank_command: list[str]) -> list[str]:
    """A replica group as one torchrun whose ranks each run ``rank_command``."""
    return [
        sys.executable,
        "-m",
        "muloco.launch.replica_group",
        *torchrun,
        "--no-python",
        sys.executable,
        "-m",
        "muloco.launch.rank_process",
        *rank_command,
    ]


def group_variables(lighthouse_url: str, i: int, replicas: int) -> dict[str, str]:
    """What every rank of replica group ``i`` finds in its environment besides torchrun's own."""
    return {
        "TORCHFT_LIGHTHOUSE": lighthouse_url,
        "REPLICA_GROUP_ID": str(i),
        "NUM_REPLICA_GROUPS": str(replicas),
        "PYTHONUNBUFFERED": "1",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${local_rank}] ",
    }


def load_trainer_config(config: str, overrides: list[str], *, replicas: int | None, who: str, prog: str):
    """The trainer config a job would run (replica 0's for DiLoCo), parsed and checked here, once.

    ``replicas`` None: a job of one replica group (DDP), which refuses a config with an outer
    loop; else K DiLoCo groups, which need one, and whose id, K and lighthouse the launcher
    sets. ``who`` names the launcher in messages. Raises TrainerConfigError.
    """
    # torch-bound, so imported only here: a launcher's --help and usage errors answer without torch
    from muloco import compat

    compat.apply()  # torchtitan must be adapted before its import
    from muloco.config.checks import check_config
    from muloco.config.cli import parse_args
    from muloco.config.loader import ConfigError, load_config

    try:
        _check_kind(hasattr(load_config(config), "outer"), config, overrides, replicas, who)
        args = [*(replica_args(0, replicas) if replicas else []), *overrides]
        _, parsed = parse_args(["--config", config, *args], prog=f"{prog} --config {config} --")
        if replicas:
            _check_launcher_owned(parsed, replicas)
        check_config(parsed)
    except ConfigError as e:
        raise TrainerConfigError(str(e)) from None
    except SystemExit as e:  # tyro printed --help, or a value it could not parse (its message)
        if not e.code:
            raise TrainerConfigError("", 0) from None
        raise TrainerConfigError("a trainer override was rejected (message above); nothing was started") from None
    return parsed


def _check_kind(has_outer: bool, config: str, overrides: list[str], replicas: int | None, who: str) -> None:
    if replicas is None and has_outer:
        raise TrainerConfigError(
            f"{who} runs one replica group; --config {config} has an outer loop (DiLoCo): "
            f"launch it as replica groups (the groups, spanning or array kind, or "
            f"python -m muloco.launch.local), or use a ddp/* config"
        )
    if replicas is not None and not has_outer:
        direct = shlex.join(["python", "-m", "muloco.train", "--config", config, *overrides])
        raise TrainerConfigError(
            f"{who} runs DiLoCo replica groups; --config {config} has no outer loop: use a "
            f"diloco/* config (e.g. diloco/diloco, diloco/muloco_2bit), or run it as one "
            f"group: {direct}"
        )


def _check_launcher_owned(config, replicas: int) -> None:
    """Overrides of what the launcher sets per replica would give every replica the same id,
    a K that is not the job's, or another lighthouse than the one it started."""
    ft = config.fault_tolerance
    if ft.group_size != replicas:
        raise TrainerConfigError(
            f"--fault_tolerance.group_size {ft.group_size} disagrees with --replicas "
            f"{replicas}: drop it, the launcher sets it"
        )
    if ft.replica_id != 0:
        raise TrainerConfigError("drop --fault_tolerance.replica_id: the launcher gives each replica group its own")
    if getattr(ft, "lighthouse", ""):
        raise TrainerConfigError(
            f"drop --fault_tolerance.lighthouse {ft.lighthouse}: the launcher starts its "
            f"own lighthouse and points the replicas at it"
        )
