"""Lockstep against deadline rounds with replica groups of unequal speed: wall-clock to the same loss.

    .venv/bin/python bench/round_modes.py [--cases 2x2,3x3,2x1] [--seeds 2] [--modes lockstep,deadline]
        [--config diloco/muloco_2bit] [--steps 60] [--sync-every 10] [--smoke] [--timeout 900] [--keep]

A case ``KxF`` is K replica groups whose last group is F times slower than the others (``2x1``:
equal groups). Each case, mode and seed is one real job on this machine (the local launcher users
run: a lighthouse and K groups, one torchrun and one thread each) training the tiny model
(``llama3-w128-d4-h2``, seq 256, batch 8) for ``--steps`` nominal steps with validation of θ_g after
every round (each job's own seed: ``--debug.seed``). The slow group sleeps (F - 1) x the median
inner step of the case's equal-speed lockstep run after each of its steps (``bench/slow_site``, this
bench's own hook; muloco reads no such setting). ``deadline`` runs
``--outer.round deadline --outer.exchange.weighting tokens`` (``outer/rounds/deadline.py``);
``deadline-equal`` the same rounds with every group's Δ counted the same (``--modes`` picks them).

Printed per case, mode and seed: the job's wall-clock (start-up included), the final validation
loss, the job's tokens/s, the inner steps each group trained, and, against the same seed's lockstep
run, timed from each job's first inner step (the start-up is the same in every mode): how long the
mode took to reach lockstep's final loss (its first validation at or below it), the ratio to the
time lockstep took, the mode's loss at that time (its last validation by then), and lockstep's loss
when the mode ended (its last validation by then: equal wall-clock the other way). Then per case
the ratio's mean and spread over seeds against the targets: with one group 2x slower, deadline
rounds reach lockstep's loss in at most 0.75x its time; with equal groups, no worse than lockstep
(final loss within the seeds' spread).

``--smoke`` (what CI runs): ``llama3-w64-d2-h2``, seq 64, batch 2, 8 steps, H=2, case 2x2, one seed,
and no pace-probing job: the slow group sleeps a fixed ``SMOKE_PACE`` after each step (the probe is a
third job that only sets the sleep).
Outputs go to a temporary folder removed at the end (``--keep`` leaves it). Nothing here asserts.
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
DEADLINE = ["--outer.round", "deadline"]
MODES = {
    "lockstep": [],
    "deadline": [*DEADLINE, "--outer.exchange.weighting", "tokens"],
    "deadline-equal": [*DEADLINE, "--outer.exchange.weighting", "equal"],
}
"""``deadline-equal``: deadline rounds whose merge counts every group the same (the weighting's ablation)."""
SMOKE_PACE = 0.05
"""Seconds an inner step of the smoke's tiny model stands for, instead of probing it."""


def parse_case(text: str) -> tuple[int, float]:
    k, _, factor = text.partition("x")
    try:
        case = int(k), float(factor)
    except ValueError:
        raise SystemExit(f"--cases {text!r}: write KxF, e.g. 2x2 (two groups, the last 2x slower) or 2x1") from None
    if case[0] < 2 or case[1] < 1:
        raise SystemExit(f"--cases {text!r}: K >= 2 groups and a slowdown F >= 1")
    return case


def run(
    root: Path, name: str, config: str, k: int, overrides: list[str], timeout: float, slow: tuple[int, float] | None
) -> dict:
    """One job; its start time, wall-clock, validations (epoch time, loss), per-group steps and tokens."""
    env = {}
    if slow is not None and slow[1] > 0:
        env = {
            "MULOCO_BENCH_SLOW": f"{slow[0]}:{slow[1]:.6f}",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(SLOW_SITE), os.environ.get("PYTHONPATH")])),
        }
    job = run_local_job(root / name, config, k, overrides, timeout, env=env, join_timeout_ms=60000, validate=True)
    first = job.replicas[0]
    step1 = next(r for r in first["rows"] if "step_time_s" in r)
    origin = step1["time"] - step1["step_time_s"]  # the first inner step's start: start-up left out
    validations = [(r["time"] - origin, r["validation_loss"]) for r in first["rows"] if "validation_loss" in r]
    steps = [[x["step_time_s"] for x in r["rows"] if "step_time_s" in x] for r in job.replicas]
    return {
        "wall": job.wall_s,
        "validations": validations,
        "final": first["summary"]["final_validation_loss"],
        "steps": [r["summary"]["steps"] for r in job.replicas],
        "tokens": sum(r["summary"]["tokens_seen"] for r in job.replicas),
        "median_step": statistics.median(s for group in steps for s in group[1:] or group),
        "sha": {r["summary"]["diloco"]["final_global_sha256"] for r in job.replicas},
    }


def time_to(validations: list[tuple[float, float]], loss: float) -> float | None:
    """Seconds from the job's start to its first validation at or below ``loss``."""
    return next((t for t, v in validations if v <= loss + 1e-9), None)


def loss_at(validations: list[tuple[float, float]], seconds: float) -> float | None:
    """The last validation loss at or before ``seconds`` from the job's start."""
    seen = [v for t, v in validations if t <= seconds]
    return seen[-1] if seen else None


def _spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    mean = statistics.fmean(values)
    return f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="2x2,3x3,2x1")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--modes", default="lockstep,deadline", help=f"of {', '.join(MODES)} (lockstep is always run)")
    p.add_argument("--config", default="diloco/muloco_2bit")
    add_job_options(p, timeout=900)
    args = p.parse_args()
    flavor, shape = "llama3-w128-d4-h2", ["--training.seq_len", "256", "--training.local_batch_size", "8"]
    if args.smoke:
        flavor, shape = "llama3-w64-d2-h2", ["--training.seq_len", "64", "--training.local_batch_size", "2"]
        args.steps, args.sync_every, args.cases, args.seeds = 8, 2, "2x2", 1
    cases = [parse_case(c) for c in args.cases.split(",")]
    modes = ["lockstep", *(m for m in args.modes.split(",") if m != "lockstep")]
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"--modes {','.join(unknown)}: not one of {', '.join(MODES)}")
    if args.steps % args.sync_every:
        p.error(f"--steps {args.steps} must be a multiple of --sync-every {args.sync_every}")
    h = args.sync_every
    root = Path(tempfile.mkdtemp(prefix="round_modes_"))
    print(
        f"machine load average at start: {loadavg()}; {args.config}, {flavor}, {args.steps} steps, H={h}, "
        f"{args.seeds} seed(s), cases {args.cases}",
        flush=True,
    )
    results: dict[tuple, dict] = {}
    try:
        for k, factor in cases:
            pace = SMOKE_PACE if args.smoke else None
            for seed in range(args.seeds):
                for mode in modes:
                    flags = MODES[mode]
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
                        "--validator.freq",
                        str(h),
                        "--validator.steps",
                        "4",
                        "--debug.seed",
                        str(seed),
                        *flags,
                    ]
                    if pace is None and factor > 1:  # the others' pace, from an equal lockstep job of the case
                        probe = run(root, f"{k}x{factor:g}-pace", args.config, k, overrides, args.timeout, None)
                        pace = probe["median_step"]
                    slow = (k - 1, (factor - 1) * pace) if factor > 1 else None
                    name = f"{k}x{factor:g}-{mode}-seed{seed}"
                    results[(k, factor, mode, seed)] = r = run(
                        root, name, args.config, k, overrides, args.timeout, slow
                    )
                    print(f"  {name}: {r['wall']:.1f} s, final loss {r['final']:.4f}, steps {r['steps']}", flush=True)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    report(results, cases, args.seeds, modes)
    print(f"machine load average at the end: {loadavg()}")
    return 0


def report(results: dict[tuple, dict], cases: list[tuple[int, float]], seeds: int, modes: list[str]) -> None:
    print(
        f"\n{'case':<6}{'mode':<15}{'seed':>5}{'wall s':>9}{'final loss':>12}{'job tok/s':>11}  {'steps per group':<22}"
        f"{'to lockstep loss s':>20}{'x lockstep':>12}{'loss then':>11}{'lockstep at its end':>21}"
    )
    for k, factor in cases:
        ratios, gaps = {m: [] for m in modes[1:]}, {m: [] for m in modes[1:]}
        for seed in range(seeds):
            base = results[(k, factor, "lockstep", seed)]
            base_end = base["validations"][-1][0]  # lockstep's final loss, from its first step
            for mode in modes:
                r = results[(k, factor, mode, seed)]
                reach = time_to(r["validations"], base["final"])
                ratio = reach / base_end if reach is not None else None
                at_end = loss_at(r["validations"], base_end)
                own_end = r["validations"][-1][0]  # equal wall-clock the other way: lockstep when this mode ended
                lockstep_then = loss_at(base["validations"], own_end)
                if mode != "lockstep":
                    ratios[mode] += [ratio] if ratio is not None else []
                    gaps[mode] += [r["final"] - base["final"]]
                print(
                    f"{k}x{factor:<4g}{mode:<15}{seed:>5}{r['wall']:>9.1f}{r['final']:>12.4f}"
                    f"{r['tokens'] / r['wall']:>11,.0f}  {','.join(map(str, r['steps'])):<22}"
                    f"{reach if reach is not None else float('nan'):>20.1f}"
                    f"{ratio if ratio is not None else float('nan'):>12.2f}"
                    f"{at_end if at_end is not None else float('nan'):>11.4f}"
                    f"{lockstep_then if lockstep_then is not None else float('nan'):>21.4f}"
                )
        target = (
            "<= 0.75x lockstep's wall-clock"
            if factor >= 2
            else "final loss no worse than lockstep (inside the seeds' spread)"
        )
        for mode in modes[1:]:
            print(
                f"{k}x{factor:g} {mode} / lockstep wall-clock to lockstep's final loss: {_spread(ratios[mode])} over "
                f"{len(ratios[mode])} of {seeds} seed(s) reaching it; final loss {mode} - lockstep: "
                f"{_spread(gaps[mode])}; target {target}"
            )


if __name__ == "__main__":
    sys.exit(main())
