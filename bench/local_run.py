"""One whole local job to completion, for the benches that measure jobs (``sync_overhead``,
``link_planner``, ``unequal_groups``, ``round_modes``): the launcher users run (``muloco.launch.local``'s LocalJob: a
lighthouse and K replica groups, one torchrun and one thread each), with every quorum holding all
K groups, no checkpoints, TensorBoard or (unless asked) validation, and a hang timer that stops the job. What each
replica recorded is read back from its dump folder; a failed job raises with its logs' tails."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from muloco.launch.gpu_slices import visible_gpus
from muloco.launch.local import LocalJob

# No checkpoint is ever written. Not --checkpoint.no-enable: with it the DiLoCo trainer fails at
# start-up (a disabled torchtitan CheckpointManager has no ``states``, which DilocoTrainer registers
# the outer loop in). load_only keeps the states and never saves; the dump folder is fresh, so there
# is nothing to load either.
OFF = ("--checkpoint.enable", "--checkpoint.load_only", "--validator.no-enable", "--metrics.no-enable-tensorboard")


@dataclass
class FinishedJob:
    wall_s: float  # from the launch to the last group's exit
    logs: Path  # the launcher's per-replica logs (replica_<i>.log)
    replicas: list[dict]  # per replica: "summary" (summary.json) and "rows" (metrics.jsonl)


def add_job_options(parser, timeout: float) -> None:
    """The options every job bench takes: the run's length and H, the CI smoke, the hang timeout, --keep."""
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds before a job counts as hung")
    parser.add_argument("--keep", action="store_true", help="keep the jobs' folders")


def tail(path: Path, n: int = 30) -> str:
    """The last ``n`` lines of a log, for a failure message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def run_local_job(
    work: Path,
    config: str,
    replicas: int,
    overrides: list[str],
    timeout: float,
    *,
    env: dict[str, str] | None = None,
    join_timeout_ms: int = 20000,
    validate: bool = False,
    watch: Callable[[LocalJob], Callable[[], None]] | None = None,
    launch: dict | None = None,
) -> FinishedJob:
    """Run the job in ``work`` (made here) until it ends or ``timeout`` seconds pass (then it is
    stopped and this raises). ``env`` goes to every group's processes; ``validate`` keeps the
    config's validation on; ``watch(job)`` starts something beside the running job and returns
    what ends it; ``launch`` replaces the launcher's settings (e.g. ``netns``, ``max_restarts``,
    ``min_replicas``: None for a majority)."""
    off = [flag for flag in OFF if not (validate and flag == "--validator.no-enable")]
    work.mkdir(parents=True)
    dump, logs = work / "dump", work / "logs"
    with open(work / "launcher.log", "w") as console:
        settings = {"min_replicas": replicas, "join_timeout_ms": join_timeout_ms, **(launch or {})}
        job = LocalJob(
            config=config,
            replicas=replicas,
            threads=1,
            visible_gpus=visible_gpus()[:1],
            share_gpus=True,  # on a GPU host: all on its first GPU
            log_dir=str(logs),
            console=console,
            env=dict(env or {}),
            overrides=[*overrides, *off, "--dump_folder", str(dump)],
            **settings,
        )
        stop_watching = watch(job) if watch is not None else None
        hung = threading.Timer(timeout, job.stop, args=(124,))
        hung.start()
        t0 = time.monotonic()
        try:
            status = job.run()
        finally:
            hung.cancel()
            if stop_watching is not None:
                stop_watching()
        wall = time.monotonic() - t0
    if status in (130, 143):  # Ctrl-C or SIGTERM (a time limit): the launcher stopped the job; so do we
        raise SystemExit(status)
    if status != 0:
        why = f"still running after {timeout:.0f}s" if status == 124 else f"exit {status}"
        tails = "\n".join(
            f"--- {p.name} tail ---\n{tail(p)}" for p in [work / "launcher.log", *sorted(logs.glob("*.log"))]
        )
        raise RuntimeError(f"{work.name}: the job failed ({why})\n{tails}")
    return FinishedJob(wall_s=wall, logs=logs, replicas=[_recorded(dump / f"replica_{i}") for i in range(replicas)])


def _recorded(folder: Path) -> dict:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"summary": json.loads((folder / "summary.json").read_text()), "rows": rows}
