"""Replica groups of unequal speed in lockstep rounds: what the faster groups lose waiting for the slowest.

    .venv/bin/python bench/unequal_groups.py [--replicas 2] [--slowdown 2] [--config diloco/muloco_2bit]
        [--steps 60] [--sync-every 10] [--smoke] [--timeout 900] [--keep]

Two real jobs on this machine (the local launcher users run: a lighthouse and K replica groups,
one torchrun and one thread each) train the tiny model (``llama3-w128-d4-h2``, seq 256, batch 8):
first every group at this machine's pace ("equal"), then the same job with its last group made
``--slowdown`` times slower: it sleeps (slowdown - 1) x the equal run's median inner step after
each of its steps (``bench/slow_site``, this bench's own hook; muloco reads no such setting), as
a group on slower GPUs would. Rounds are lockstep: every group trains H steps, then the quorum
waits for the slowest.

Printed per run and group: seconds in inner steps and in syncs (the quorum's wait for the
slowest group is part of a sync), and each run's wall-clock and job tokens/s. Then the cost of
the slow group: the share of all groups' time spent in syncs, slowed run against equal run (the
rise is the waiting), next to what the planner's formula (``muloco map ... --group-slowdowns``,
``muloco/sizing/link_plan.py``) projects from the measured step times; the wall-clock ratio
against the ideal where every group keeps its own pace; and whether θ_g after the last sync is
bit for bit the equal run's (lockstep changes when groups meet, not what they compute).

``--smoke`` (what CI runs): ``llama3-w64-d2-h2``, seq 64, batch 2, 6 steps, H=2. Outputs go to a
temporary folder removed at the end (``--keep`` leaves it). Nothing here asserts on timing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from local_run import add_job_options, run_local_job  # bench/ is on sys.path when a bench script runs
from machine import exit_on_sigterm, loadavg

SLOW_SITE = Path(__file__).resolve().parent / "slow_site"


def run_job(
    root: Path,
    name: str,
    config: str,
    replicas: int,
    overrides: list[str],
    timeout: float,
    slow: tuple[int, float] | None = None,
) -> list[dict]:
    """One local job to completion (``slow``: that replica sleeps that many seconds per step);
    per replica its summary, its inner steps' times and its syncs' times."""
    env = {}
    if slow is not None:
        env = {
            "MULOCO_BENCH_SLOW": f"{slow[0]}:{slow[1]:.6f}",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(SLOW_SITE), os.environ.get("PYTHONPATH")])),
        }
    job = run_local_job(root / name, config, replicas, overrides, timeout, env=env, join_timeout_ms=60000)
    return [
        {
            "summary": r["summary"],
            "steps": [x["step_time_s"] for x in r["rows"] if "step_time_s" in x],
            "syncs": [x["sync/seconds"] for x in r["rows"] if "sync/seconds" in x],
        }
        for r in job.replicas
    ]


def groups(replicas: list[dict]) -> list[dict]:
    """Per group: seconds in inner steps, seconds in syncs, the median step (the first step, which
    also builds and warms up, left out)."""
    return [
        {"steps_s": sum(r["steps"]), "syncs_s": sum(r["syncs"]), "median_step_s": statistics.median(r["steps"][1:])}
        for r in replicas
    ]


def sync_share(per_group: list[dict]) -> float:
    """Share of all groups' time (steps and syncs) spent in syncs."""
    return sum(g["syncs_s"] for g in per_group) / sum(g["steps_s"] + g["syncs_s"] for g in per_group)


def projected_idle_share(steps: list[float], sync_every: int, sync_s: float) -> float:
    """The planner's formula (``link_plan.Plan.idle_share``): per lockstep round every group
    waits H x (slowest step - its step), of K x (H x slowest step + the sync's own time)."""
    slowest = max(steps)
    return sum(sync_every * (slowest - s) for s in steps) / (len(steps) * (sync_every * slowest + sync_s))


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--slowdown", type=float, default=2.0, help="the last group's step as a multiple of the others'")
    p.add_argument("--config", default="diloco/muloco_2bit")
    add_job_options(p, timeout=900)
    args = p.parse_args()
    if args.replicas < 2 or not args.slowdown > 1:
        p.error("--replicas must be at least 2 and --slowdown above 1")
    if args.steps % args.sync_every:
        p.error(f"--steps {args.steps} must be a multiple of --sync-every {args.sync_every}")
    flavor, shape = "llama3-w128-d4-h2", ["--training.seq_len", "256", "--training.local_batch_size", "8"]
    if args.smoke:
        flavor, shape = "llama3-w64-d2-h2", ["--training.seq_len", "64", "--training.local_batch_size", "2"]
        args.steps, args.sync_every = 6, 2
    k, h = args.replicas, args.sync_every
    overrides = [
        "--model.flavor",
        flavor,
        *shape,
        "--training.steps",
        str(args.steps),
        "--outer.sync_every",
        str(h),
        "--metrics.log_freq",
        "1",
        "--lr_scheduler.warmup_steps",
        "1",
    ]
    root = Path(tempfile.mkdtemp(prefix="unequal_groups_"))
    print(
        f"machine load average at start: {loadavg()}; {args.config}, K={k}, {flavor}, {args.steps} steps, H={h}; "
        f"then group {k - 1} {args.slowdown:g}x slower"
    )
    try:
        equal = run_job(root, "equal", args.config, k, overrides, args.timeout)
        step = statistics.median(g["median_step_s"] for g in groups(equal))
        slowed = run_job(
            root, "slowed", args.config, k, overrides, args.timeout, slow=(k - 1, (args.slowdown - 1) * step)
        )
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    runs = [("equal", equal), (f"group {k - 1} {args.slowdown:g}x slower", slowed)]
    print(f"\n{'run':<24}{'wall s':>8}{'job tok/s':>11}  {'group':>5}{'steps s':>9}{'syncs s':>9}{'median step s':>15}")
    for name, replicas in runs:
        wall = max(r["summary"]["wall_seconds"] for r in replicas)
        tokens = sum(r["summary"]["tokens_seen"] for r in replicas)
        for i, g in enumerate(groups(replicas)):
            head = f"{name:<24}{wall:>8.1f}{tokens / wall:>11,.0f}" if i == 0 else " " * 43
            print(f"{head}  {i:>5}{g['steps_s']:>9.2f}{g['syncs_s']:>9.2f}{g['median_step_s']:>15.4f}")
    eq, sl = groups(equal), groups(slowed)
    steps_slowed = [g["median_step_s"] for g in sl]
    per_sync = statistics.median(s for r in equal for s in r["syncs"][1:] or r["syncs"])
    rise = sync_share(sl) - sync_share(eq)
    wall_eq = max(r["summary"]["wall_seconds"] for r in equal)
    wall_sl = max(r["summary"]["wall_seconds"] for r in slowed)
    own_pace = sum(1 / s for s in steps_slowed) / (k / max(steps_slowed))
    same = len({r["summary"]["diloco"]["final_global_sha256"] for r in equal + slowed}) == 1
    print(
        f"\nsyncs' share of all groups' time: {100 * sync_share(eq):.1f}% equal, {100 * sync_share(sl):.1f}% with the "
        f"slow group: the waiting it causes is {100 * rise:.1f}% of all groups' time (measured); the planner's "
        f"formula from the measured steps ({', '.join(f'{s:.4f}' for s in steps_slowed)} s) and the equal run's "
        f"{per_sync:.3f} s per sync: {100 * projected_idle_share(steps_slowed, h, per_sync):.1f}%"
    )
    print(
        f"wall-clock with the slow group / equal: {wall_sl / wall_eq:.2f}; each group at its own pace would train "
        f"{own_pace:.2f}x the lockstep job's tokens per second of compute (the ceiling for rounds that do not wait)"
    )
    print(
        f"θ_g after the last sync bit for bit the equal run's: {'yes' if same else 'no'} "
        "(lockstep changes when the groups meet, not what they compute)"
    )
    print(f"machine load average at the end: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
