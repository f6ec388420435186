"""Generate and submit SLURM jobs: ``python -m muloco.launch.slurm KIND --config C [options] -- OVERRIDES``.

Kinds (one class each, all for autoregressive and diffusion configs alike):

- ``ddp``: one replica group over ``--nodes`` nodes, torchrun on each (c10d rendezvous on the
  first node), FSDP/DDP over every GPU;
- ``groups``: K DiLoCo replica groups on one node, each on its own GPU slice, with the
  lighthouse on loopback (the local launcher, ``muloco.launch.local``, under ``srun``);
- ``spanning``: K groups of ``--nodes-per-replica`` nodes each, one job; the lighthouse runs on
  the first node, bound to its address;
- ``array``: fault-tolerant DiLoCo, each replica group one task of a job array and the
  lighthouse a small job of its own. A dead node requeues only its group's task; the group
  heals from a peer while the others keep training.

Every flag is honoured or refused; cluster defaults come from ``~/.config/muloco/cluster.toml``
or ``MULOCO_SLURM_*`` (``muloco.launch.slurm.cluster``) and are checked against ``sinfo`` before any
file is written. ``--dry-run`` prints the script(s) and submits nothing; otherwise they are
written to ``<dump folder>/slurm/`` and submitted with ``sbatch``. The scripts hold relative
paths and no secrets: they ``cd`` to the directory sbatch was called from, and W&B keys and
the like reach the job through the environment sbatch passes on.

Requeue (``--requeue``, on by default): SLURM requeues the job when its node fails, and the
script requeues itself on ``USR1``, which SLURM sends ``--signal-s`` seconds before the time
limit (``scancel --signal=USR1 --batch JOB`` does the same by hand); ``--retries N`` requeues
a failed run up to N times. A requeued job resumes from its newest complete checkpoint.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field, make_dataclass, replace
from typing import Annotated

import tyro

from muloco.components.stop_request import EXIT_PREEMPTED
from muloco.launch.group import TrainerConfigError, load_trainer_config
from muloco.launch.slurm.cluster import (
    SINFO_TIMEOUT_S,
    ClusterError,
    ClusterOptions,
    ClusterSettings,
    ClusterUnreachable,
    NodeInfo,
    Partition,
    check_request,
    default_cluster_file,
    default_partition,
    mem_mb,
    query_sinfo,
    resolve_partition,
)
from muloco.launch.slurm.commands import SlurmCommandError, cancel, slurm
from muloco.launch.slurm.templates import render
from muloco.utils.command_line import UsageError, failed, parse
from muloco.utils.created_dirs import make_dirs, remove_dirs
from muloco.utils.errors import BAD_INPUT, BadInput

SLURM_DIR = "slurm"
LOG_DIR = "logs"
SETUP_FAILED = 3
"""A job's exit status when a line of the cluster setup failed (not requeued: the setup needs fixing)."""
DRY_RUN_SINFO_TIMEOUT_S = 10.0
"""A dry run checks against the cluster when it answers quickly, and prints the job anyway."""
ENV_BLOCK = {
    "PYTHONUNBUFFERED": "1",
    "RUST_LOG": "warn",  # torchft's Rust side logs every quorum at INFO
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",  # fewer fragmentation OOMs
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a hung collective fails the rank (torchft then heals it)
    "NCCL_DEBUG": "WARN",
}
"""The environment every generated job exports; a cluster file's ``[env]`` adds to or replaces it."""


class JobError(BadInput, ValueError):
    """A job that cannot be generated as asked; the message names the problem and the fix."""


@dataclass
class JobSpec:
    """What every kind shares: the trainer command, the cluster request, the requeue policy."""

    config: str
    overrides: list[str] = field(default_factory=list)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    job_name: str | None = None
    requeue: bool = True
    retries: int = 0
    signal_s: int = 120
    max_restarts: int = 0
    procs: int = 1
    """Ranks per node (per group on ``groups``) when the job has no GPUs."""
    dependency: str | None = None

    @property
    def name(self) -> str:
        return self.job_name or os.path.splitext(self.config.replace("/", "-"))[0]


@dataclass
class Script:
    """One sbatch file of a job, and what to export at submission (``@file`` = that file's job id)."""

    file: str
    text: str
    exports: dict[str, str] = field(default_factory=dict)
    after: str | None = None
    """``@file``: submit held, then release with ``--dependency=after:<that file's job>`` added to
    the user's own ``dependency`` (both must hold)."""
    dependency: str | None = None
    """The user's ``--dependency`` (already in the header), kept when ``after`` is added."""


@dataclass
class Resources:
    """One job's (or array task's) request."""

    nodes: int
    gpus_per_node: int
    cpus_per_node: int | None
    """None: unknown (a dry run without the cluster): no ``--cpus-per-task`` line, SLURM's default."""
    ntasks_per_node: int = 1


def _q(value) -> str:
    return shlex.quote(str(value))


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def sbatch_value(key: str, value) -> str:
    """``value`` as one ``#SBATCH`` argument: double-quoted with ``\\`` and ``"`` escaped (sbatch
    reads it back exactly; unquoted, a space ends the value and ``#`` starts a comment). A
    control character could end the comment line and start a shell command: refused."""
    text = str(value)
    if _CONTROL.search(text):
        raise JobError(
            f"--{key} {text!r} contains a control character (a newline, tab, ...): SLURM "
            f"job files cannot carry it; choose a value without one"
        )
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def scale_mem(mem: str, share: int, of: int) -> str:
    """SLURM's ``--mem`` (per node; MB without a unit) times ``share/of``, in whole MB."""
    return f"{max(1, mem_mb(mem) * share // of)}M"


def _gres_has_gpus(gres: str | None) -> bool:
    return bool(gres) and any(item.split(":")[0] == "gpu" for item in gres.split(","))


def log_path(run_dir: str, pattern: str) -> str:
    """A log file under ``run_dir`` for ``#SBATCH --output``: ``%`` of the folder escaped (SLURM
    expands ``%j``, ``%x``, ...), a backslash refused (it turns every pattern off)."""
    if "\\" in run_dir:
        raise JobError(
            f"the run folder {run_dir!r} contains a backslash, which makes SLURM ignore the %j "
            f"patterns of its log files; choose a folder without one"
        )
    return os.path.join(run_dir.replace("%", "%%"), pattern)


def sbatch_header(
    spec: JobSpec, res: Resources, *, name: str, output: str, array: str | None = None, requeue: bool | None = None
) -> list[str]:
    c = spec.cluster
    lines = [
        f"#SBATCH --job-name={sbatch_value('job-name', name)}",
        f"#SBATCH --nodes={res.nodes}",
        f"#SBATCH --ntasks-per-node={res.ntasks_per_node}",
    ]
    if res.cpus_per_node is not None:
        lines.append(f"#SBATCH --cpus-per-task={max(1, res.cpus_per_node // res.ntasks_per_node)}")
    if res.gpus_per_node and not _gres_has_gpus(c.gres):  # a gpu gres asks for them already
        lines.append(f"#SBATCH --gpus-per-node={res.gpus_per_node}")
    for key, value in (
        ("partition", c.partition),
        ("account", c.account),
        ("qos", c.qos),
        ("reservation", c.reservation),
        ("mem", c.mem),
        ("constraint", c.constraint),
        ("gres", c.gres),
        ("exclude", c.exclude),
        ("mail-type", c.mail_type),
        ("mail-user", c.mail_user),
    ):
        if value:
            lines.append(f"#SBATCH --{key}={sbatch_value(key, value)}")
    if c.exclusive:
        lines.append("#SBATCH --exclusive")
    lines += [
        f"#SBATCH --time={sbatch_value('time', c.time)}",
        f"#SBATCH --output={sbatch_value('output', output)}",
        "#SBATCH --open-mode=append",
    ]
    if array:
        lines.append(f"#SBATCH --array={array}")
    if spec.requeue if requeue is None else requeue:
        lines += ["#SBATCH --requeue", f"#SBATCH --signal=B:USR1@{spec.signal_s}"]
    else:
        lines.append("#SBATCH --no-requeue")
    if spec.dependency:  # a dependency that can never be met cancels the job instead of leaving it queued
        lines += [
            f"#SBATCH --dependency={sbatch_value('dependency', spec.dependency)}",
            "#SBATCH --kill-on-invalid-dep=yes",
        ]
    return lines


def preamble(spec: JobSpec) -> list[str]:
    """Working directory, interpreter, the one environment block, the user's setup lines."""
    ifname = spec.cluster.socket_ifname
    sockets = {"NCCL_SOCKET_IFNAME": ifname} if ifname else {}
    if ifname and ifname[0] not in "^=":  # gloo takes plain names only (no ^ exclusion, no = prefix)
        sockets["GLOO_SOCKET_IFNAME"] = ifname
    env = {**ENV_BLOCK, **sockets, **spec.cluster.env}
    lines = render("preamble", exports="\n".join(f"export {k}={_q(v)}" for k, v in env.items()))
    if spec.cluster.setup:
        lines += render(
            "setup", cluster_file=default_cluster_file(), setup_failed=SETUP_FAILED, setup="\n".join(spec.cluster.setup)
        )
    return lines


def requeue_block(spec: JobSpec, *, trains: bool = True) -> list[str]:
    """Self-requeue on USR1 (time limit, ``scancel --signal=USR1 --batch``) and on failure up to
    ``retries`` times (counted in a file in the run folder, so time-limit requeues do not use
    them up). A job that ``trains`` first asks its run to write a checkpoint where it stands and
    stop (``MULOCO_STOP_FILE``, :mod:`muloco.components.preemption`), waits for it, then requeues; the
    lighthouse's job requeues at once."""
    if not spec.requeue:
        return [*render("wait_all"), *render("no_requeue")]
    on_usr1 = (
        render("stop_then_requeue", slurm_dir=SLURM_DIR, watchdog_s=max(10, spec.signal_s - 30))
        if trains
        else render("requeue_on_usr1")
    )
    return [
        *render("wait_all"),
        *render("requeue_self"),
        *on_usr1,
        *render("finish_run", retries=spec.retries, slurm_dir=SLURM_DIR, exit_preempted=EXIT_PREEMPTED),
    ]


def overrides_block(spec: JobSpec, run_dir: str) -> list[str]:
    return [
        f"CONFIG={_q(spec.config)}",
        "OVERRIDES=(" + " ".join(_q(o) for o in spec.overrides) + ")",
        f"RUN_DIR={_q(run_dir)}  # the trainer's dump folder",
    ]


def wait_block(pids: str = '"$!"') -> list[str]:
    """Wait in the background-and-wait form, so the USR1 trap runs while the run is going (and
    the run, asked to stop, still finishes its checkpoint)."""
    return [f"wait_all {pids}", "finish_run $?"]


def job_script(
    spec: JobSpec,
    res: Resources,
    comment: str,
    *,
    name: str,
    output: str,
    setup: list[str],
    launch: list[str],
    array: str | None = None,
    trains: bool = True,
    header_spec: JobSpec | None = None,
) -> str:
    """One sbatch file, as every kind writes it: the header (``header_spec``'s request, default
    ``spec``'s), the preamble, ``setup`` (what the job runs and where), the requeue handling,
    then ``launch`` (its srun lines)."""
    header = sbatch_header(header_spec or spec, res, name=name, output=output, array=array)
    body = [*preamble(spec), "", *setup, *requeue_block(spec, trains=trains), "", *launch]
    return "\n".join(
        [
            "#!/bin/bash",
            f"# {comment}",
            "# Generated by python -m muloco.launch.slurm; edit the command, not this file.",
            *header,
            "",
            *body,
            "",
        ]
    )


class Kind:
    """One layout of replica groups over nodes. Subclasses hold their own ``Config``."""

    def __init__(self, cfg, spec: JobSpec, trainer_config, partition: Partition | None):
        """``cfg``: the subclass's own ``Config`` (its layout: K, nodes, ...)."""
        self.cfg, self.spec, self.trainer, self.partition = cfg, spec, trainer_config, partition

    @property
    def run_dir(self) -> str:
        return self.trainer.dump_folder

    @property
    def gpus_per_node(self) -> int:
        g = self.spec.cluster.gpus_per_node
        if g is None:
            g = self.partition.gpus_per_node if self.partition else 0
        return g

    @property
    def cpus_per_node(self) -> int | None:
        """None: not given and no partition seen (a dry run told only the GPUs): SLURM's default."""
        c = self.spec.cluster.cpus_per_node
        if c is None and self.partition:
            c = self.partition.cpus_per_node
        return c

    def resources(self) -> Resources:
        raise NotImplementedError

    def launch_lines(self) -> list[str]:
        """The job's own commands (after the preamble); kinds with one script per job."""
        raise NotImplementedError

    def description(self) -> str:
        raise NotImplementedError

    def scripts(self) -> list[Script]:
        return [
            Script(
                "job.sh",
                job_script(
                    self.spec,
                    self.resources(),
                    self.description(),
                    name=self.spec.name,
                    output=self._log(f"{SLURM_DIR}/%x-%j.out"),
                    setup=overrides_block(self.spec, self.run_dir),
                    launch=self.launch_lines(),
                ),
            )
        ]

    def check(self) -> None:
        """Refuse layouts the node cannot hold; then what the partition cannot satisfy."""
        if self.spec.procs != 1 and self.gpus_per_node:
            raise JobError(
                f"--procs {self.spec.procs} is for jobs without GPUs; with GPUs each rank gets "
                f"one GPU (set --gpus-per-node, or --gpus-per-node 0 to run on CPUs)"
            )
        if self.partition is not None:
            res = self.resources()
            check_request(
                self.partition,
                nodes=res.nodes,
                gpus_per_node=res.gpus_per_node,
                cpus_per_node=res.cpus_per_node,
                mem=self.spec.cluster.mem,
                time=self.spec.cluster.time,
                warn=lambda text: print(f"{PROG}: warning: {text}", file=sys.stderr),
            )

    def place(self, nodes: list[NodeInfo], default: str | None) -> None:
        """Send the job to its partition (the cluster's default when none is set), then check it."""
        self.partition = resolve_partition(self.spec.cluster, nodes, default)
        self.spec.cluster.partition = self.partition.name
        self.check()

    def _log(self, name: str) -> str:
        return log_path(self.run_dir, name)


class DdpJob(Kind):
    """One replica group over --nodes nodes (torchrun on each, rendezvous on the first)."""

    @dataclass
    class Config:
        nodes: int = 1
        """Nodes of the one replica group (torchrun on each, rendezvous on the first)."""

    def resources(self) -> Resources:
        return Resources(self.cfg.nodes, self.gpus_per_node, self.cpus_per_node)

    def launch_lines(self) -> list[str]:
        procs = self.gpus_per_node or self.spec.procs
        if self.cfg.nodes == 1:  # one node: a free loopback port, nothing to collide with
            endpoint = ["RDZV=127.0.0.1:0"]
        else:  # below the ephemeral range (32768+), different for jobs sharing a first node
            endpoint = [
                'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                'RDZV="$HEAD:$((29500 + SLURM_JOB_ID % 3000))"',
            ]
        return [
            *endpoint,
            f'srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run --nnodes "$SLURM_JOB_NUM_NODES" '
            f'--nproc-per-node {procs} --rdzv-backend c10d --rdzv-endpoint "$RDZV" '
            f'--rdzv-id "$SLURM_JOB_ID" --max-restarts {self.spec.max_restarts} '
            f'-m muloco.train --config "$CONFIG" "${{OVERRIDES[@]}}" &',
            *wait_block(),
        ]

    def description(self) -> str:
        return f"DDP: one replica group over {self.cfg.nodes} node(s)"


class _DilocoKind(Kind):
    """What the DiLoCo layouts share: K, the quorum the trainer config asks for."""

    @property
    def replicas(self) -> int:
        return self.cfg.replicas

    @property
    def quorum(self) -> int:
        return self.trainer.fault_tolerance.quorum_size(self.replicas)

    @property
    def join_timeout_ms(self) -> int:
        return self.trainer.fault_tolerance.join_timeout_ms()

    def lighthouse_cmd(self, url_file: str, until_job: str | None) -> str:
        until = f" --until_job {until_job}" if until_job else ""
        return (
            f'"$PYTHON" -m muloco.launch.lighthouse --replicas {self.replicas} '
            f"--min_replicas {self.quorum} --join_timeout_ms {self.join_timeout_ms} "
            f"--bind node:0 --url_file {url_file}{until}"
        )

    def group_cmd(self, replica: str, url_file: str, lighthouse_moves: bool = True) -> str:
        """A group's ``slurm.group`` command; a lighthouse that cannot move (a step of the same
        job) gets no relay and no long wait (``--lighthouse-lost-s 0``)."""
        stays = "" if lighthouse_moves else "--lighthouse-lost-s 0 "
        return (
            f'"$PYTHON" -m muloco.launch.slurm.group --config "$CONFIG" --replica {replica} '
            f"--replicas {self.replicas} --min-replicas {self.quorum} --lighthouse-file {url_file} {stays}"
            f'--procs {self.spec.procs} --max-restarts {self.spec.max_restarts} -- "${{OVERRIDES[@]}}"'
        )


class GroupsJob(_DilocoKind):
    """K DiLoCo replica groups on one node, one GPU slice each, the lighthouse on loopback."""

    @dataclass
    class Config:
        replicas: int = 2
        """Replica groups K."""

    def resources(self) -> Resources:
        return Resources(1, self.gpus_per_node, self.cpus_per_node)

    def check(self) -> None:
        g = self.gpus_per_node
        if g and g % self.replicas:
            raise JobError(
                f"K={self.replicas} replica groups do not divide the {g} GPUs of the node: "
                f"use --replicas with a divisor of {g}, or --gpus-per-node {g - g % self.replicas}"
            )
        super().check()

    def launch_lines(self) -> list[str]:
        local = (
            f'"$PYTHON" -m muloco.launch.local --config "$CONFIG" --replicas {self.replicas} '
            f"--max-restarts {self.spec.max_restarts}"
        )
        local += (
            f" --gpus-per-replica {self.gpus_per_node // self.replicas}"
            if self.gpus_per_node
            else f" --procs-per-replica {self.spec.procs}"
        )
        return [
            "# K replica groups + their lighthouse (loopback) on this node; per-replica logs in $RUN_DIR/logs/",
            f'srun --ntasks=1 {local} -- "${{OVERRIDES[@]}}" &',
            *wait_block(),
        ]

    def description(self) -> str:
        return f"DiLoCo: {self.replicas} replica groups on one node"


class SpanningJob(_DilocoKind):
    """K replica groups of --nodes-per-replica nodes, one job; the lighthouse on the first node."""

    @dataclass
    class Config:
        replicas: int = 2
        """Replica groups K."""
        nodes_per_replica: int = 1
        """Nodes of each replica group."""

    def resources(self) -> Resources:
        return Resources(self.replicas * self.cfg.nodes_per_replica, self.gpus_per_node, self.cpus_per_node)

    def launch_lines(self) -> list[str]:
        npr = self.cfg.nodes_per_replica
        # a requeued job starts a new lighthouse: a new file, never the last run's stale URL
        url = f'"$RUN_DIR/{SLURM_DIR}/lighthouse-$SLURM_JOB_ID-${{SLURM_RESTART_COUNT:-0}}.url"'
        return [
            'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
            "# the lighthouse: one CPU on the first node, no GPU (--gres=none leaves them to group 0)",
            f'srun --nodes=1 --ntasks=1 --overlap --cpus-per-task=1 --gres=none --nodelist="${{NODES[0]}}" '
            f'{self.lighthouse_cmd(url, None)} >> "$RUN_DIR/{LOG_DIR}/lighthouse.log" 2>&1 &',
            "LIGHTHOUSE=$!",
            "GROUP_PIDS=()",
            f"for r in $(seq 0 {self.replicas - 1}); do",
            f'  group_nodes=$(IFS=,; echo "${{NODES[*]:$((r * {npr})):{npr}}}")',
            f'  srun --nodes={npr} --ntasks={npr} --ntasks-per-node=1 --nodelist="$group_nodes" '
            f'{self.group_cmd("$r", url, lighthouse_moves=False)} >> "$RUN_DIR/{LOG_DIR}/replica_$r.log" 2>&1 &',
            "  GROUP_PIDS+=($!)",
            "done",
            'wait_all "${GROUP_PIDS[@]}"; rc=$?',
            'kill "$LIGHTHOUSE" 2>/dev/null',
            "finish_run $rc",
        ]

    def description(self) -> str:
        return (
            f"DiLoCo: {self.replicas} replica groups of {self.cfg.nodes_per_replica} node(s) each, "
            f"lighthouse on the first node"
        )


class ArrayJob(_DilocoKind):
    """Fault tolerant: each replica group its own array task, the lighthouse its own job."""

    @dataclass
    class Config:
        replicas: int = 2
        """Replica groups K."""
        nodes_per_replica: int = 1
        """Nodes of each replica group."""
        gpus_per_replica: int | None = None
        """GPUs per node of a group (default: every GPU of a node)."""

    def resources(self) -> Resources:
        """A group's GPUs per node, and its share of a node's CPUs (so tasks pack onto nodes)."""
        g = self.cfg.gpus_per_replica if self.cfg.gpus_per_replica is not None else self.gpus_per_node
        share, node = self._task_share()
        cpus = self.cpus_per_node
        return Resources(self.cfg.nodes_per_replica, g, None if cpus is None else max(1, cpus * share // node))

    def check(self) -> None:
        g = self.cfg.gpus_per_replica
        if g is not None and self.gpus_per_node and (g < 1 or g > self.gpus_per_node):
            raise JobError(f"--gpus-per-replica {g} must be between 1 and the node's {self.gpus_per_node} GPUs")
        if self.spec.dependency and "?" in self.spec.dependency:
            raise JobError(
                f"--dependency {self.spec.dependency!r} joins with '?' (any of), but the groups "
                f"must also wait for their lighthouse (all of): join yours with ','"
            )
        super().check()

    def _task_share(self) -> tuple[int, int]:
        """(GPUs of one task, GPUs of a node): the part of a node one array task takes."""
        g = self.cfg.gpus_per_replica if self.cfg.gpus_per_replica is not None else self.gpus_per_node
        return (g, self.gpus_per_node) if g and self.gpus_per_node and g < self.gpus_per_node else (1, 1)

    def _task_spec(self) -> JobSpec:
        """The spec of one array task: ``--mem`` (per node) scaled to the task's share of a node,
        as its CPUs are, so tasks that pack onto one node do not ask for the node's memory each."""
        share, node = self._task_share()
        if not self.spec.cluster.mem or share == node or mem_mb(self.spec.cluster.mem) == 0:  # 0: all of it
            return self.spec
        return replace(self.spec, cluster=replace(self.spec.cluster, mem=scale_mem(self.spec.cluster.mem, share, node)))

    def scripts(self) -> list[Script]:
        """The groups array is submitted held, then the lighthouse job; the array is released
        with ``--dependency=after:<lighthouse>``, so no group waits for a lighthouse that is
        still queued."""
        url = f'"$RUN_DIR/{SLURM_DIR}/lighthouse-$SLURM_ARRAY_JOB_ID.url"'
        npr = self.cfg.nodes_per_replica
        launch = [
            "# this task is replica group $SLURM_ARRAY_TASK_ID; a requeued task heals from a peer",
            f"srun --nodes={npr} --ntasks-per-node=1 {self.group_cmd('$SLURM_ARRAY_TASK_ID', url)} &",
            *wait_block(),
        ]
        groups = job_script(
            self.spec,
            self.resources(),
            f"Fault-tolerant DiLoCo: {self.replicas} replica groups, one array task each",
            name=self.spec.name,
            output=self._log(f"{LOG_DIR}/replica_%a.log"),
            setup=overrides_block(self.spec, self.run_dir),
            launch=launch,
            array=f"0-{self.replicas - 1}",
            header_spec=self._task_spec(),
        )
        return [
            Script("groups.sh", groups, after="@lighthouse.sh", dependency=self.spec.dependency),
            self._lighthouse_script(),
        ]

    def place(self, nodes: list[NodeInfo], default: str | None) -> None:
        """The groups' partition, then the lighthouse's own (if set), which must exist and hold
        one CPU for the lighthouse's time limit."""
        super().place(nodes, default)
        c = self.spec.cluster
        if c.lighthouse_partition:
            lh = resolve_partition(replace(c, partition=c.lighthouse_partition), nodes, default)
            check_request(lh, nodes=1, gpus_per_node=0, cpus_per_node=1, time=c.lighthouse_time or c.time)

    def _lighthouse_script(self) -> Script:
        """One CPU, no GPU or memory request, in its own partition and QOS if set (else the
        groups'); requeues itself before its time limit like the groups, and the groups follow
        it to its new address (``muloco.launch.lighthouse_relay``)."""
        c = self.spec.cluster
        lh_cluster = replace(
            c,
            mem=None,
            constraint=None,
            gres=None,
            exclusive=False,
            mail_type=None,
            mail_user=None,
            partition=c.lighthouse_partition or c.partition,
            qos=c.lighthouse_qos or c.qos,
            time=c.lighthouse_time or c.time,
        )
        lh_spec = JobSpec(
            self.spec.config,
            cluster=lh_cluster,
            requeue=True,
            signal_s=self.spec.signal_s,
            dependency=self.spec.dependency,
        )  # it waits for what the groups wait for
        lh_url = f'"$RUN_DIR/{SLURM_DIR}/lighthouse-$MULOCO_GROUPS_JOB.url"'
        setup = [
            f"RUN_DIR={_q(self.run_dir)}",
            ': "${MULOCO_GROUPS_JOB:?the job id of the replica groups array (set at submission)}"',
        ]
        text = job_script(
            lh_spec,
            Resources(1, 0, 1),
            "The lighthouse of groups.sh (its own job)",
            name=f"{self.spec.name}-lighthouse",
            output=self._log(f"{LOG_DIR}/lighthouse-%j.log"),
            setup=setup,
            launch=[self.lighthouse_cmd(lh_url, '"$MULOCO_GROUPS_JOB"') + " &", *wait_block()],
            trains=False,
        )
        return Script("lighthouse.sh", text, exports={"MULOCO_GROUPS_JOB": "@groups.sh"})


def array_script(jobs: list[Kind], labels: list[str], name: str, log_folder: str, parallel: int) -> Script:
    """One job array over runs of one shape (kind, layout, resources): each task picks its run's
    config, overrides and folder; at most ``parallel`` tasks run at once."""
    first = jobs[0]
    cases = ['case "$SLURM_ARRAY_TASK_ID" in']
    for i, (job, label) in enumerate(zip(jobs, labels)):
        cases.append(f"  {i})  # {label}")
        cases += [f"    {line.split('  #')[0]}" for line in overrides_block(job.spec, job.run_dir)]
        cases.append("    ;;")
    cases += ['  *) echo "no run for array task $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac"]
    n = len(jobs)
    return Script(
        "sweep_array.sh",
        job_script(
            first.spec,
            first.resources(),
            f"Sweep {name}: {n} runs, one array task each",
            name=name,
            output=log_path(log_folder, "%x-%A_%a.out"),
            array=f"0-{n - 1}%{min(parallel, n)}",
            setup=[*cases, f'mkdir -p "$RUN_DIR/{SLURM_DIR}" "$RUN_DIR/{LOG_DIR}"'],
            launch=first.launch_lines(),
        ),
    )


KINDS: dict[str, type[Kind]] = {"ddp": DdpJob, "groups": GroupsJob, "spanning": SpanningJob, "array": ArrayJob}
KIND_NAMES = {kind: name for name, kind in KINDS.items()}


# -- checking the trainer config -------------------------------------------------------------


def trainer_config(kind: type[Kind], spec: JobSpec, replicas: int | None):
    """The trainer config the job would run, parsed and checked here (a bad override is one
    message now, not K failed jobs later)."""
    try:
        return load_trainer_config(
            spec.config,
            spec.overrides,
            replicas=None if kind is DdpJob else replicas,
            who=f"the {KIND_NAMES[kind]} kind",
            prog=f"{PROG} {KIND_NAMES[kind]}",
        )
    except TrainerConfigError as e:
        if e.status == 0:
            raise SystemExit(0) from None  # the trainer's --help was printed
        raise JobError(str(e)) from None


# -- writing and submitting ------------------------------------------------------------------


def _sbatch(args: list[str], env: dict[str, str]) -> str:
    try:
        return slurm("sbatch", *args, env=env, timeout=120).strip().split(";")[0]
    except SlurmCommandError as e:
        raise JobError(f"sbatch refused {args[-1]}: {e.last_line}") from None


def _scontrol(*args: str) -> None:
    try:
        slurm("scontrol", *args)
    except SlurmCommandError as e:
        raise JobError(f"scontrol {' '.join(args)}: {e}") from None


def submit_scripts(scripts: list[Script], folder: str, *, env: dict[str, str] | None = None) -> dict[str, str]:
    """Write each script into ``folder`` and sbatch it in order; ``@file`` exports become the id
    of that earlier script's job; a script with ``after`` is submitted held and released once
    its dependency is set. Returns {file: job id}. All or nothing: on any failure the jobs this
    call submitted are cancelled, the files it wrote removed, and JobError raised."""
    ids: dict[str, str] = {}
    written: list[str] = []
    # The job finds this interpreter through the environment sbatch passes on (not the file).
    env = {**(os.environ if env is None else env)}
    env.setdefault("MULOCO_PYTHON", sys.executable)
    try:
        for s in scripts:
            path = os.path.join(folder, s.file)
            with open(path, "w") as f:
                f.write(s.text)
            os.chmod(path, 0o755)
            written.append(path)
            cmd = ["--parsable", *(["--hold"] if s.after else [])]
            exports = {k: ids[v[1:]] if v.startswith("@") else v for k, v in s.exports.items()}
            if exports:
                cmd.append("--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in exports.items())]))
            ids[s.file] = _sbatch([*cmd, path], env)
        for s in scripts:
            if s.after:
                after = f"after:{ids[s.after[1:]]}"
                _scontrol(
                    "update",
                    f"JobId={ids[s.file]}",
                    f"Dependency={s.dependency},{after}" if s.dependency else f"Dependency={after}",
                )
                _scontrol("release", ids[s.file])
    except (JobError, OSError) as e:
        cancel(list(ids.values()))
        for path in written:
            os.unlink(path)
        cancelled = f" (cancelled what was submitted: {', '.join(ids.values())})" if ids else ""
        raise JobError(f"{e}{cancelled}") from None
    return ids


def build(kind_name: str, kind_cfg, spec: JobSpec) -> Kind:
    """Check the layout and parse the trainer config (plan); ``place`` sends it to a partition."""
    kind = KINDS[kind_name]
    replicas = getattr(kind_cfg, "replicas", None)
    if replicas is not None and replicas < 1:
        raise JobError(f"--replicas must be at least 1, got {replicas}")
    for key in ("nodes", "nodes_per_replica"):
        if getattr(kind_cfg, key, 1) < 1:
            raise JobError(f"--{key.replace('_', '-')} must be at least 1")
    return kind(kind_cfg, spec, trainer_config(kind, spec, replicas), None)


def cluster_nodes(dry_run: bool, settings: ClusterSettings) -> list[NodeInfo] | None:
    """The cluster's nodes (one sinfo query), asked before any trainer config is parsed so an
    unreachable cluster is known at once. A dry run on a machine that cannot see the cluster
    goes on (None, said) only when the settings give the node shape: guessing it would write a
    CPU-only job for a GPU cluster."""
    try:
        return query_sinfo(timeout=DRY_RUN_SINFO_TIMEOUT_S if dry_run else SINFO_TIMEOUT_S)
    except ClusterUnreachable as e:
        if not dry_run:
            raise
        if settings.gpus_per_node is None:
            raise ClusterError(
                f"{e}. Without the cluster a dry run cannot know its nodes: give the node shape with "
                f"--gpus-per-node N (0 for CPU nodes) and --cpus-per-node C, or set gpus_per_node and "
                f"cpus_per_node in {default_cluster_file()}"
            ) from None
        cpus = "SLURM's default CPUs" if settings.cpus_per_node is None else f"{settings.cpus_per_node} CPUs"
        print(
            f"{PROG}: warning: {e}; the dry run is not checked against a cluster (nodes of "
            f"{settings.gpus_per_node} GPUs and {cpus}, as given)",
            file=sys.stderr,
        )
        return None


def place(jobs: list[Kind], nodes: list[NodeInfo] | None) -> None:
    """Send each job to its partition (the cluster's default when none is set) and check its
    request against the partition's nodes; without ``nodes``, the layout checks only."""
    default = default_partition(nodes) if nodes is not None else None
    for job in jobs:
        if nodes is None:
            job.check()
        else:
            job.place(nodes, default)


@dataclass
class SubmitOptions:
    """What every kind of job takes besides its layout."""

    config: str
    """muloco config module, e.g. diloco/muloco_2bit (ddp: a config without an outer loop)."""
    cluster: Annotated[ClusterOptions, tyro.conf.OmitArgPrefixes] = field(default_factory=ClusterOptions)
    procs: int = 1
    """Ranks per node (per group on `groups`) without GPUs."""
    job_name: str | None = None
    """SLURM job name (default: the config module's path)."""
    requeue: bool = True
    """Requeue on node failure and before the time limit, resuming from the newest checkpoint."""
    signal_s: int = 120
    """Seconds before the time limit to requeue."""
    retries: int = 0
    """Requeue a failed run up to N times."""
    max_restarts: int = 0
    """torchrun restarts of a failed group inside the job."""
    dependency: str | None = None
    """sbatch --dependency, e.g. afterok:1234."""
    dry_run: bool = False
    """Print the script(s); write and submit nothing."""

    def spec(self, overrides: list[str]) -> JobSpec:
        for key, low in (("retries", 0), ("max_restarts", 0), ("procs", 1), ("signal_s", 1)):
            if getattr(self, key) < low:
                raise JobError(f"--{key.replace('_', '-')} must be >= {low}")
        if not self.requeue and self.retries:
            raise JobError("--retries requeues failed runs: it needs --requeue (drop --no-requeue or --retries)")
        return JobSpec(
            self.config,
            overrides,
            self.cluster.settings(),
            job_name=self.job_name,
            requeue=self.requeue,
            retries=self.retries,
            signal_s=self.signal_s,
            max_restarts=self.max_restarts,
            procs=self.procs,
            dependency=self.dependency,
        )


def _kind_options(kind: type[Kind]) -> type[SubmitOptions]:
    """A kind's command line: what every kind takes, and its layout's options."""
    layout = Annotated[kind.Config, tyro.conf.OmitArgPrefixes]
    return make_dataclass(
        kind.__name__.replace("Job", "Options"),
        [("layout", layout, field(default_factory=kind.Config))],
        bases=(SubmitOptions,),
        namespace={"__doc__": kind.__doc__, "__module__": __name__},
    )


OPTIONS: dict[str, type[SubmitOptions]] = {name: _kind_options(kind) for name, kind in KINDS.items()}
PROG = "python -m muloco.launch.slurm"
USAGE = (
    f"usage: {PROG} KIND --config C [options] [-- trainer overrides]\n\nGenerate (and submit) a SLURM job "
    f"for a muloco config. Kinds (`{PROG} KIND --help` lists each one's options):\n"
    + "".join(f"  {name:<9} {cls.__doc__}\n" for name, cls in OPTIONS.items())
    + "  -h, --help  show this message and exit"
)


def parse_command(argv: list[str]) -> tuple[str, SubmitOptions, list[str]]:
    """(kind, its options, the trainer overrides) from ``KIND [options] [-- overrides]``."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    kind = argv[0]
    if kind not in OPTIONS:
        raise UsageError(f"unknown kind {kind!r}: one of {', '.join(OPTIONS)} ({PROG} --help)")
    options, overrides = parse(OPTIONS[kind], argv[1:], prog=f"{PROG} {kind}", description=OPTIONS[kind].__doc__)
    return kind, options, overrides


def prepare_folder(run_dir: str) -> list[str]:
    """The run's ``slurm/`` and ``logs/`` folders (SLURM does not create a log file's folder);
    returns the folders this call created, for ``remove_dirs`` if the submission fails."""
    created: list[str] = []
    for sub in (SLURM_DIR, LOG_DIR):
        created += make_dirs(os.path.join(run_dir, sub))
    return created


def main(argv: list[str] | None = None) -> int:
    try:
        kind, options, overrides = parse_command(list(sys.argv[1:] if argv is None else argv))
    except UsageError as e:
        return failed("slurm", e)
    try:
        spec = options.spec(overrides)
        nodes = cluster_nodes(options.dry_run, spec.cluster)
        job = build(kind, options.layout, spec)
        place([job], nodes)
        scripts = job.scripts()
        if options.dry_run:
            for s in scripts:
                print(
                    f"# ===== {os.path.join(job.run_dir, SLURM_DIR, s.file)} (dry run: not written, "
                    f"not submitted) ====="
                )
                print(s.text)
            return 0
        created = prepare_folder(job.run_dir)
        try:
            ids = submit_scripts(scripts, os.path.join(job.run_dir, SLURM_DIR))
        except JobError:
            remove_dirs(created)  # nothing half-written: the scripts are gone, so are these
            raise
    except (JobError, ClusterError) as e:
        return failed("slurm", e)
    except OSError as e:
        return failed(
            "slurm",
            f"cannot write the job into {job.run_dir}: {e.strerror or e}; pick a writable --dump_folder",
            BAD_INPUT,
        )
    for file, job_id in ids.items():
        print(f"submitted {os.path.join(job.run_dir, SLURM_DIR, file)} as job {job_id}")
    print(
        f"logs: {os.path.join(job.run_dir, LOG_DIR)}/ and {os.path.join(job.run_dir, SLURM_DIR)}/; "
        f"results: python -m muloco.report {job.run_dir}"
    )
    return 0
