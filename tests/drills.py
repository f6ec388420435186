"""The fault-drill matrix: K=3 replica groups (K=2 for one drill) under the local launcher, replicas SIGKILLed at
exact points (tests/drill_train.py), restarted by the launcher, and the run must still end in
agreement.

Each drill asserts, on the real outputs of the run:

- the launcher exits 0: every replica group finished (restarts included);
- every group's summary has the same final θ_g hash and the same final validation loss;
- after every committed sync, every group that committed it holds bitwise the same θ_g, and
  every committed sync had a majority of the groups in its quorum (no split brain);
- no healthy replica healed, and each killed replica healed exactly where its drill says: from
  which peer, to which step, in which restart (the "healed from replica" lines of each start of
  its log);
- no sync was rolled back except where a kill made it fail (the first sync at or after each
  kill, the sync a paced comeback joins), and the run's last sync committed on every group;
- steps trained twice (a step a group logged a training loss for more than once, restarts
  included) are counted, and a drill that says so (``no_retrain``) asserts there are none.

The test sets the order of events instead of assuming which process is faster (a restart
takes seconds here and far less on a fast host): a killed replica's restart is gated until its
peers stand where the drill wants them (``gate``), and they hold there (``hold``) until the
restarted replica waits in their next quorum, which the lighthouse's status page shows. So it
heals at that sync whatever the speed of training or of restarting; a replica killed in the
last interval is let back only once its peers have trained their last step, and heals to the
final state. :class:`Pacer` does this from a thread while the launcher runs.

Kill steps are drawn from ``random.Random(seed)`` inside each drill's window, so a failing run
is reproduced by its seed. Used by tests/test_fault_drills.py (a subset in CI) and
scripts/fault_drills.py (the whole matrix, several seeds each).
"""

from __future__ import annotations

import json
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from drill_train import open_gate, release
from progress import FolderProgress, until
from replicas import DILOCO_TINY, DRILL_ENTRY, summary, syncs, waiting_in_quorum

from muloco.launch.local import LocalJob

K = 3
H = 10
STEPS = 100
CHECKPOINT_EVERY = 20
HOLD = STEPS - H - H // 2
"""Where the survivors of a kill wait for its restart: mid-way through the last interval but
one, so that the restart heals at sync HEAL_AT and trains the last interval with them."""
HEAL_AT = STEPS - H
PACE_TIMEOUT = 600.0
"""Only a hang: how long the pacer waits for any one event while the job writes nothing."""
HEAL_LINE = re.compile(r"healed from replica (\d+) in quorum \d+: step \d+ -> (\d+)")


def _mid_step(rng: random.Random, lo: int, hi: int) -> int:
    """A step in [lo, hi] that is not a sync boundary."""
    return rng.choice([s for s in range(lo, hi + 1) if s % H])


@dataclass(frozen=True)
class Comeback:
    """When killed replicas come back, set by the test."""

    restarts: tuple[tuple[int, int], ...]
    """(replica, torchrun restart) processes gated until now (``gate`` drills)."""
    survivors: tuple[int, ...]
    """Replicas that hold after inner step ``hold`` until the replicas behind wait in their next
    quorum."""
    hold: int | None
    """None: the restarts start once the survivors have trained their last step."""
    behind: int = 0
    """Replicas waiting in the survivors' next quorum before they are released (0: the restarts)."""


@dataclass(frozen=True)
class Plan:
    kills: list[str]
    """Killing drills for tests/drill_train.py (``kind:replica:step``)."""
    comebacks: list[Comeback]
    heals: dict[tuple[int, str], tuple[int, int]]
    """(replica, log segment: 'restart N') → (peer it healed from, step it healed to); no heal anywhere else."""

    def may_roll_back(self, replica: int, step: int) -> bool:
        """Whether a kill of this plan may make the sync ``replica`` recorded at ``step`` fail:
        the first sync at or after a kill's step (a kill right after a sync: the next one); with
        kills at no fixed step (healing, serving a heal) also the syncs after each paced
        comeback and a killed replica's catch-up round from its checkpoint (at or before the
        step it was killed at: its heal failed with its source)."""
        if step in self._failing_syncs():
            return True
        heal_kills = any(k.split(":")[2] == "0" for k in self.kills)
        killed_at = [int(k.split(":")[2]) for k in self.kills if int(k.split(":")[1]) == replica]
        return heal_kills and any(step <= at for at in killed_at)

    def _failing_syncs(self) -> set[int]:
        steps: set[int] = set()
        for kill in self.kills:
            kind, _, step = kill.split(":")
            at = int(step) + (H if kind == "boundary" else 0)
            if int(step) > 0:
                steps.add(-(-at // H) * H)
        if any(k.split(":")[2] == "0" for k in self.kills):
            steps |= {-(-c.hold // H) * H + d for c in self.comebacks if c.hold is not None for d in (0, H)}
        return steps

    def specs(self) -> list[str]:
        """Every drill of the run: the kills, and the gates and holds that pace the comebacks."""
        out = list(self.kills)
        for c in self.comebacks:
            out += [f"gate:{r}:{attempt}" for r, attempt in c.restarts]
            if c.hold is not None:
                out += [f"hold:{s}:{c.hold}" for s in c.survivors]
        return out


def _one_kill(kill: str) -> Plan:
    """One replica killed (``kind:replica:step``, before HOLD - H): the other two hold at HOLD
    until its restart waits in their next quorum, so it heals at HEAL_AT from the lower-numbered
    survivor (torchft gives a lone replica behind the first one up to date, in replica-id order)."""
    victim = int(kill.split(":")[1])
    survivors = tuple(r for r in range(K) if r != victim)
    return Plan([kill], [Comeback(((victim, 1),), survivors, HOLD)], {(victim, "restart 1"): (survivors[0], HEAL_AT)})


def _two_at_once(step: int) -> Plan:
    """K=5: replicas 1 and 3 killed after the same inner step; the other three hold at HOLD until
    both restarts wait in their next quorum, where each heals from an up-to-date group (torchft
    hands the groups behind to the ones up to date in turn: 1 from 0, 3 from 2)."""
    return Plan(
        [f"mid:1:{step}", f"mid:3:{step}"],
        [Comeback(((1, 1), (3, 1)), (0, 2, 4), HOLD)],
        {(1, "restart 1"): (0, HEAL_AT), (3, "restart 1"): (2, HEAL_AT)},
    )


@dataclass(frozen=True)
class Drill:
    name: str
    what: str
    plan: Callable[[random.Random], Plan]
    """The run's drills and expected heals, from the seeded RNG."""
    extra: tuple[str, ...] = ()
    replicas: int = K
    config: str = "diloco/muloco_2bit"
    no_retrain: bool = False
    """Assert that no group trained a step twice (a restart heals before it trains)."""
    spares_peers: bool = False
    """Assert that the replicas never killed roll back no sync: each one a kill made fail was tried
    again without the dead replica and committed (``--fault_tolerance.sync_retries``)."""


DRILLS = {
    d.name: d
    for d in [
        Drill(
            "sync-boundary",
            "right after a committed sync",
            lambda r: _one_kill(f"boundary:1:{r.choice(range(30, 71, H))}"),
        ),
        Drill("mid-interval", "between two syncs", lambda r: _one_kill(f"mid:1:{_mid_step(r, 21, 69)}")),
        Drill(
            "sync-start",
            "as a sync starts, before its quorum",
            lambda r: _one_kill(f"prepare:1:{r.choice(range(30, 71, H))}"),
        ),
        Drill(
            "exchange",
            "inside an exchange: after the quorum, before sending",
            lambda r: _one_kill(f"exchange:2:{r.choice(range(30, 71, H))}"),
        ),
        Drill(
            "exchange-compressed",
            "inside a 2-bit reduce-scatter exchange",
            lambda r: _one_kill(f"exchange:2:{r.choice(range(30, 71, H))}"),
            (
                "--outer.exchange.codec",
                "quantize",
                "--outer.exchange.codec.bits",
                "2",
                "--outer.exchange.strategy",
                "reduce_scatter",
            ),
        ),
        # its first restart joins the quorum of sync 60 and is killed while downloading: its peers
        # try that sync again without it and commit it; the second restart joins the quorum of
        # HEAL_AT and heals
        Drill(
            "healing",
            "killed mid-interval, then killed again while downloading a peer's state",
            lambda r: Plan(
                [f"mid:1:{_mid_step(r, 21, 49)}", "healing:1:0"],
                [Comeback(((1, 1),), (0, 2), 55), Comeback(((1, 2),), (0, 2), HOLD)],
                {(1, "restart 2"): (0, HEAL_AT)},
            ),
            spares_peers=True,
        ),
        # replica 1's restart heals from replica 0 in the quorum of sync 60, which is killed while
        # serving it; replica 2 tries sync 60 again without replica 0, and replica 1 (its heal
        # failed: it joins the next quorum instead of training) heals from replica 2 there; replica
        # 0's restart heals from replica 1 (the first group up to date) in the quorum of sync 70
        Drill(
            "heal-source",
            "a healthy peer killed while serving a healing replica",
            lambda r: Plan(
                [f"mid:1:{_mid_step(r, 21, 49)}", "heal-source:0:0"],
                [Comeback(((1, 1),), (0, 2), 55), Comeback(((0, 1),), (2,), 65, behind=2)],
                {(0, "restart 1"): (1, 70), (1, "restart 1"): (2, 60)},
            ),
            no_retrain=True,
        ),
        Drill(
            "exchange-sparseloco",
            "inside a SparseLoCo exchange (top-k with 2-bit values, all-gather)",
            lambda r: _one_kill(f"exchange:2:{r.choice(range(30, 71, H))}"),
            config="diloco/sparseloco",
        ),
        Drill(
            "checkpoint-save",
            "while saving a checkpoint: data written, metadata not",
            lambda r: _one_kill(f"checkpoint:2:{r.choice(range(40, 71, CHECKPOINT_EVERY))}"),
        ),
        # its restart starts only once the others trained their last step: it heals to the end
        Drill(
            "last-interval",
            "within the last interval of the run",
            lambda r: Plan(
                [f"mid:1:{_mid_step(r, STEPS - H + 1, STEPS - 1)}"],
                [Comeback(((1, 1),), (0, 2), None)],
                {(1, "restart 1"): (0, STEPS)},
            ),
        ),
        # its restart is let in only once its peers hold before their last step, and waits in their
        # final sync's quorum: it heals inside that sync and must take part in its exchange
        Drill(
            "final-sync",
            "back inside the peers' final sync",
            lambda r: Plan(
                [f"mid:1:{_mid_step(r, 41, 59)}"],
                [Comeback(((1, 1),), (0, 2), STEPS - 1)],
                {(1, "restart 1"): (0, STEPS)},
            ),
            no_retrain=True,
        ),
        # K=2: killed after the sync that followed its last checkpoint, so the lighthouse's last quorum
        # stands at the checkpoint's own sync; its restart must still see that it is behind
        Drill(
            "one-sync-behind",
            "K=2, killed one sync after its checkpoint",
            lambda r: Plan([f"mid:1:{_mid_step(r, 71, 79)}"], [], {(1, "restart 1"): (0, 80)}),
            replicas=2,
            no_retrain=True,
        ),
        Drill(
            "two-at-once",
            "K=5, two replicas killed after the same step",
            lambda r: _two_at_once(_mid_step(r, 21, 69)),
            replicas=5,
        ),
        Drill(
            "two-kills",
            "two replicas killed at different times in one run",
            lambda r: Plan(
                [f"mid:1:{_mid_step(r, 15, 35)}", f"mid:2:{_mid_step(r, 51, 69)}"],
                [Comeback(((1, 1),), (0, 2), 45), Comeback(((2, 1),), (0, 1), HOLD)],
                {(1, "restart 1"): (0, 50), (2, "restart 1"): (0, HEAL_AT)},
            ),
        ),
    ]
}

CI_DRILLS: list[str] = ["final-sync", "one-sync-behind", "healing"]
"""What tests/test_fault_drills.py runs, one seed each (about 15-25 s each on two quiet cores): the
two orderings issue 38 fixed, and a replica that dies while it is being healed, whose peers try that
sync again without it and commit it (issue 58). The others run from scripts/fault_drills.py. CI covers nearby cases
elsewhere: a kill inside a compressed exchange
(tests/test_diloco.py::test_replica_killed_in_a_compressed_exchange_survivors_roll_back_and_go_on),
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
    specs: list[str]
    """Every drill of the run (tests/drill_train.py): the kills, and the gates and holds."""
    status: int
    seconds: float
    final_hashes: list[str | None] = field(default_factory=list)
    final_losses: list[float | None] = field(default_factory=list)
    healed: dict[int, list[str]] = field(default_factory=dict)
    """Replica → 'original'/'restart N' segments of its log in which it healed."""
    committed: int = 0
    """Syncs committed, summed over the groups."""
    rolled_back: list[str] = field(default_factory=list)
    """'replica R step S: why' of every sync not committed."""
    retried: list[str] = field(default_factory=list)
    """'replica R step S: why' of every failed try of a sync that was tried again in a fresh quorum."""
    trained_twice: int = 0
    """Steps trained more than once, summed over the groups."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _log_segments(log: Path) -> list[tuple[str, str]]:
    """(segment name, text) of a replica log: the first start, then each restart."""
    text = log.read_text() if log.exists() else ""
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


def _trained_twice(dump: Path, replica: int) -> int:
    """Steps this group logged a training loss for more than once (drills log every step)."""
    seen: dict[int, int] = {}
    rows = [json.loads(x) for x in (dump / f"replica_{replica}" / "metrics.jsonl").read_text().splitlines()]
    for step in (r["step"] for r in rows if "loss" in r):
        seen[step] = seen.get(step, 0) + 1
    return sum(1 for n in seen.values() if n > 1)


def check(dump: Path, result: DrillResult, plan: Plan, drill: "Drill") -> None:
    """Fill ``result`` from the run's outputs and record every broken invariant."""
    p = result.problems
    K = drill.replicas
    if result.status != 0:
        p.append(f"launcher exited {result.status}")
        return
    sums = [summary(dump, i) for i in range(K)]
    for i in range(K):
        records = syncs(dump, i)
        result.committed += sum(1 for r in records if r["committed"])
        for r in records:
            if r.get("retried"):  # tried again in a fresh quorum: the next record is the sync's outcome
                result.retried.append(f"replica {i} step {r['step']}: {r.get('failure')}")
            elif not r["committed"]:
                result.rolled_back.append(f"replica {i} step {r['step']}: {r.get('failure')}")
                if not plan.may_roll_back(i, r["step"]):
                    p.append(
                        f"replica {i}'s sync at step {r['step']} was rolled back where no kill of the drill "
                        f"made it fail: {r.get('failure')}"
                    )
        healed_to_end = any(h["step_to"] == STEPS and not h.get("failure") for h in sums[i]["diloco"]["heal_log"])
        if not healed_to_end and not any(r["step"] == STEPS and r["committed"] for r in records):
            p.append(f"replica {i}'s last sync (step {STEPS}) did not commit (nor did it heal to the final state)")
        result.trained_twice += _trained_twice(dump, i)
    if drill.spares_peers:
        killed = {int(k.split(":")[1]) for k in plan.kills}
        spared = [r for r in result.rolled_back if int(r.split()[1]) not in killed]
        if spared:
            p.append(
                f"replicas never killed rolled back syncs they could have committed without the dead one: {spared}"
            )
        if not any(int(r.split()[1]) not in killed for r in result.retried):
            p.append("no replica tried a sync again: the kill did not fail a sync of its peers")
    if drill.no_retrain and result.trained_twice:
        p.append(f"{result.trained_twice} step(s) trained twice: a restart trained before it healed")
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
        for name, text in _log_segments(dump / "logs" / f"replica_{i}.log"):
            found = [(int(peer), int(to)) for peer, to in HEAL_LINE.findall(text)]
            if found:
                result.healed.setdefault(i, []).append(name)
            want = plan.heals.get((i, name))
            if name == "original" and found:
                p.append(f"healthy replica {i} healed from a peer: {found}")
            elif found != ([want] if want else []):
                p.append(
                    f"replica {i} ({name}) healed {found or 'nowhere'} (from replica, to step); "
                    f"the drill sets {[want] if want else 'no heal'}"
                )
    missing = {key for key in plan.heals if key[0] not in result.healed or key[1] not in result.healed[key[0]]}
    if missing:
        p.append(f"no heal where the drill sets one: {sorted(missing)}")


class PacingError(AssertionError):
    pass


class Pacer(threading.Thread):
    """Lets killed replicas come back where the plan says (:class:`Comeback`), from a thread
    while ``job.run()`` blocks: waits for the survivors to hold, opens the restarts' gates, waits
    until the replicas behind wait in the survivors' next quorum (the lighthouse's status page
    counts them), then releases the survivors. A wait that never ends stops the job."""

    def __init__(self, job: LocalJob, plan: Plan, dump: Path, markers: Path):
        super().__init__(name="drill-pacer", daemon=True)
        self.job, self.plan, self.dump, self.markers = job, plan, dump, markers
        self.done = threading.Event()  # set by run_drill once job.run() returned
        self.problem: str | None = None

    def run(self) -> None:
        try:
            self._until("the launcher did not start", self.job.started.is_set)
            for comeback in self.plan.comebacks:
                self._comeback(comeback)
        except PacingError as e:
            if not self.done.is_set():
                self.problem = f"pacing: {e}"
                self.job.stop(1)

    def _until(self, what: str, happened: Callable[[], bool]) -> None:
        """Wait for an event of the job; a job that writes nothing (logs, metrics, checkpoints,
        drill markers) for PACE_TIMEOUT seconds is hung, however long it has run."""
        seen: list[bool] = []  # the event as it was seen once (a status read may change on a second look)

        def over() -> bool:
            if happened():
                seen.append(True)
            return bool(seen) or self.done.is_set()

        try:
            until(what, over, progress=FolderProgress(PACE_TIMEOUT, self.dump, self.markers))
        except AssertionError as err:
            raise PacingError(str(err).strip()) from None
        if not seen:
            raise PacingError(f"the job ended first: {what}")

    def _comeback(self, c: Comeback) -> None:
        if c.hold is None:
            self._until(
                f"replicas {c.survivors} did not train their last step",
                lambda: all(self._trained_all(s) for s in c.survivors),
            )
        else:
            self._until(
                f"replicas {c.survivors} did not hold after step {c.hold}",
                lambda: all((self.markers / f"hold-r{s}-{c.hold}").exists() for s in c.survivors),
            )
        for replica, attempt in c.restarts:
            open_gate(self.markers, replica, attempt)
        for replica, attempt in c.restarts:
            self._until(
                f"replica {replica}'s restart {attempt} did not find itself behind its peers",
                lambda: "this replica group is behind" in self._segment(replica, f"restart {attempt}"),
            )
        if c.hold is None:
            return
        behind = c.behind or len(c.restarts)
        self._until(
            f"{behind} replica group(s) behind did not wait in a quorum",
            lambda: waiting_in_quorum(str(self.job.lighthouse_url)) == behind,
        )
        for s in c.survivors:
            release(self.markers, s, c.hold)

    def _trained_all(self, replica: int) -> bool:
        try:
            return any(r["step"] == STEPS for r in syncs(self.dump, replica))
        except (FileNotFoundError, ValueError, KeyError):  # not written yet, or a line being written
            return False

    def _segment(self, replica: int, name: str) -> str:
        return dict(_log_segments(self.dump / "logs" / f"replica_{replica}.log")).get(name, "")


def run_drill(name: str, seed: int, tmp: Path, console=None) -> DrillResult:
    """One drill under the local launcher; returns what it found (never raises on a broken invariant)."""
    drill = DRILLS[name]
    plan = drill.plan(random.Random(seed))
    specs = plan.specs()
    K = drill.replicas
    dump = tmp / f"{name}-{seed}"
    markers = tmp / f"{name}-{seed}-markers"
    markers.mkdir(parents=True, exist_ok=True)
    overrides = [
        *DILOCO_TINY,
        "--metrics.log_freq",
        "1",
        "--training.steps",
        str(STEPS),
        "--outer.sync_every",
        str(H),
        "--checkpoint.interval",
        str(CHECKPOINT_EVERY),
        "--validator.freq",
        str(2 * H),
        # every wait for a peer is only a hang timeout: a killed peer's sockets close at once
        # (its collectives fail then), and the pacer decides who comes back when
        "--fault_tolerance.process_group_timeout_ms",
        "60000",
        "--fault_tolerance.quorum_timeout_seconds",
        "300",
        "--fault_tolerance.start_wait_seconds",
        "300",
        "--fault_tolerance.end_wait_seconds",
        "300",
        *drill.extra,
        "--dump_folder",
        str(dump),
    ]
    job = LocalJob(
        config=drill.config,
        replicas=K,
        overrides=overrides,
        max_restarts=2,
        # a live replica is never dropped for a late heartbeat under load; a dead one after 3 s
        heartbeat_timeout_ms=3000,
        threads=1,
        entry=DRILL_ENTRY,
        env={"MULOCO_TEST_DRILLS": ",".join(specs), "MULOCO_TEST_DRILL_DIR": str(markers)},
        console=console if console is not None else open(tmp / f"{name}-{seed}-console.txt", "w"),
    )
    pacer = Pacer(job, plan, dump, markers)
    started = time.monotonic()
    pacer.start()
    try:
        status = job.run()
    finally:
        pacer.done.set()
        pacer.join(10)
    result = DrillResult(name, seed, specs, status, time.monotonic() - started)
    if pacer.problem:
        result.problems.append(pacer.problem)
    check(dump, result, plan, drill)
    fired = {p.name for p in markers.iterdir() if not p.name.startswith(("release-", "open-"))}
    want = {"{}-r{}-{}".format(*spec.split(":")) for spec in specs}  # drill_train's markers
    if fired != want:
        result.problems.append(f"drills that fired: {sorted(fired)}; the plan has {sorted(want)}")
    return result


def describe(result: DrillResult) -> str:
    return json.dumps(
        {
            "drill": result.drill,
            "seed": result.seed,
            "drills": result.specs,
            "status": result.status,
            "seconds": round(result.seconds, 1),
            "final_sha256": sorted({h[:12] for h in result.final_hashes if h}),
            "final_losses": result.final_losses,
            "healed": result.healed,
            "committed": result.committed,
            "rolled_back": result.rolled_back,
            "retried": result.retried,
            "trained_twice": result.trained_twice,
            "problems": result.problems,
        }
    )


if __name__ == "__main__":  # quick manual run: python tests/drills.py NAME SEED
    import tempfile

    res = run_drill(sys.argv[1], int(sys.argv[2]), Path(tempfile.mkdtemp(prefix="drill-")), console=sys.stdout)
    print(describe(res))
    sys.exit(0 if res.ok else 1)
