"""Partition drills: replica groups on hosts of their own (``muloco.launch.local --netns``), a link
cut or a lighthouse blocked while the job runs, and what it cost.

    .venv/bin/python bench/partition_drills.py [--drills NAME,...] [--steps 60] [--sync-every 10]
        [--smoke] [--timeout 900] [--keep]

Each drill is one real job (the launcher users run, every group and the lighthouse in a network
namespace of its own, ``muloco/launch/netns.py``) of the tiny model (``llama3-w128-d4-h2``, seq 256,
batch 8). When the victim group's log shows inner step H + H/2 (mid-round; or the step before its last, for the
drills of the final sync), its fault starts:
``cut`` sets its link down (it reaches nobody), ``lighthouse`` blocks it and the lighthouse from each
other (its peers still reach both); ``seconds`` later the fault ends. A group that gives up (exit 4
after ``--fault_tolerance.lighthouse_lost_seconds``, 30 s) is restarted by the launcher
(``--max-restarts 3``) and heals. The heal drills (``being-healed``, ``serving-a-heal``, on 20 Mbit/s
links) cut the victim for 15 s, then, when it heals back, cut it again while it downloads its
peer's state, or cut the peer serving it (``Drill.at``). Printed per drill:

- agreement: every group's final θ_g has the same SHA-256;
- syncs committed / rolled back / missed, per group (missed: committed by the others without it);
- steps trained twice: inner steps a group's metrics record more than once;
- recover s: from the fault's end to the victim's next committed sync or heal (its log's stamps);
- wall s of the whole job.

Needs root and iproute2 (else it says why and exits 0 with no table). ``--smoke`` (what CI runs):
one drill, ``llama3-w64-d2-h2``, 10 steps, H=5, a 3 s cut. Outputs go to a temporary folder removed at the end
(``--keep`` leaves it). Nothing here asserts on timing.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from local_run import add_job_options, run_local_job  # bench/ is on sys.path when a bench script runs
from machine import exit_on_sigterm, loadavg

from muloco.launch.netns import unavailable


@dataclass(frozen=True)
class Drill:
    name: str
    replicas: int
    fault: str  # cut | lighthouse
    seconds: float
    mode: str = "lockstep"
    extra: tuple[str, ...] = ()
    at: str = "mid"
    """``mid``: the fault starts at the victim's step H + H/2 (mid-round); ``final``: at the step before
    its last, so it lands in the final sync whatever the speed (at the last step's line the final
    sync may already be over); ``healed`` and ``serving``: the victim is first cut off for
    15 s mid-round (its peers commit without it), and when it heals back the second fault cuts it
    while it downloads its peer's state (``healed``) or cuts the peer serving it (``serving``), for
    ``seconds``. These run on ``--link`` links (20 Mbit/s) so a heal takes a few seconds."""
    link: str = ""


DRILLS = [
    Drill("k2-cut-15s", 2, "cut", 15),
    Drill("k2-cut-60s", 2, "cut", 60),
    Drill("k3-cut-15s", 3, "cut", 15),
    Drill("k3-cut-60s", 3, "cut", 60),
    Drill("k3-lighthouse-15s", 3, "lighthouse", 15),
    Drill(
        "k3-lighthouse-50s-quorum-40s", 3, "lighthouse", 50, extra=("--fault_tolerance.quorum_timeout_seconds", "40")
    ),
    Drill("k2-cut-15s-deadline", 2, "cut", 15, "deadline"),
    Drill("k3-cut-15s-deadline", 3, "cut", 15, "deadline"),
    Drill("k3-cut-15s-final-sync", 3, "cut", 15, at="final"),
    Drill(
        "k2-lighthouse-50s-quorum-40s", 2, "lighthouse", 50, extra=("--fault_tolerance.quorum_timeout_seconds", "40")
    ),
    Drill("k3-cut-15s-being-healed", 3, "cut", 15, at="healed", link="20mbit"),
    Drill("k3-cut-15s-serving-a-heal", 3, "cut", 15, at="serving", link="20mbit"),
    Drill("k3-cut-60s-being-healed", 3, "cut", 60, at="healed", link="20mbit"),
    Drill("k3-cut-60s-serving-a-heal", 3, "cut", 60, at="serving", link="20mbit"),
    # the heal of a restart over 20 Mbit/s takes ~11 s: past the default 10 s collective timeout
    Drill(
        "k3-cut-60s-being-healed-pg-30s",
        3,
        "cut",
        60,
        at="healed",
        link="20mbit",
        extra=("--fault_tolerance.process_group_timeout_ms", "30000"),
    ),
]
SMOKE = Drill("k2-cut-3s", 2, "cut", 3)
SHAPE = ["--model.flavor", "llama3-w128-d4-h2", "--training.seq_len", "256", "--training.local_batch_size", "8"]
SMOKE_SHAPE = ["--model.flavor", "llama3-w64-d2-h2", "--training.seq_len", "64", "--training.local_batch_size", "2"]
_STEP = re.compile(r"step +(\d+)/")
_HEAL_STARTS = {"healed": "healing: downloading a peer's state", "serving": "serving this group's state"}
_EVENT = re.compile(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*(sync at step \d+ .*: committed|healed from)")


def fault_thread(drill: Drill, at_step: int, said: dict):
    """What ``run_local_job`` starts beside the job: wait until the victim trained ``at_step``, start
    the fault, end it ``drill.seconds`` later (``said`` gets when it ended)."""
    victim = f"r{drill.replicas - 1}"

    def watch(job):
        stop = threading.Event()

        def run() -> None:
            log = Path(job.resolved_log_dir) / f"replica_{drill.replicas - 1}.log"
            while not stop.is_set():
                text = log.read_text(errors="replace") if log.exists() else ""
                if any(int(m.group(1)) >= at_step for m in _STEP.finditer(text)):
                    break
                time.sleep(0.02)
            if stop.is_set():
                return
            tb = job.testbed
            tb.cut(victim) if drill.fault == "cut" else tb.block("lighthouse", victim)
            said["started"] = datetime.now()
            stop.wait(min(drill.seconds, 15.0) if drill.at in _HEAL_STARTS else drill.seconds)
            tb.restore(victim) if drill.fault == "cut" else tb.unblock("lighthouse", victim)
            said["ended"] = datetime.now()
            if drill.at in _HEAL_STARTS:
                _cut_at_the_heal(job, drill, stop, said)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return lambda: (stop.set(), thread.join(30))

    return watch


def _cut_at_the_heal(job, drill: Drill, stop: threading.Event, said: dict) -> None:
    """The second fault of a heal drill: once a log says the heal began (the victim's when it downloads,
    any group's when it serves), cut that group for ``drill.seconds``."""
    logs = Path(job.resolved_log_dir)
    hosts = [f"r{drill.replicas - 1}"] if drill.at == "healed" else [f"r{i}" for i in range(drill.replicas - 1)]
    marker = _HEAL_STARTS[drill.at]
    while not stop.is_set():
        for host in hosts:
            log = logs / f"replica_{host[1:]}.log"
            if log.exists() and marker in log.read_text(errors="replace"):
                job.testbed.cut(host)
                said["heal_cut"] = host
                stop.wait(drill.seconds)
                job.testbed.restore(host)
                said["ended"] = datetime.now()
                return
        time.sleep(0.02)


def recovery_s(log: Path, ended: datetime | None) -> float | None:
    """Seconds from the fault's end to the victim's first committed sync or heal after it."""
    if ended is None:
        return None
    for line in log.read_text(errors="replace").splitlines():
        m = _EVENT.search(line)
        if m:
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
            if at >= ended:
                return (at - ended).total_seconds()
    return None


def run_drill(drill: Drill, work: Path, args, shape: list[str]) -> dict:
    said: dict = {}
    h = args.sync_every
    overrides = [
        *shape,
        "--training.steps",
        str(args.steps),
        "--outer.sync_every",
        str(h),
        "--metrics.log_freq",
        "1",
        *(["--outer.round", "deadline"] if drill.mode == "deadline" else []),
        *drill.extra,
    ]
    job = run_local_job(
        work / drill.name,
        "diloco/diloco",
        drill.replicas,
        overrides,
        args.timeout,
        watch=fault_thread(drill, args.steps - 1 if drill.at == "final" else h + h // 2, said),
        launch={
            "netns": True,
            "max_restarts": 3,
            "min_replicas": None,
            "join_timeout_ms": None,
            **({"link": drill.link} if drill.link else {}),
        },
    )
    sums = [r["summary"]["diloco"] for r in job.replicas]
    twice = [
        sum(n - 1 for n in Counter(row["step"] for row in r["rows"] if "loss" in row).values() if n > 1)
        for r in job.replicas
    ]
    victim_log = job.logs / f"replica_{drill.replicas - 1}.log"
    return {
        "drill": drill,
        "wall": job.wall_s,
        "agree": len({s["final_global_sha256"] for s in sums}) == 1,
        "syncs": " ".join(f"{s['syncs_committed']}/{s['syncs_failed']}/{s.get('syncs_missed', 0)}" for s in sums),
        "twice": sum(twice),
        "recover": recovery_s(victim_log, said.get("ended")),
        "faulted": "started" in said and (drill.at not in _HEAL_STARTS or "heal_cut" in said),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_job_options(parser, timeout=900)
    parser.add_argument("--drills", default="", help="comma-separated drill names (default: all)")
    args = parser.parse_args()
    exit_on_sigterm()
    why = unavailable()
    if why:
        print(f"partition drills skipped: {why}")
        return 0
    drills = [SMOKE] if args.smoke else [d for d in DRILLS if not args.drills or d.name in args.drills.split(",")]
    if args.smoke:
        args.steps, args.sync_every = 10, 5
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    work = Path(tempfile.mkdtemp(prefix="partition-drills-"))
    print(
        f"load average {loadavg()}; {len(drills)} drill(s), {args.steps} steps, H={args.sync_every}, shape "
        f"{' '.join(shape[1::2])}; outputs in {work}"
    )
    print(
        f"{'drill':30} {'K':>2} {'rounds':9} {'agree':5} {'committed/rolled back/missed per group':40} "
        f"{'twice':>5} {'recover s':>9} {'wall s':>7}"
    )
    try:
        for drill in drills:
            r = run_drill(drill, work, args, shape)
            recover = "n/a" if r["recover"] is None else f"{r['recover']:.1f}"
            if not r["faulted"]:
                recover = "no fault (the run ended first)" if drill.at not in _HEAL_STARTS else "no heal was cut"
            print(
                f"{drill.name:30} {drill.replicas:>2} {drill.mode:9} {'yes' if r['agree'] else 'NO':5} "
                f"{r['syncs']:40} {r['twice']:>5} {recover:>9} {r['wall']:>7.1f}",
                flush=True,
            )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
