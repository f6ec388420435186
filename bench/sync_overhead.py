"""Cost of DiLoCo's outer sync: its share of the training loop, its time by model size, and by part.

    .venv/bin/python bench/sync_overhead.py [--repeats 2] [--quick] [--smoke] [--part all|share|size|parts]
        [--timeout 300] [--keep]

Every run is a real job on this machine, started as users start one: the local launcher
(``muloco.launch.local``'s LocalJob, what ``jobs/local/diloco.sh`` runs) with K=2 replica
groups, each one torchrun with one rank, ``--threads 1`` (two single-threaded replicas on a
2-core machine), its lighthouse in the launcher with ``--min-replicas 2 --join-timeout-ms
20000`` so both groups are in every quorum (with a quorum of one, a replica that is up first
could form a quorum alone, and in a short run both may train and "sync" alone without ever
meeting), the dense fp32 all-reduce exchange over gloo, validation and TensorBoard off and no
checkpoint saved (``--checkpoint.load_only``). Figures come from what the trainer itself
records: ``replica_i/summary.json`` (its ``diloco`` entry) and the per-sync rows
(``sync/seconds``, ``sync/step``, ``sync/bytes_sent``) of ``replica_i/metrics.jsonl``.

Part 1 (sync share): the tiny model (llama3-w128-d4-h2, ~1.3M parameters, seq 256,
batch 8 from config/base.py), 120 steps, H=30 (4 syncs), ``--repeats`` times. Per
replica: the wall time of the training loop, the total sync time, the share sync /
loop, mean and max ms per sync and bytes per sync. The loop's wall time is taken from
the replica's own log, from "Training starts" to torchtitan's post-loop "Sleeping 2
seconds" line; the trainer's ``wall_seconds`` (and its ``sync_share_of_wall_time``)
also counts that fixed 2 s sleep, so it is printed alongside but is not the headline.
The first sync of a run includes setting up the cross-replica process group and
absorbs the replicas' start-up skew (the first replica up waits for the other), so
mean, median and share are printed with and without it, and so is the share of the
sync itself: per sync the time of the replica that arrived last, over the loop. The headline is the share of
the worse replica of each run (the one that waited more for its peer; which one that
is changes from run to run), median over the repeats; the target is <= 3% at H=30.

Part 2 (sync time by model size): ~1.3M, ~5.9M and ~21M parameters
(llama3-w128-d4-h2, llama3-w256-d6-h4, llama3-w512-d6-h4, default vocabulary),
short runs (20 steps, H=5, seq 64, batch 2), the sizes alternating small, medium,
large, small, ... over the repeats. Per size: the median ms per sync over the syncs
after the first (both replicas, all repeats), the first sync on its own, parameters,
bytes per sync and bytes per second of sync time; then what a dense fp32 all-reduce
every step would have sent in the same run (``per_step_fp32_allreduce_bytes``)
against what DiLoCo sent.

Part 3 (sync time by part): the same sizes (on CUDA: the 158M shape
``llama3-w1024-d12-h8_qk_torch-rmsnorm_pa_pf`` with the embedded vocabulary, seq 2048), each
with the dense fp32 exchange (``diloco/diloco``) and the 2-bit one with error feedback
(``diloco/diloco_2bit``, MuLoCo's exchange with AdamW inside): the median per part of each sync's blocked time, as the
trainer
records it (quorum, waiting for the slowest, Δ, encode, collective, decode/average, commit,
outer step, pull, other; each sync's parts add up to its time), and the largest peak of a
sync's own buffers.

What a "sync" time contains: the time the replica is blocked in the outer loop, i.e.
the quorum (including waiting for the slower replica to arrive), Δ = θ_g − θ, the
all-reduce, the commit vote, the outer Nesterov step and copying θ_g back. The
replica that arrives last at a sync barely waits, so the per-sync minimum over the
two replicas ("last to arrive") is also printed as the closest figure to the sync's
own cost; the per-replica figures include straggler waiting, which is part of what
DiLoCo costs a real run.

``--smoke`` (what CI runs) takes every part through its code at the smallest size:
``llama3-w64-d2-h2``, seq 64, batch 2, 4 steps, H=2 (two syncs: the first, and one to
take figures from), one size, one repeat, and part 3 with the dense exchange only (the
2-bit job is bench/gpu_throughput.py's smoke). Parts that ask for the same job share it
(``shared_job``), so the smoke starts one job.

Each job runs under a hang timeout (``--timeout``, then the launcher stops it and tears every
process down, as on Ctrl-C); outputs go to a temporary folder removed at the end
(``--keep`` leaves it). The machine's load average, and each replica group's CPU seconds
per wall second in its training loop outside syncs (its processes, read from /proc while it runs; about 1.0
when the replica has a core to itself, lower when other work takes CPU from it), say
whether other work disturbed the figures; runs under 0.85 are named at the end.
Nothing here asserts on timing.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

from local_run import run_local_job  # bench/ is on sys.path when a bench script runs
from machine import exit_on_sigterm, loadavg

from muloco.launch.local import LocalJob
from muloco.outer.exchange.pipeline import PARTS

K = 2
TARGET_SHARE = 0.03
TINY = "llama3-w128-d4-h2"
SIZES = ("llama3-w128-d4-h2", "llama3-w256-d6-h4", "llama3-w512-d6-h4")
_LOG_TIME = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")

# ------------------------------------------------------------------- processes


_TICK = os.sysconf("SC_CLK_TCK")


def _tree_cpu_seconds(root: int) -> float | None:
    """utime + stime of ``root`` and its live descendants (a replica group: its torchrun agent,
    rank process and trainer), from /proc; None once the root is gone."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # from the 3rd field on: state, ppid, ...
        stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK)  # ppid, utime + stime
    if root not in stats:
        return None
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, (ppid, _) in stats.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(stats[pid][1] for pid in tree)


class CpuSampler(threading.Thread):
    """Every ~50 ms, (epoch seconds, CPU seconds) of each replica group's processes, so the CPU
    time of any window (the training loop) can be read off."""

    def __init__(self, job: LocalJob):
        super().__init__(daemon=True, name="cpu-sampler")
        self.job, self.samples = job, {i: [] for i in range(job.replicas)}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.job.started.wait(0.05):  # a job that fails to start sets done instead
            if self.done.is_set():
                return
        while not self.done.wait(0.05):
            for i, agent in enumerate(self.job.pids[: self.job.replicas]):
                cpu = _tree_cpu_seconds(agent)
                if cpu is not None:
                    self.samples[i].append((time.time(), cpu))


def _cpu_at(samples: list[tuple[float, float]], t: float) -> float | None:
    """CPU seconds at epoch ``t``, interpolated between the samples around it."""
    for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
        if t0 <= t <= t1:
            return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
    return None


# ---------------------------------------------------------------------------- job


def _log_time(line: str) -> float | None:
    m = _LOG_TIME.search(line)
    if not m:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _loop_window(log: Path) -> tuple[float, float] | None:
    """Epoch times of "Training starts" and torchtitan's post-loop "Sleeping 2 seconds"."""
    start = end = None
    for line in log.read_text(errors="replace").splitlines():
        if start is None and "Training starts at step" in line:
            start = _log_time(line)
        elif "Sleeping 2 seconds for other ranks" in line:
            end = _log_time(line)
    return (start, end) if start is not None and end is not None else None


_SHARED_JOBS: dict[tuple, dict] = {}


def shared_job(args, root: Path, name: str, flavor: str, overrides: list[str], config: str = "diloco/diloco") -> dict:
    """``run_job``; under ``--smoke`` a job the same as one already run (config, flavor,
    overrides) is that job, so parts with the same settings share one start-up."""
    key = (config, flavor, tuple(overrides))
    if args.smoke and key in _SHARED_JOBS:
        print(f"  (smoke: {name} is the job {_SHARED_JOBS[key]['name']}, same settings)", flush=True)
        return _SHARED_JOBS[key]
    job = run_job(root, name, flavor, overrides, args.timeout, config=config)
    _SHARED_JOBS[key] = job
    return job


def run_job(
    root: Path, name: str, flavor: str, overrides: list[str], timeout: float, config: str = "diloco/diloco"
) -> dict:
    """One local job (the launcher users run: a lighthouse and K replica groups, one torchrun
    each) to completion; what each replica recorded, and its CPU use in the training loop."""
    samplers: list[CpuSampler] = []

    def sample_cpu(job: LocalJob):
        samplers.append(CpuSampler(job))
        samplers[0].start()
        return samplers[0].done.set

    job = run_local_job(root / name, config, K, ["--model.flavor", flavor, *overrides], timeout, watch=sample_cpu)
    sampler, logs = samplers[0], job.logs
    replica_logs = [logs / f"replica_{i}.log" for i in range(K)]
    out = {"name": name, "flavor": flavor, "job_wall_s": job.wall_s, "replicas": []}
    for i in range(K):
        summary, rows = job.replicas[i]["summary"], job.replicas[i]["rows"]
        syncs = [
            {
                "step": r["sync/step"],
                "seconds": r["sync/seconds"],
                "bytes_sent": r["sync/bytes_sent"],
                "committed": r["sync/committed"],
                "participants": r["sync/participants"],
                "contributors": r["sync/contributors"],
                "peak_extra_bytes": r.get("sync/peak_extra_bytes", 0),
                "parts": {part: r.get(f"sync/time_{part}", 0.0) for part in PARTS},
            }
            for r in rows
            if "sync/step" in r
        ]
        syncs.sort(key=lambda s: s["step"])
        window = _loop_window(replica_logs[i])
        loop_cpu = None
        if window is not None:
            c0, c1 = (_cpu_at(sampler.samples[i], t) for t in window)
            # Outside syncs: a replica blocked in a sync (waiting for its peer) is not short of CPU.
            busy = window[1] - window[0] - summary["diloco"]["sync_seconds_total"]
            if c0 is not None and c1 is not None and busy > 0:
                loop_cpu = (c1 - c0) / busy
        out["replicas"].append(
            {
                "replica": i,
                "summary": summary,
                "diloco": summary["diloco"],
                "syncs": syncs,
                "loop_s": window[1] - window[0] if window is not None else None,
                "loop_cpu_per_wall": loop_cpu,
            }
        )
    return out


# ------------------------------------------------------------------------ figures


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _ms(s: float) -> str:
    return f"{1000 * s:,.1f}" if s == s else "n/a"


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%" if x == x else "n/a"


def _fmt_params(n: int) -> str:
    return f"{n / 1e6:.1f}M"


_BAD_SYNCS: list[str] = []


def _check_syncs(job: dict) -> list[str]:
    """Notes for syncs that did not have both replicas or did not commit."""
    notes = []
    for r in job["replicas"]:
        for s in r["syncs"]:
            if not s["committed"] or s["participants"] != K or s["contributors"] != K:
                notes.append(
                    f"{job['name']} replica {r['replica']} sync at step {s['step']}: committed={s['committed']} "
                    f"participants={s['participants']} contributors={s['contributors']}"
                )
    _BAD_SYNCS.extend(n for n in notes if n not in _BAD_SYNCS)  # a shared job is checked once per part
    return notes


def _replica_figures(r: dict) -> dict:
    d = r["diloco"]
    secs = [s["seconds"] for s in r["syncs"]]
    rest = secs[1:]
    loop = r["loop_s"] or float("nan")
    total = d["sync_seconds_total"]
    return {
        "loop_s": loop,
        "wall_s": r["summary"]["wall_seconds"],
        "sync_s": total,
        "share": total / loop,
        "share_rest": sum(rest) / loop,
        "share_trainer": d["sync_share_of_wall_time"],
        "syncs": d["syncs"],
        "committed": d["syncs_committed"],
        "mean": d["sync_seconds_mean"],
        "mean_rest": _mean(rest),
        "median": _med(secs),
        "median_rest": _med(rest),
        "max": max(secs) if secs else float("nan"),
        "max_rest": max(rest) if rest else float("nan"),
        "first": secs[0] if secs else float("nan"),
        "bytes_per_sync": d["bytes_sent"] / d["syncs"] if d["syncs"] else float("nan"),
        "step_s": (loop - total) / r["summary"]["steps"],
    }


def _cpu_per_wall(job: dict) -> str:
    """Each replica's CPU seconds per wall second of its training loop outside syncs: about
    1.0 when it had a core to itself (one torch thread), lower when other processes took
    CPU from it."""
    return "/".join(
        f"{r['loop_cpu_per_wall']:.2f}" if r["loop_cpu_per_wall"] is not None else "n/a" for r in job["replicas"]
    )


_DISTURBED: list[str] = []
DISTURBED_BELOW = 0.85  # a replica's loop CPU/wall under this: other processes took part of its core


def _note_disturbance(job: dict) -> None:
    note = f"{job['name']} ({_cpu_per_wall(job)})"
    if note not in _DISTURBED and any(
        r["loop_cpu_per_wall"] is not None and r["loop_cpu_per_wall"] < DISTURBED_BELOW for r in job["replicas"]
    ):
        _DISTURBED.append(note)


def _last_to_arrive(job: dict, skip_first: bool = True) -> list[float]:
    """Per sync step, the smaller of the replicas' times (the one that waited least)."""
    by_step: dict[int, list[float]] = {}
    for r in job["replicas"]:
        for s in r["syncs"]:
            by_step.setdefault(s["step"], []).append(s["seconds"])
    steps = sorted(by_step)[1 if skip_first else 0 :]
    return [min(by_step[s]) for s in steps if len(by_step[s]) == K]


def part_share(args, root: Path) -> dict:
    steps, h = args.share_steps, args.share_every
    overrides = ["--training.steps", str(steps), "--outer.sync_every", str(h), *args.share_shape]
    shape = shlex.join(args.share_shape) or "seq 256, batch 8 from config/base.py"
    print(
        f"\n== Part 1: sync share, K={K}, {args.share_flavor} ({shape}), {steps} steps, H={h}, "
        f"{args.repeats} repeat(s) ==",
        flush=True,
    )
    jobs = []
    for rep in range(args.repeats):
        job = shared_job(args, root, f"share-{rep}", args.share_flavor, overrides)
        jobs.append(job)
        _note_disturbance(job)
        print(
            f"  run {rep + 1}: job {job['job_wall_s']:.1f}s, CPU/wall per replica (loop outside syncs) "
            f"{_cpu_per_wall(job)} "
            f"(1.00 = a core of its own), load avg {loadavg()}",
            flush=True,
        )

    params = jobs[0]["replicas"][0]["diloco"]["outer_parameters"]
    print(
        f"\n  outer parameters {params:,}; per replica and run "
        "(ms per sync; 'w/o 1st' leaves out the first sync, which sets up the process group "
        "and absorbs the replicas' start-up skew):"
    )
    hdr = (
        f"  {'run':>3} {'rep':>3} {'loop s':>7} {'wall s':>7} {'sync s':>7} {'share':>7} "
        f"{'w/o 1st':>7} {'trainer':>7} {'syncs':>5} {'1st ms':>8} {'mean ms':>8} {'w/o 1st':>8} "
        f"{'med ms':>8} {'w/o 1st':>8} {'max ms':>8} {'w/o 1st':>8} {'MB/sync':>8} {'ms/step':>8}"
    )
    print(hdr)
    per_replica: dict[int, list[dict]] = {i: [] for i in range(K)}
    for rep, job in enumerate(jobs):
        for r in job["replicas"]:
            f = _replica_figures(r)
            per_replica[r["replica"]].append(f)
            print(
                f"  {rep + 1:>3} {r['replica']:>3} {f['loop_s']:>7.1f} {f['wall_s']:>7.1f} {f['sync_s']:>7.2f} "
                f"{_pct(f['share']):>7} {_pct(f['share_rest']):>7} {_pct(f['share_trainer']):>7} "
                f"{f['committed']:>2}/{f['syncs']:<2} {_ms(f['first']):>8} {_ms(f['mean']):>8} "
                f"{_ms(f['mean_rest']):>8} {_ms(f['median']):>8} {_ms(f['median_rest']):>8} "
                f"{_ms(f['max']):>8} {_ms(f['max_rest']):>8} {f['bytes_per_sync'] / 1e6:>8.2f} {_ms(f['step_s']):>8}"
            )
    print(
        "  loop s: training loop per the replica's log; wall s: the trainer's wall_seconds (loop + "
        "torchtitan's 2 s post-loop sleep); share = sync s / loop s; trainer = its own "
        "sync_share_of_wall_time (over wall s);\n  ms/step: (loop s - sync s) / steps, "
        "the replica's own pace (the faster replica waits for the slower one at every sync)"
    )

    med = {i: {k: _med([f[k] for f in fs]) for k in fs[0]} for i, fs in per_replica.items()}
    print(f"\n  median over {args.repeats} run(s):")
    for i in range(K):
        m = med[i]
        print(
            f"    replica {i}: loop {m['loop_s']:.1f}s, sync {m['sync_s']:.2f}s, share {_pct(m['share'])} "
            f"(w/o 1st sync {_pct(m['share_rest'])}), per sync mean {_ms(m['mean'])} ms "
            f"(w/o 1st {_ms(m['mean_rest'])}), median {_ms(m['median'])} ms (w/o 1st {_ms(m['median_rest'])}), "
            f"max {_ms(m['max'])} ms (w/o 1st {_ms(m['max_rest'])}), 1st {_ms(m['first'])} ms, "
            f"{m['bytes_per_sync'] / 1e6:.2f} MB sent per sync"
        )
    last = [x for job in jobs for x in _last_to_arrive(job)]
    first_last = [_last_to_arrive(job, skip_first=False)[0] for job in jobs]
    no_wait = _med(
        [sum(_last_to_arrive(job, skip_first=False)) / _med([r["loop_s"] for r in job["replicas"]]) for job in jobs]
    )
    print(
        f"    last to arrive (per sync the smaller replica's time, the one that waited least): "
        f"w/o 1st median {_ms(_med(last))} ms over {len(last)} sync(s); 1st sync median "
        f"{_ms(_med(first_last))} ms (so most of a long 1st sync is waiting for the peer to start up)"
    )
    print(
        f"    share without waiting for the peer (those last-to-arrive times, all syncs, / loop): "
        f"{_pct(no_wait)}; the rest of a replica's share is waiting for the slower replica"
    )
    notes = [n for job in jobs for n in _check_syncs(job)]
    for n in notes:
        print(f"  note: {n}")
    return {
        "params": params,
        "h": h,
        "no_wait": no_wait,
        # per run the worse replica (which one waits more changes from run to run), median over runs
        "share": _med([max(f["share"] for f in run) for run in zip(*per_replica.values())]),
        "share_rest": _med([max(f["share_rest"] for f in run) for run in zip(*per_replica.values())]),
        "per_replica": {i: med[i] for i in range(K)},
        "notes": notes,
    }


def part_size(args, root: Path) -> dict:
    steps, h = args.size_steps, args.size_every
    overrides = [
        "--training.steps",
        str(steps),
        "--outer.sync_every",
        str(h),
        *SMALL_SHAPE,
        "--lr_scheduler.warmup_steps",
        str(min(5, steps)),
    ]
    print(
        f"\n== Part 2: sync time by model size, K={K}, {steps} steps, H={h}, seq 64, batch 2, "
        f"{args.repeats} repeat(s), sizes alternating ==",
        flush=True,
    )
    jobs: dict[str, list[dict]] = {f: [] for f in args.sizes}
    for rep in range(args.repeats):
        for flavor in args.sizes:
            job = shared_job(args, root, f"size-{flavor}-{rep}", flavor, overrides)
            jobs[flavor].append(job)
            _note_disturbance(job)
            secs = [s["seconds"] for r in job["replicas"] for s in r["syncs"][1:]]
            print(
                f"  run {rep + 1} {flavor:<20} job {job['job_wall_s']:5.1f}s, per sync (w/o 1st) median "
                f"{_ms(_med(secs))} ms, loop CPU/wall {_cpu_per_wall(job)}, load avg {loadavg()}",
                flush=True,
            )

    print(
        f"\n  {'flavor':<20} {'params':>11} {'MB/sync':>8} {'n':>5} {'1st ms':>8} {'med ms':>8} "
        f"{'min ms':>8} {'max ms':>8} {'last ms':>8} {'MB/s':>7} {'last MB/s':>9}"
    )
    rows = {}
    notes = []
    for flavor in args.sizes:
        js = jobs[flavor]
        reps = [r for j in js for r in j["replicas"]]
        d = reps[0]["diloco"]
        params = d["outer_parameters"]
        bytes_per_sync = d["bytes_sent"] / d["syncs"]
        rest = [s["seconds"] for r in reps for s in r["syncs"][1:]]
        first = [r["syncs"][0]["seconds"] for r in reps if r["syncs"]]
        last = [x for j in js for x in _last_to_arrive(j)]
        med, lmed = _med(rest), _med(last)
        rows[flavor] = {
            "params": params,
            "bytes_per_sync": bytes_per_sync,
            "median_s": med,
            "last_s": lmed,
            "per_step_bytes": _med([r["diloco"]["per_step_fp32_allreduce_bytes"] for r in reps]),
            "sent_bytes": _med([r["diloco"]["bytes_sent"] for r in reps]),
            "steps": reps[0]["summary"]["steps"],
            "loop_s": _med([r["loop_s"] for r in reps]),
            "sync_total_s": _med([r["diloco"]["sync_seconds_total"] for r in reps]),
        }
        print(
            f"  {flavor:<20} {params:>11,} {bytes_per_sync / 1e6:>8.2f} {len(rest):>5} {_ms(_med(first)):>8} "
            f"{_ms(med):>8} {_ms(min(rest)):>8} {_ms(max(rest)):>8} {_ms(lmed):>8} "
            f"{bytes_per_sync / 1e6 / med:>7.0f} {bytes_per_sync / 1e6 / lmed:>9.0f}"
        )
        notes += [n for j in js for n in _check_syncs(j)]
    print(
        "  n: per-sync times after each replica's first (both replicas, all runs); 1st: median of "
        "first syncs (process-group setup and start-up skew);\n  med/min/max: over those syncs; "
        "last: per sync the smaller "
        "replica's time (the one that arrived last, least straggler wait);\n  MB/s: bytes sent per sync / "
        "sync time (an effective rate: the sync also takes the quorum, Δ, commit vote, outer step)"
    )

    print(
        f"\n  dense fp32 all-reduce every step vs DiLoCo, same run ({rows[args.sizes[0]]['steps']} steps, "
        f"H={h}), per replica:"
    )
    print(
        f"  {'flavor':<20} {'per-step MB':>11} {'DiLoCo MB':>9} {'ratio':>6} {'est. per-step s':>15} "
        f"{'DiLoCo sync s':>13} {'loop s':>7}"
    )
    for flavor in args.sizes:
        r = rows[flavor]
        est = r["steps"] * r["median_s"]
        print(
            f"  {flavor:<20} {r['per_step_bytes'] / 1e6:>11.1f} {r['sent_bytes'] / 1e6:>9.1f} "
            f"{r['per_step_bytes'] / r['sent_bytes']:>5.1f}x {est:>15.2f} {r['sync_total_s']:>13.2f} "
            f"{r['loop_s']:>7.1f}"
        )
    print(
        "  per-step MB: the summary's per_step_fp32_allreduce_bytes (steps x params x 4); est. per-step s: "
        "steps x the median sync time\n  (a rough upper estimate: each step's all-reduce moves the same "
        "bytes as one DiLoCo sync)"
    )
    for n in notes:
        print(f"  note: {n}")
    return rows


BREAKDOWN_CONFIGS = ("diloco/diloco", "diloco/diloco_2bit")
"""Dense fp32 and 2-bit exchanges; AdamW inside (the sync does not depend on the inner
optimizer, and Muon's bf16 Newton–Schulz crawls on CPUs without bf16 matrix units)."""
CUDA_SIZES = ("llama3-w1024-d12-h8_qk_torch-rmsnorm_pa_pf",)


def sync_parts(replicas: list[dict]) -> dict:
    """The replicas' syncs after each one's first, by part: the median of each part, of the
    total, and the largest peak of a sync's own buffers (shared with gpu_throughput.py)."""
    syncs = [s for r in replicas for s in r["syncs"][1:]]
    return {
        "params": replicas[0]["diloco"]["outer_parameters"],
        "n": len(syncs),
        "parts": {part: _med([s["parts"][part] for s in syncs]) for part in PARTS},
        "seconds": _med([s["seconds"] for s in syncs]),
        "peak": max((s["peak_extra_bytes"] for s in syncs), default=0),
    }


def print_parts_table(rows: dict[str, dict]) -> None:
    """One line per ``sync_parts`` result: ms per part, their sum, the peak."""
    width = max(18, *(len(label) for label in rows))
    head = "".join(f"{p[:10]:>11}" for p in PARTS)
    print(
        f"\n  ms per sync, median over the syncs after each replica's first:\n  {'':<{width}} {'params':>7} "
        f"{'total':>8}{head} {'sum':>8} {'peak MB':>8}"
    )
    for label, r in rows.items():
        cells = "".join(f"{1000 * r['parts'][p]:>11.1f}" for p in PARTS)
        print(
            f"  {label:<{width}} {_fmt_params(r['params']):>7} {1000 * r['seconds']:>8.1f}{cells} "
            f"{1000 * sum(r['parts'].values()):>8.1f} {r['peak'] / 1e6:>8.2f}"
        )
    print(
        "  each sync's parts add up to its total (medians of parts need not add up to the median total);"
        " wait_slowest: the part of the quorum spent waiting for the other replica (allgather and"
        " reduce-scatter carry each replica's quorum time; a dense all-reduce cannot tell it apart);"
        " peak MB: the largest peak of a sync's own buffers"
    )


def part_breakdown(args, root: Path) -> dict:
    """Part 3: each sync's blocked time split into its parts (the trainer's own sync records:
    quorum, waiting for the slowest, Δ, encode, collective, decode/average, commit, outer
    step, pull, other), median per part over the syncs after the first, by model size, for
    the dense fp32 exchange and MuLoCo's 2-bit one."""
    cuda = _cuda_available()
    sizes = CUDA_SIZES if cuda else args.sizes
    steps, h = args.size_steps, args.size_every
    shape = ["--training.seq_len", "2048", "--training.local_batch_size", "4"] if cuda else SMALL_SHAPE
    overrides = [
        "--training.steps",
        str(steps),
        "--outer.sync_every",
        str(h),
        *shape,
        "--lr_scheduler.warmup_steps",
        str(min(5, steps)),
    ]
    print(
        f"\n== Part 3: sync time by part, K={K}, {steps} steps, H={h}, {'CUDA' if cuda else 'CPU'}, "
        f"{args.repeats} repeat(s) ==",
        flush=True,
    )
    rows = {}
    configs = BREAKDOWN_CONFIGS[:1] if args.smoke else BREAKDOWN_CONFIGS
    if args.smoke:
        print(
            f"  (smoke: {', '.join(BREAKDOWN_CONFIGS[1:])} left out: one more job; bench/gpu_throughput.py "
            "--smoke runs a 2-bit job)"
        )
    for config in configs:
        for flavor in sizes:
            reps = []
            for rep in range(args.repeats):
                job = shared_job(
                    args, root, f"parts-{config.replace('/', '-')}-{flavor}-{rep}", flavor, overrides, config=config
                )
                _note_disturbance(job)
                _check_syncs(job)
                reps.extend(job["replicas"])
            rows[f"{config} {flavor}" if len(sizes) > 1 else config] = sync_parts(reps)
            print(f"  {config:<18} {flavor:<22} done, load avg {loadavg()}", flush=True)
    print_parts_table(rows)
    return rows


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# --------------------------------------------------------------------------- main


SMALL_SHAPE = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
SMOKE_FLAVOR = "llama3-w64-d2-h2"


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=None, help="runs per configuration (default 2; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="a shorter measurement: fewer steps, 1 repeat")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="every part at the smallest size (4 steps, H=2, one size, 1 repeat): checks the bench runs",
    )
    p.add_argument("--part", choices=("all", "share", "size", "parts"), default="all", help="which part(s) to run")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job before it counts as hung")
    p.add_argument("--keep", action="store_true", help="keep the temporary output folder")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick or args.smoke else 2
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    # Part 1: H=30 either way; the quick run has 3 syncs instead of 4.
    args.share_flavor, args.share_shape = TINY, []
    args.share_every = 30
    args.share_steps = 90 if args.quick else 120
    # Part 2: short runs; the quick run has 3 syncs instead of 4.
    args.sizes = SIZES
    args.size_every = 5
    args.size_steps = 15 if args.quick else 20
    if args.smoke:  # the same job settings in every part, so the parts share jobs (shared_job)
        args.share_every = args.size_every = 2
        args.share_steps = args.size_steps = 4
        args.share_flavor, args.sizes = SMOKE_FLAVOR, (SMOKE_FLAVOR,)
        args.share_shape = [*SMALL_SHAPE, "--lr_scheduler.warmup_steps", str(min(5, args.size_steps))]
    return args


def main(argv=None) -> int:
    exit_on_sigterm()  # a time limit's SIGTERM still runs the finally that stops the jobs
    args = _parse(argv)
    t0 = time.perf_counter()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"machine: {os.cpu_count()} CPU cores ({len(os.sched_getaffinity(0))} usable), "
        f"load average before: {loadavg()}; python {sys.version.split()[0]}"
    )
    print(
        f"each job: python -m muloco.launch.local, {K} replica groups (one torchrun, one rank, 1 thread each; gloo; "
        "parts 1-2: dense fp32 all-reduce), no checkpoint saves, validation/TensorBoard off",
        flush=True,
    )
    root = Path(tempfile.mkdtemp(prefix="muloco-sync-bench-"))
    share = sizes = None
    try:
        if args.part in ("all", "share"):
            share = part_share(args, root)
        if args.part in ("all", "size"):
            sizes = part_size(args, root)
        if args.part in ("all", "parts"):
            part_breakdown(args, root)
    except RuntimeError as err:  # a job failed or hung: its log tails are in the message
        print(f"\nbench failed: {err}", flush=True)
        return 1
    finally:
        if args.keep:
            print(f"outputs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    print("\n== summary ==")
    if share is not None:
        per = ", ".join(
            f"replica {i}: {_pct(m['share'])} ({m['sync_s']:.2f}s of {m['loop_s']:.1f}s, "
            f"w/o 1st sync {_pct(m['share_rest'])})"
            for i, m in share["per_replica"].items()
        )
        verdict = "within" if share["share"] <= TARGET_SHARE else "ABOVE"
        verdict_rest = "within" if share["share_rest"] <= TARGET_SHARE else "ABOVE"
        print(
            f"sync share at H={share['h']}, K={K}, tiny ({_fmt_params(share['params'])}): "
            f"{_pct(share['share'])} with the 1st sync ({verdict} target <= {TARGET_SHARE:.0%}), "
            f"{_pct(share['share_rest'])} without it ({verdict_rest}); the worse replica of each run, median "
            f"over {args.repeats} run(s)  [per replica, median over runs: {per}]"
        )
        print(f"  of which the sync itself (no waiting for the slower peer): {_pct(share['no_wait'])}")
    if sizes is not None:
        by = ", ".join(f"{_fmt_params(r['params'])}: {_ms(r['median_s'])} ms" for r in sizes.values())
        last = ", ".join(f"{_fmt_params(r['params'])}: {_ms(r['last_s'])} ms" for r in sizes.values())
        rate = ", ".join(
            f"{_fmt_params(r['params'])}: {r['bytes_per_sync'] / 1e6 / r['median_s']:.0f} MB/s" for r in sizes.values()
        )
        print(f"sync time by model size (K={K}, fp32 dense all-reduce, median after the 1st sync): {by}")
        print(f"  last to arrive (least straggler wait): {last}; effective rate: {rate}")
        big = sizes[args.sizes[-1]]
        print(
            f"  a per-step fp32 all-reduce would have sent {big['per_step_bytes'] / big['sent_bytes']:.1f}x "
            f"DiLoCo's bytes (H={args.size_every}; the ratio is about H)"
        )
    if _BAD_SYNCS:
        print(
            f"WARNING: {len(_BAD_SYNCS)} sync(s) did not have all {K} replicas (their times are not "
            f"those of a {K}-replica sync): {'; '.join(_BAD_SYNCS[:4])}"
        )
    if _DISTURBED:
        print(
            f"note: a replica got under {DISTURBED_BELOW} CPU seconds per wall second in its training loop "
            "(outside syncs) "
            f"in {', '.join(_DISTURBED)}: other processes competed for the CPU, so those timings are "
            "disturbed (slower steps, and more waiting for the slower replica at syncs)"
        )
    print(f"load average after: {loadavg()}; total bench time {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
