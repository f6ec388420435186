"""``python -m muloco.train`` with fault drills installed: the test-side way to kill a replica
at an exact point (muloco itself has no fault hooks).

    MULOCO_TEST_DRILLS="mid:1:25,exchange:2:57" MULOCO_TEST_DRILL_DIR=/tmp/x \\
        python tests/drill_train.py --config diloco/diloco --fault_tolerance.replica_id 1 ...

Each drill is ``kind:replica:step``; the replica group with that id SIGKILLs itself:

- ``mid``        after inner step ``step`` (between syncs);
- ``boundary``   right after the sync performed at inner step ``step`` (committed or not);
- ``prepare``    as the sync prepared at ``step`` starts: before it joins the quorum;
- ``exchange``   inside the sync prepared at ``step``: after joining the quorum, before sending;
- ``checkpoint`` while saving the checkpoint of step ``step``: data files written, metadata not;
- ``healing``    while downloading a peer's state, the first time it heals (``step`` unused);
- ``heal-source`` while serving its state to a healing peer, the first time (``step`` unused).

Two drills pace instead of killing, so that a test sets the order of events instead of
assuming which process is faster:

- ``hold``       after inner step ``step`` the replica waits (heartbeating, in no quorum) until
  the test creates ``<MULOCO_TEST_DRILL_DIR>/release-r<id>-<step>`` (see :func:`release`);
- ``gate``       the process of restart ``step`` of the replica (torchrun's
  ``TORCHELASTIC_RESTART_COUNT`` plus SLURM's ``SLURM_RESTART_COUNT`` of a requeued job) waits before it builds its
  trainer (no heartbeat, no
  quorum: for its peers it is still dead) until the test creates
  ``<MULOCO_TEST_DRILL_DIR>/open-r<id>-<step>`` (see :func:`open_gate`): the test decides
  when a killed replica comes back.

One drill sets a pace instead of measuring it, so that deadline rounds plan exact budgets:

- ``pace``       the replica reports ``step`` milliseconds per inner step in each sync's work
  record (``muloco/outer/rounds/deadline.py``), whatever its steps really took.

A drill fires once per run: it leaves ``<MULOCO_TEST_DRILL_DIR>/<kind>-r<id>-<step>`` behind,
and a restarted process (same command, same environment) skips drills that already fired.
``MULOCO_TEST_DRILL_DIR`` may name environment variables of the process (``.../task-$SLURM_ARRAY_TASK_ID``):
each task of a job array, all replica 0 of its own run, then keeps its drills in its own folder.

Processes the test does not start itself (a SLURM job's ranks) get the drills through
``tests/drill_site`` on ``PYTHONPATH``: its ``sitecustomize`` calls :func:`install_from_env`
when the trainer module is imported.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _replica_id(argv: list[str]) -> int:
    for i, arg in enumerate(argv):
        if arg == "--fault_tolerance.replica_id":
            return int(argv[i + 1])
        if arg.startswith("--fault_tolerance.replica_id="):
            return int(arg.split("=", 1)[1])
    return 0


class Drill:
    def __init__(self, kind: str, replica: int, step: int, folder: Path):
        self.kind, self.replica, self.step = kind, replica, step
        self.marker = folder / f"{kind}-r{replica}-{step}"

    @property
    def pending(self) -> bool:
        return not self.marker.exists()

    def fire(self, where: str) -> None:
        self.marker.write_text(where)
        print(f"fault drill: killing replica {self.replica} ({self.kind}: {where})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def release(folder: Path, replica: int, step: int) -> None:
    """Let a replica held by ``hold:<replica>:<step>`` go on."""
    (folder / f"release-r{replica}-{step}").write_text("go")


def open_gate(folder: Path, replica: int, attempt: int) -> None:
    """Let the process of restart ``attempt`` of a replica held by ``gate:<replica>:<attempt>`` start."""
    (folder / f"open-r{replica}-{attempt}").write_text("go")


def _restart_count() -> int:
    """How many times this replica's process was started again: by torchrun, or by SLURM requeueing its job."""
    return sum(int(os.environ.get(name) or 0) for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def _gate(drill: Drill, poll_seconds: float = 0.05) -> None:
    """Block this process before it builds its trainer until the test opens the gate."""
    drill.marker.write_text(f"restart {drill.step} waiting")
    print(f"fault drill: replica {drill.replica}'s restart {drill.step} waits until the test lets it start", flush=True)
    go = drill.marker.parent / f"open-r{drill.replica}-{drill.step}"
    while not go.exists():
        time.sleep(poll_seconds)
    print(f"fault drill: replica {drill.replica}'s restart {drill.step} starts", flush=True)


def _hold(drill: Drill, poll_seconds: float = 0.05) -> None:
    """Block this replica until the test releases it (the wait is for a file, not for time)."""
    drill.marker.write_text(f"holding after inner step {drill.step}")
    print(f"fault drill: replica {drill.replica} holds after inner step {drill.step} until released", flush=True)
    go = drill.marker.parent / f"release-r{drill.replica}-{drill.step}"
    while not go.exists():
        time.sleep(poll_seconds)
    print(f"fault drill: replica {drill.replica} released after inner step {drill.step}", flush=True)


def _hold_after_train_step(trainer: type, drill: Drill) -> None:
    original = trainer.train_step

    def train_step(self, data_iterator):
        original(self, data_iterator)
        if self.step == drill.step and drill.pending:
            _hold(drill)

    trainer.train_step = train_step


def _install(drill: Drill) -> None:
    from muloco.diloco_trainer import DilocoTrainer
    from muloco.outer.loop import OuterLoop

    if drill.kind == "gate":
        if drill.step == _restart_count():
            _gate(drill)
    elif drill.kind == "hold":
        from muloco.trainer import MulocoTrainer

        for trainer in (DilocoTrainer, MulocoTrainer):  # a replica group, or a DDP run (replica 0)
            _hold_after_train_step(trainer, drill)
    elif drill.kind == "mid":
        original = DilocoTrainer.train_step

        def train_step(self, data_iterator):
            original(self, data_iterator)
            if self.step == drill.step and drill.pending:
                drill.fire(f"after inner step {self.step}")

        DilocoTrainer.train_step = train_step
    elif drill.kind == "boundary":
        original_perform = OuterLoop._perform

        def _perform(self, step, **kwargs):
            record = original_perform(self, step, **kwargs)
            if step == drill.step and drill.pending:
                drill.fire(f"right after the sync at step {step} ({'committed' if record.committed else 'failed'})")
            return record

        OuterLoop._perform = _perform
    elif drill.kind == "prepare":
        original_prepare_ = OuterLoop._prepare

        def _prepare_(self, step):
            if step == drill.step and drill.pending:
                drill.fire(f"as the sync prepared at step {step} starts, before its quorum")
            return original_prepare_(self, step)

        OuterLoop._prepare = _prepare_
    elif drill.kind == "exchange":
        original_start = OuterLoop._start_exchange
        state = {"step": None}
        original_prepare = OuterLoop._prepare

        def _prepare(self, step):
            state["step"] = step
            return original_prepare(self, step)

        def _start_exchange(self, *args, **kwargs):
            if state["step"] == drill.step and drill.pending:
                drill.fire(f"inside the sync prepared at step {drill.step}, after the quorum, before sending")
            return original_start(self, *args, **kwargs)

        OuterLoop._prepare = _prepare
        OuterLoop._start_exchange = _start_exchange
    elif drill.kind == "checkpoint":
        import torch.distributed.checkpoint.filesystem as fs

        original_finish = fs.FileSystemWriter.finish

        def finish(self, metadata, results):
            if f"step-{drill.step}" in str(self.path) and drill.pending:
                drill.fire(f"saving the checkpoint of step {drill.step}: data written, metadata not")
            return original_finish(self, metadata, results)

        fs.FileSystemWriter.finish = finish
    elif drill.kind == "healing":
        from muloco.compat.healing_transport import SafeHTTPTransport

        original_recv = SafeHTTPTransport.recv_checkpoint

        def recv_checkpoint(self, *args, **kwargs):
            if drill.pending:
                drill.fire("downloading a peer's state while healing")
            return original_recv(self, *args, **kwargs)

        SafeHTTPTransport.recv_checkpoint = recv_checkpoint
    elif drill.kind == "heal-source":
        from muloco.compat.healing_transport import SafeHTTPTransport

        original_send = SafeHTTPTransport.send_checkpoint

        def send_checkpoint(self, *args, **kwargs):
            if drill.pending:
                drill.fire("serving its state to a healing peer")
            return original_send(self, *args, **kwargs)

        SafeHTTPTransport.send_checkpoint = send_checkpoint
    elif drill.kind == "pace":
        import dataclasses

        from muloco.outer.rounds import DeadlineRounds

        original_work = DeadlineRounds.timed_work

        def timed_work(self, tokens, ended):
            real = original_work(self, tokens, ended)
            return dataclasses.replace(real, seconds=real.steps * drill.step / 1000)

        DeadlineRounds.timed_work = timed_work
    else:
        raise SystemExit(f"unknown drill kind {drill.kind!r}")


def install_from_env(argv: list[str]) -> None:
    """Install this replica's pending drills from ``MULOCO_TEST_DRILLS`` (``kind:replica:step,...``)."""
    me = _replica_id(argv)
    folder = Path(os.path.expandvars(os.environ.get("MULOCO_TEST_DRILL_DIR", ".")))
    folder.mkdir(parents=True, exist_ok=True)
    for spec in filter(None, os.environ.get("MULOCO_TEST_DRILLS", "").split(",")):
        kind, replica, step = spec.split(":")
        drill = Drill(kind, int(replica), int(step), folder)
        if drill.replica == me and drill.pending:
            _install(drill)


def main() -> int:
    from muloco import compat

    compat.apply()
    argv = sys.argv[1:]
    install_from_env(argv)
    from muloco.train import main as train_main

    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
