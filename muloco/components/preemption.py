"""Stop on request: a preempted job checkpoints where it stands and exits, instead of losing the
work since its last periodic checkpoint.

A job script that SLURM warns (``--signal=B:USR1@120``: time limit, preemption, ``scancel
--signal=USR1 --batch``) creates the file ``$MULOCO_STOP_FILE`` and waits for the run. Each rank
looks for the file after every step (or gets ``SIGUSR1`` itself, where the group has one rank or
a stop file); the ranks of a replica group agree with one small all-reduce on a gloo group made
for it, so they all stop after the same step. The trainer then writes a full checkpoint at that
step (DiLoCo groups at a sync boundary, where no exchange is in flight, all groups of a job at
the same one: :meth:`StopRequest.agreed_at_sync`) and exits with :data:`EXIT_PREEMPTED`, which
the job script turns into a requeue; the requeued job resumes from that checkpoint. Without the
variable and the signal nothing is checked and nothing is created. A run that keeps no
checkpoints does not stop (it could not resume): it says so once and trains on.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import uuid

import torch
import torch.distributed as dist

from muloco.components.stop_request import EXIT_PREEMPTED, STOP_FILE_ENV  # noqa: F401 - the status a stop ends with


class RunPreempted(Exception):
    """The run stopped on request after writing a checkpoint at ``step``."""

    def __init__(self, step: int, folder: str):
        super().__init__(
            f"stopped on request at step {step} with a checkpoint in {folder}; the same command resumes it"
        )
        self.step = step


class StopRequest:
    """Whether this replica group was asked to stop, agreed by all of its ranks."""

    def __init__(self, path: str | None):
        self.path = path
        self._signalled = False
        self._group = None
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        if path and ranks > 1:
            self._group = dist.new_group(backend="gloo")  # every rank builds it, in the same order
        # a signal reaches one rank: only a group that agrees (or has one rank) may act on it
        if (self._group is not None or ranks == 1) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._on_signal)

    @classmethod
    def from_environment(cls) -> StopRequest:
        return cls(os.environ.get(STOP_FILE_ENV) or None)

    def _on_signal(self, signum, frame) -> None:
        self._signalled = True

    def _asked_here(self) -> bool:
        return self._signalled or bool(self.path and os.path.exists(self.path))

    def agreed_at_sync(self, step: int, interval: int) -> bool:
        """For DiLoCo groups sharing one stop file (one job): stop at the same sync boundary.
        The first group to see the request at boundary ``step`` fixes the stop at the next one,
        ``step + interval`` (a file beside the stop file, made atomically); the others read it.
        A group that missed the request at ``step`` (it came between two groups' looks) sees it
        at the next boundary, which is the one fixed: every group stops there, none waits
        alone for a quorum. Without a stop file (a signal) the group stops here."""
        if not self.agreed():
            return False
        if not self.path:
            return True
        return step >= self._stop_boundary(step + interval)

    def _stop_boundary(self, proposal: int) -> int:
        target = self.path + ".at"
        if not os.path.exists(target):
            tmp = f"{target}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}"  # unique on a shared disk
            with open(tmp, "w") as f:
                f.write(str(proposal))
            try:
                os.link(tmp, target)  # atomic: exactly one proposal wins, readers see it whole
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        with open(target) as f:
            return int(f.read())

    def agreed(self) -> bool:
        """True once any rank of the group was asked (a collective when the group has several
        ranks and a stop file: call it on every rank at the same step)."""
        if self._group is None:
            return self._asked_here()
        flag = torch.tensor([int(self._asked_here())], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())
