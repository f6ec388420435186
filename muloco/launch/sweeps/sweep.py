"""Hyperparameter sweeps on SLURM: a grid of runs, one job array where the shapes allow.

A sweep file (``jobs/sweeps/*.py``) names its runs with ``grid`` and calls ``main``::

    from muloco.launch.sweeps.sweep import Sweep, grid, main
    SWEEP = Sweep("inner_lr", grid("groups", "diloco/muloco", replicas=2,
                                   vary={"--optimizer.lr": [0.01, 0.02]}))
    if __name__ == "__main__":
        raise SystemExit(main(SWEEP))

``python jobs/sweeps/FILE.py [--out DIR] [--dry-run] [--parallel N] [--max-nodes M]
[--smoke-steps S] [--retries R] [--resubmit-failed] [--status] [cluster flags] [-- overrides]``

- Every run's trainer config is parsed and checked before anything is submitted; run names
  encode method, objective, flavor, K, H, codec and learning rates (readable, unique, stable).
- Runs of one kind and shape become one job array, throttled with ``--array=...%N``
  (``--parallel``); otherwise, or with ``--max-nodes``, one job each.
- ``--max-nodes M`` submits a job only once this user's running and pending jobs (all QOS,
  counted with squeue) plus the job's nodes fit in M; it waits in the foreground, saying so.
- ``--smoke-steps S`` first submits a short copy of the first run; the sweep depends on it
  (``afterok``), so a broken setup fails once, not N times.
- Failed runs requeue themselves up to ``--retries`` times and resume from their checkpoint.
- ``manifest.jsonl`` in the sweep folder has one line per run (name, kind, config, overrides,
  run folder, job ids, state). Running the sweep again submits only runs that have no job yet
  (resume); ``--resubmit-failed`` also resubmits runs whose job failed, was cancelled or timed
  out; ``--status`` prints the states. Nothing is ever deleted; the manifest is rewritten
  atomically.
"""

from __future__ import annotations

import getpass
import itertools
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from typing import Annotated

import tyro

from muloco.launch.gpu_slices import visible_gpus
from muloco.launch.slurm.cluster import ClusterError, ClusterOptions
from muloco.launch.slurm.commands import FAILED_STATES, SlurmCommandError, job_state, nodes_in_use
from muloco.launch.slurm.jobs import (
    KINDS,
    SLURM_DIR,
    JobError,
    JobSpec,
    Kind,
    Script,
    array_script,
    build,
    cluster_nodes,
    place,
    prepare_folder,
    submit_scripts,
)
from muloco.models.flavors import parse_flavor, rescaled_weight_decay
from muloco.runs.lock import DumpFolderBusy, DumpFolderLock
from muloco.runs.names import run_name
from muloco.runs.sweep_manifest import MANIFEST, Entry, ManifestError, read_manifest, run_finished, write_manifest
from muloco.utils.command_line import UsageError, failed, parse
from muloco.utils.errors import BAD_INPUT


@dataclass
class RunSpec:
    """One run of a sweep before it has a name: kind, config, kind options, trainer overrides."""

    kind: str
    config: str
    overrides: list[str] = field(default_factory=list)
    options: dict = field(default_factory=dict)
    """The kind's Config fields (replicas, nodes, ...)."""


@dataclass
class Sweep:
    name: str
    runs: list[RunSpec]


def _flag_value(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def lr_grid(center: float, points: int = 3) -> list[float]:
    """``points`` learning rates around ``center`` on MuLoCo's 2^(-k/2) ladder (√2 apart)."""
    half = points // 2
    return [float(f"{center * 2 ** (k / 2):.4g}") for k in range(-half, points - half)]


def paper_batch_and_decay(
    flavor: str, weight_decay_key: str, replicas: int = 1, global_batch: int = 512
) -> dict[str, object]:
    """Fixed flags that hold MuLoCo's setup for K groups: the global batch split over the groups
    (the GPU presets split it by the config's own K, not the launcher's ``--replicas``) and the
    weight decay tuned at batch 512, rescaled by steps and divided by K (the model map's rule)."""
    if global_batch % replicas:
        raise ValueError(f"global batch {global_batch} does not split over K={replicas} groups")
    wd = parse_flavor(flavor).shape.weight_decay[weight_decay_key]
    return {
        "--training.global_batch_size": global_batch // replicas,
        "--optimizer.weight_decay": float(f"{rescaled_weight_decay(wd, flavor, global_batch, replicas=replicas):.6g}"),
    }


def grid(
    kind: str, config: str, *, vary: dict[str, list] | None = None, fixed: dict | None = None, **options
) -> list[RunSpec]:
    """Every combination of ``vary`` (trainer flag → values), with ``fixed`` flags on all."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}: one of {', '.join(KINDS)}")
    vary = vary or {}
    base = [x for k, v in (fixed or {}).items() for x in (k, _flag_value(v))]
    runs = []
    for values in itertools.product(*vary.values()):
        flags = [x for k, v in zip(vary, values) for x in (k, _flag_value(v))]
        runs.append(RunSpec(kind, config, base + flags, dict(options)))
    return runs


# -- building and submitting -----------------------------------------------------------------


@dataclass
class Planned:
    entry: Entry
    job: Kind


def plan(sweep: Sweep, folder: str, spec_for, extra: list[str]) -> list[Planned]:
    """Parse every run's config (a bad one stops the sweep before anything is submitted)."""
    planned, names = [], set()
    for run in sweep.runs:
        kind_cfg = KINDS[run.kind].Config(**run.options)
        spec = spec_for(run.config, run.overrides + extra)
        job = build(run.kind, kind_cfg, spec)
        name = run_name(job.trainer)
        if name in names:
            raise JobError(
                f"two runs of sweep {sweep.name} are both named {name}: they differ only in "
                f"settings the name does not show; vary a named setting or split the sweep"
            )
        names.add(name)
        run_dir = os.path.join(folder, name)
        spec.overrides = [*spec.overrides, "--dump_folder", run_dir]
        spec.job_name = f"{sweep.name}-{name}"[:120]
        job.trainer.dump_folder = run_dir
        planned.append(Planned(Entry(name, run.kind, run.config, spec.overrides, run.options, run_dir), job))
    return planned


def same_shape(planned: list[Planned]) -> bool:
    """One array needs one header and one launch line: the same kind with the same options
    (K, nodes) and resources, of a kind that is one script per run (not ``array``)."""
    first = planned[0]
    return first.entry.kind != "array" and all(
        p.entry.kind == first.entry.kind
        and p.entry.options == first.entry.options
        and p.job.resources() == first.job.resources()
        for p in planned
    )


@dataclass
class Submission:
    """What one submission sends: its scripts, the runs they carry (task i of an array runs
    ``runs[i]``), and the folder the scripts are written to."""

    scripts: list[Script]
    runs: list[Planned]
    folder: str

    @property
    def array(self) -> bool:
        return len(self.runs) > 1


def render(planned: list[Planned], sweep: Sweep, folder: str, args) -> list[Submission]:
    """The job scripts of ``planned``, rendered once (the dry run prints what is submitted): one
    array when their shapes allow and ``--max-nodes`` does not ask for one job per run, else
    each run's own scripts."""
    if not args.max_nodes and len(planned) > 1 and same_shape(planned):
        logs = os.path.join(folder, SLURM_DIR)
        script = array_script(
            [p.job for p in planned], [p.entry.name for p in planned], sweep.name, logs, args.parallel
        )
        return [Submission([script], planned, logs)]
    return [Submission(p.job.scripts(), [p], os.path.join(p.job.run_dir, SLURM_DIR)) for p in planned]


def _without(overrides: list[str], option: str) -> list[str]:
    """``overrides`` less ``option`` and its value (``--option V`` or ``--option=V``)."""
    kept, skip = [], False
    for arg in overrides:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            kept.append(arg)
    return kept


def smoke_script(p: Planned, steps: int, folder: str) -> tuple[Script, str]:
    """A short copy of run ``p`` in its own folder; the sweep waits for it to succeed."""
    spec = p.job.spec
    if p.entry.kind == "array":
        raise JobError(
            "--smoke-steps is not available for array-kind sweeps (its lighthouse is a job of "
            "its own); smoke-test one run with python -m muloco.launch.slurm array first"
        )
    smoke_dir = os.path.join(folder, "smoke-" + time.strftime("%Y%m%d-%H%M%S"))  # never reuse a checkpoint
    overrides = _without(spec.overrides, "--training.epochs")  # its length is the steps asked
    smoke = JobSpec(
        spec.config,
        [*overrides, "--training.steps", str(steps), "--dump_folder", smoke_dir],
        spec.cluster,
        job_name=f"{spec.name}-smoke"[:120],
        requeue=False,
        procs=spec.procs,
        max_restarts=spec.max_restarts,
    )
    job = build(p.entry.kind, p.job.cfg, smoke)
    job.partition = p.job.partition  # the run's partition, placed and checked: the same GPUs and CPUs asked
    prepare_folder(smoke_dir)
    return job.scripts()[0], smoke_dir


def wait_for_nodes(needed: int, max_nodes: int, poll_s: float, say) -> None:
    if needed > max_nodes:
        raise JobError(f"a run needs {needed} node(s), more than --max-nodes {max_nodes}: it could never start")
    user = getpass.getuser()
    announced = False
    while (used := _nodes_in_use(user)) + needed > max_nodes:
        if not announced:
            say(f"waiting: {used} node(s) in use by {user}, the next job needs {needed}, --max-nodes {max_nodes}")
            announced = True
        time.sleep(poll_s)


def _nodes_in_use(user: str) -> int:
    try:
        return nodes_in_use(user)
    except SlurmCommandError as e:
        raise JobError(f"{e}, while counting nodes for --max-nodes") from None


def nodes_of(p: Planned) -> int:
    """Nodes a run holds: an array-kind run is K tasks plus its lighthouse's (shared) node."""
    nodes = p.job.resources().nodes
    return nodes * p.job.replicas + 1 if p.entry.kind == "array" else nodes


class SweepRunner:
    """Submits a planned sweep and keeps its manifest."""

    def __init__(self, sweep: Sweep, folder: str, args, say=print):
        self.sweep, self.folder, self.args, self.say = sweep, folder, args, say
        self.entries = read_manifest(folder)

    def known(self, p: Planned) -> Entry | None:
        """The manifest's entry of run ``p``; an entry with other settings is refused (the run's
        folder would mix two runs)."""
        old = self.entries.get(p.entry.name)
        if old is not None and (old.overrides, old.config, old.options) != (
            p.entry.overrides,
            p.entry.config,
            p.entry.options,
        ):
            raise JobError(
                f"run {p.entry.name} is in {MANIFEST} with other settings "
                f"({old.config} {' '.join(old.overrides)}): its folder would mix two "
                f"runs; use a new --out for changed settings"
            )
        return old

    def pending(self, planned: list[Planned]) -> list[Planned]:
        """Runs to submit now: no job yet, or (``--resubmit-failed``) a job that failed."""
        todo = []
        for p in planned:
            old = self.known(p)
            if old is None or not old.jobs:
                todo.append(p)
                continue
            old.state = job_state(old.job, run_finished(old.run_dir))
            if self.args.resubmit_failed and old.state.split()[0] in FAILED_STATES:
                p.entry.jobs = list(old.jobs)
                todo.append(p)
        return todo

    def record(self, p: Planned, job_id: str, files: dict[str, str] | None = None) -> None:
        p.entry.jobs.append(job_id)
        p.entry.job_files = dict(files or {})
        p.entry.state = "SUBMITTED"
        self.entries[p.entry.name] = p.entry
        write_manifest(self.folder, self.entries)

    def submit(self, submissions: list[Submission]) -> None:
        """Submit each once, recording its job ids as they come (``--max-nodes``: a run once it fits)."""
        for sub in submissions:
            if sub.array:
                file = sub.scripts[0].file
                array_id = submit_scripts(sub.scripts, sub.folder)[file]
                for i, p in enumerate(sub.runs):
                    self.record(p, f"{array_id}_{i}", {file: f"{array_id}_{i}"})
                self.say(
                    f"submitted {len(sub.runs)} runs as job array {array_id} (at most {self.args.parallel} at once)"
                )
                continue
            (p,) = sub.runs
            if self.args.max_nodes:
                wait_for_nodes(nodes_of(p), self.args.max_nodes, self.args.poll_s, self.say)
            ids = submit_scripts(sub.scripts, sub.folder)
            self.record(p, next(iter(ids.values())), ids)
            self.say(f"submitted {p.entry.name} as job {', '.join(ids.values())}")

    def status(self) -> int:
        for e in self.entries.values():
            if e.job and e.job.startswith("local:"):  # --local: the manifest's state, a summary means done
                e.state = "COMPLETED" if run_finished(e.run_dir) else e.state
            else:
                e.state = job_state(e.job, run_finished(e.run_dir)) if e.job else "NEW"
            self.say(f"{e.state:<12} {e.job or '-':<12} {e.name}")
        write_manifest(self.folder, self.entries)
        return 0


@dataclass
class SweepOptions:
    """Submit a sweep's runs to SLURM (one job array where the shapes allow)."""

    out: str = ""
    """Sweep folder (default: outputs/sweeps/<sweep name>)."""
    dry_run: bool = False
    """Print the runs and script(s); write and submit nothing."""
    parallel: int = 8
    """Array tasks running at once (--array=...%N; when the sweep is one array)."""
    max_nodes: int | None = None
    """Keep this user's nodes in use at or below M (one job per run, each submitted once it fits)."""
    poll_s: float = 30.0
    """How often --max-nodes re-counts (seconds)."""
    smoke_steps: int | None = None
    """Gate the sweep on a short copy of its first run."""
    retries: int = 1
    """Requeue a failed run up to N times."""
    resubmit_failed: bool = False
    """Also resubmit runs whose job failed or was cancelled."""
    status: bool = False
    """Print every run's job state and exit."""
    cluster: Annotated[ClusterOptions, tyro.conf.OmitArgPrefixes] = field(default_factory=ClusterOptions)
    procs: int = 1
    """Ranks per node (per group) without GPUs."""
    local: int = 0
    """Run the sweep on this machine instead, N runs at a time (no SLURM needed; submitit's local
    executor; --parallel is for SLURM arrays); 0: submit to SLURM."""


def main(sweep: Sweep, argv: list[str] | None = None) -> int:
    prog = f"sweep {sweep.name}"
    try:
        args, extra = parse(
            SweepOptions,
            list(sys.argv[1:] if argv is None else argv),
            prog=prog,
            description=f"Submit sweep {sweep.name} ({len(sweep.runs)} runs) to SLURM (or run it here with --local N).",
        )
    except UsageError as e:
        return failed("sweep", f"{sweep.name}: {e}", BAD_INPUT)
    args.out = args.out or os.path.join("outputs", "sweeps", sweep.name)
    try:
        return _run(sweep, args, extra)
    except (JobError, ClusterError, ManifestError, DumpFolderBusy) as e:
        return failed("sweep", f"{sweep.name}: {e}", BAD_INPUT)


def _check_args(args) -> None:
    for key in ("parallel", "max_nodes", "smoke_steps", "procs"):
        value = getattr(args, key)
        if value is not None and value < 1:
            raise JobError(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    if args.retries < 0:
        raise JobError(f"--retries must be >= 0, got {args.retries}")


def _run(sweep: Sweep, args, extra: list[str]) -> int:
    _check_args(args)
    runner = SweepRunner(sweep, args.out, args)
    if args.status:
        return runner.status()
    cluster = args.cluster.settings()

    def spec_for(config: str, overrides: list[str]) -> JobSpec:
        return JobSpec(config, overrides, cluster, retries=args.retries, procs=args.procs)

    planned = plan(sweep, args.out, spec_for, extra)  # plan: every run's config parsed and named
    if args.local:
        return _run_local(sweep, args, runner, planned)
    place([p.job for p in planned], cluster_nodes(args.dry_run, cluster))  # place: partitions, checked
    if args.dry_run:
        return _dry_run(planned, sweep, args)
    with DumpFolderLock(args.out, option="--out"):  # one launcher per sweep folder: two would lose each other's job ids
        return _submit(sweep, args, runner, planned)


def _submit(sweep: Sweep, args, runner: "SweepRunner", planned: list[Planned]) -> int:
    runner.entries = read_manifest(args.out)  # as it is now that we hold the folder
    todo = runner.pending(planned)
    if not todo:
        print(
            f"sweep {sweep.name}: every run already has a job (--status shows them; "
            f"--resubmit-failed resubmits the failed ones)"
        )
        return 0
    os.makedirs(os.path.join(args.out, SLURM_DIR), exist_ok=True)
    dependency = None
    if args.smoke_steps:
        smoke, smoke_dir = smoke_script(todo[0], args.smoke_steps, args.out)
        smoke_id = submit_scripts([smoke], os.path.join(smoke_dir, SLURM_DIR))[smoke.file]
        dependency = f"afterok:{smoke_id}"
        print(f"submitted smoke test ({args.smoke_steps} steps of {todo[0].entry.name}) as job {smoke_id}")
    for p in todo:
        prepare_folder(p.job.run_dir)
        p.job.spec.dependency = dependency
    runner.submit(render(todo, sweep, args.out, args))
    print(f"manifest: {os.path.join(args.out, MANIFEST)}; results: python -m muloco.report {args.out}")
    return 0


def _run_local(sweep: Sweep, args, runner: "SweepRunner", planned: list[Planned]) -> int:
    """``--local N``: every run not finished yet, on this machine (:mod:`muloco.launch.sweeps.local_runs`)."""
    from muloco.launch.sweeps.local_runs import LocalRuns, local_command  # start-up: submitit, for --local only

    refused = [
        flag
        for flag, on in (
            ("--smoke-steps", args.smoke_steps),
            ("--max-nodes", args.max_nodes),
            ("--resubmit-failed", args.resubmit_failed),
        )
        if on
    ]
    if refused:
        raise JobError(
            f"{', '.join(refused)} apply to SLURM submissions, not to --local (which runs every "
            f"unfinished run, failed ones included, N at a time)"
        )
    for p in planned:
        p.job.check()  # the layout, without a cluster to place it on
    gpus = len(visible_gpus())
    todo = [p for p in planned if not run_finished(p.entry.run_dir)]
    groups = {p.entry.name: getattr(p.job, "replicas", 1) for p in todo}
    shared = {name for name, k in groups.items() if 0 < gpus < k}  # as compare does: fewer GPUs than groups
    runs = [
        (
            p.entry.name,
            local_command(
                p.entry.kind,
                p.entry.config,
                p.entry.overrides,
                replicas=groups[p.entry.name],
                procs=args.procs,
                gpus=gpus,
                share_gpus=p.entry.name in shared,
            ),
        )
        for p in todo
    ]
    if shared:
        print(
            f"note: {gpus} GPU(s) for up to {max(groups.values())} replica groups: the groups of {len(shared)} run(s) "
            f"share GPUs (--share-gpus), so their wall times include the sharing",
            file=sys.stderr,
        )
    reused = len(planned) - len(todo)
    if args.dry_run:
        for name, cmd in runs:
            print(f"run {name}: {shlex.join(cmd)}")
        print(f"dry run: {len(runs)} run(s) to run here ({reused} finished before); nothing started")
        return 0
    with DumpFolderLock(args.out, option="--out"):
        failed = _run_here(sweep, args, runner, planned, runs, reused, LocalRuns)
    if failed:
        print(
            f"sweep {sweep.name}: {len(failed)} run(s) failed: {', '.join(failed)}; logs in "
            f"{os.path.join(args.out, 'logs')}; run the sweep again to retry them",
            file=sys.stderr,
        )
        return 1
    print(f"manifest: {os.path.join(args.out, MANIFEST)}; results: python -m muloco.report {args.out}")
    return 0


def _run_here(
    sweep: Sweep, args, runner: "SweepRunner", planned: list[Planned], runs, reused: int, local_runs
) -> list[str]:
    """The manifest first (finished runs marked as such), then the runs, each entry kept by
    ``local_runs`` as it starts and ends."""
    runner.entries = read_manifest(args.out)
    by_name = {p.entry.name: p.entry for p in planned}
    for p in planned:
        old = runner.known(p)
        if old is not None:
            p.entry.jobs = list(old.jobs)  # every earlier job of the run, SLURM's and local ones
        if run_finished(p.entry.run_dir):
            p.entry.state = "COMPLETED"
            runner.entries[p.entry.name] = p.entry
    write_manifest(args.out, runner.entries)
    print(f"sweep {sweep.name}: {len(runs)} run(s) here, {args.local} at a time ({reused} finished before)")
    ended = local_runs(args.out, args.local, runner.entries).run([(by_name[name], cmd) for name, cmd in runs])
    return [name for name, event in ended.items() if event.state != "COMPLETED"]


def _dry_run(planned: list[Planned], sweep: Sweep, args) -> int:
    for p in planned:
        print(f"run {p.entry.name}: {p.entry.kind} --config {p.entry.config} -- {' '.join(p.entry.overrides)}")
    for sub in render(planned, sweep, args.out, args):
        for s in sub.scripts:
            print(s.text)
    print(f"dry run: {len(planned)} run(s); nothing written, nothing submitted")
    return 0
