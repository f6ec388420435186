"""The fault-drill matrix: K=3 replica groups under the local launcher, replicas SIGKILLed at
exact points (tests/drill_train.py), restarted by the launcher, and the run must still end in
agreement.

Each drill asserts, on the real outputs of the run:

- the launcher exits 0: every replica group finished (restarts included);
- every group's summary has the same final θ_g hash and the same final validation loss;
- after every committed sync, every group that committed it holds bitwise the same θ_g, and
  every committed sync had a majority of the groups in its quorum (no split brain);
- no healthy replica healed: a "healed from replica" line appears only in the log of a
  process that was started again after a kill.

Kill steps are drawn from ``random.Random(seed)`` inside each drill's window, so a failing run
is reproduced by its seed. Used by tests/test_fault_drills.py (a subset in CI) and
scripts/fault_drills.py (the whole matrix, several seeds each).
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from replicas import DILOCO_TINY, DRILL_ENTRY, summary, syncs

from muloco.launch.local import LocalJob

K = 3
H = 10
STEPS = 240
"""Long enough (about 25 s of training here) that a replica restarted early in the run (about 11 s
to come back) heals while its peers still train; kills late in the run exercise the end."""
CHECKPOINT_EVERY = 20


def _mid_step(rng: random.Random, lo: int, hi: int) -> int:
    """A step in [lo, hi] that is not a sync boundary."""
    return rng.choice([s for s in range(lo, hi + 1) if s % H])


@dataclass(frozen=True)
class Drill:
    name: str
    what: str
    kills: Callable[[random.Random], list[str]]
    """Drill specs for tests/drill_train.py (``kind:replica:step``), from the seeded RNG."""
    extra: tuple[str, ...] = ()


DRILLS = {d.name: d for d in [
    Drill("sync-boundary", "right after a committed sync",
          lambda r: [f"boundary:1:{r.choice(range(30, 101, H))}"]),
    Drill("mid-interval", "between two syncs",
          lambda r: [f"mid:1:{_mid_step(r, 21, 99)}"]),
    Drill("exchange", "inside an exchange: after the quorum, before sending",
          lambda r: [f"exchange:2:{r.choice(range(30, 101, H))}"]),
    Drill("exchange-compressed", "inside a top-k reduce-scatter exchange",
          lambda r: [f"exchange:2:{r.choice(range(30, 101, H))}"],
          ("--outer.exchange.codec", "topk", "--outer.exchange.codec.fraction", "0.25",
           "--outer.exchange.strategy", "reduce_scatter")),
    Drill("healing", "killed mid-interval, then killed again while downloading a peer's state",
          lambda r: [f"mid:1:{_mid_step(r, 21, 69)}", "healing:1:0"]),
    Drill("heal-source", "a healthy peer killed while serving a healing replica",
          lambda r: [f"mid:1:{_mid_step(r, 21, 69)}", "heal-source:0:0"]),
    Drill("checkpoint-save", "while saving a checkpoint: data written, metadata not",
          lambda r: [f"checkpoint:2:{r.choice(range(40, 101, CHECKPOINT_EVERY))}"]),
    Drill("last-interval", "within the last interval of the run",
          lambda r: [f"mid:1:{_mid_step(r, STEPS - H + 1, STEPS - 1)}"]),
    Drill("two-kills", "two replicas killed at different times in one run",
          lambda r: [f"mid:1:{_mid_step(r, 15, 45)}", f"mid:2:{_mid_step(r, 60, 140)}"]),
]}

CI_DRILLS: list[str] = []
"""What tests/test_fault_drills.py runs, one seed each (about 80 s per drill here). The others
run from scripts/fault_drills.py. CI covers nearby cases elsewhere: a kill inside a compressed
exchange (tests/test_diloco.py::test_replica_killed_in_a_compressed_exchange_survivors_roll_back_and_go_on),
a killed replica that heals (test_k2_survivor_pauses_until_the_launcher_restarts_the_dead_replica_which_heals),
a save killed before its manifest (tests/test_bad_inputs.py::test_resume_skips_an_incomplete_checkpoint),
a replica group's SLURM task requeued mid-run that heals while the other trains on
(tests/test_slurm_jobs.py::test_array_layout_a_requeued_group_heals_while_the_other_keeps_training).
two-kills and last-interval left CI when the SLURM tests came in (20-minute budget); the SLURM
array test is CI's kill-and-heal drill on real processes now."""


@dataclass
class DrillResult:
    drill: str
    seed: int
    kills: list[str]
    status: int
    seconds: float
    final_hashes: list[str | None] = field(default_factory=list)
    final_losses: list[float | None] = field(default_factory=list)
    healed: dict[int, list[str]] = field(default_factory=dict)
    """Replica → 'original'/'restart N' segments of its log in which it healed."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _log_segments(log: Path) -> list[tuple[str, str]]:
    """(segment name, text) of a replica log: the first start, then each restart."""
    text = log.read_text()
    parts = re.split(r"^=== (restart \d+) ===$", text, flags=re.M)
    segments = [("original", parts[0])]
    segments += [(parts[i], parts[i + 1]) for i in range(1, len(parts) - 1, 2)]
    return segments


def _committed_by_step(dump: Path, replica: int) -> dict[int, dict]:
    """The last committed record of each sync step of one replica (restarts append)."""
    out: dict[int, dict] = {}
    for rec in syncs(dump, replica):
        if rec["committed"]:
            out[rec["step"]] = rec
    return out


def check(dump: Path, result: DrillResult) -> None:
    """Fill ``result`` from the run's outputs and record every broken invariant."""
    p = result.problems
    if result.status != 0:
        p.append(f"launcher exited {result.status}")
        return
    sums = [summary(dump, i) for i in range(K)]
    result.final_hashes = [s["diloco"]["final_global_sha256"] for s in sums]
    result.final_losses = [s["final_validation_loss"] for s in sums]
    if any(s["steps"] != STEPS for s in sums):
        p.append(f"steps at the end: {[s['steps'] for s in sums]}")
    if len(set(result.final_hashes)) != 1:
        p.append(f"final θ_g hashes differ: {result.final_hashes}")
    if len(set(result.final_losses)) != 1:
        p.append(f"final validation losses differ: {result.final_losses}")
    committed = [_committed_by_step(dump, i) for i in range(K)]
    for step in sorted(set().union(*committed)):
        recs = [c[step] for c in committed if step in c]
        if len({r["global_sha256"] for r in recs}) != 1:
            p.append(f"θ_g differs after the committed sync at step {step}")
        if any(r["participants"] < K // 2 + 1 for r in recs):
            p.append(f"sync at step {step} committed by a minority: {[r['participants'] for r in recs]}")
    for i in range(K):
        segments = _log_segments(dump / "logs" / f"replica_{i}.log")
        healed = [name for name, text in segments if "healed from replica" in text]
        if healed:
            result.healed[i] = healed
        if "original" in healed:
            p.append(f"healthy replica {i} healed from a peer")


def run_drill(name: str, seed: int, tmp: Path, console=None) -> DrillResult:
    """One drill under the local launcher; returns what it found (never raises on a broken invariant)."""
    drill = DRILLS[name]
    kills = drill.kills(random.Random(seed))
    dump = tmp / f"{name}-{seed}"
    markers = tmp / f"{name}-{seed}-markers"
    markers.mkdir(parents=True, exist_ok=True)
    overrides = [
        *DILOCO_TINY, "--training.steps", str(STEPS), "--outer.sync_every", str(H),
        "--checkpoint.interval", str(CHECKPOINT_EVERY), "--validator.freq", str(2 * H),
        "--fault_tolerance.process_group_timeout_ms", "3000",
        "--fault_tolerance.quorum_timeout_seconds", "120",
        "--fault_tolerance.start_wait_seconds", "60", "--fault_tolerance.end_wait_seconds", "90",
        *drill.extra, "--dump_folder", str(dump),
    ]
    job = LocalJob(
        config="diloco/muloco_2bit", replicas=K, overrides=overrides, max_restarts=2,
        heartbeat_timeout_ms=1000, threads_per_proc=1, entry=DRILL_ENTRY,
        env={"MULOCO_TEST_DRILLS": ",".join(kills), "MULOCO_TEST_DRILL_DIR": str(markers)},
        console=console if console is not None else open(tmp / f"{name}-{seed}-console.txt", "w"),
    )
    started = time.monotonic()
    status = job.run()
    result = DrillResult(name, seed, kills, status, time.monotonic() - started)
    check(dump, result)
    fired = sorted(p.name for p in markers.iterdir())
    if len(fired) != len(kills):
        result.problems.append(f"only these drills fired: {fired} of {kills}")
    return result


def describe(result: DrillResult) -> str:
    return json.dumps({
        "drill": result.drill, "seed": result.seed, "kills": result.kills, "status": result.status,
        "seconds": round(result.seconds, 1), "final_sha256": sorted({h[:12] for h in result.final_hashes if h}),
        "final_losses": result.final_losses, "healed": result.healed, "problems": result.problems,
    })


if __name__ == "__main__":  # quick manual run: python tests/drills.py NAME SEED
    import tempfile

    res = run_drill(sys.argv[1], int(sys.argv[2]), Path(tempfile.mkdtemp(prefix="drill-")), console=sys.stdout)
    print(describe(res))
    sys.exit(0 if res.ok else 1)
