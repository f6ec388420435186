"""Collectives on the torchft Manager's process group, inside the current quorum.

The Manager offers only ``allreduce``; all-gather and all-to-all run on its reconfigured
process group and follow the manager's own error contract: a failure (a peer died, a
timeout) is recorded with ``report_error`` so ``should_commit()`` fails on every replica
and the outer loop rolls the sync back, instead of raising in the middle of training.
After an error the buffers hold garbage; callers check ``manager.errored()`` before
reading them. Each call returns an object with ``wait()``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions, ReduceOp


def _managed(manager: Any, issue) -> torch.futures.Future:
    done: torch.futures.Future = torch.futures.Future()
    if manager.errored():
        done.set_result(None)
        return done
    manager.wait_quorum()
    try:
        work = issue(manager._pg)
        return manager.wrap_future(work.get_future(), None)
    except Exception as err:  # noqa: BLE001 - recorded for should_commit, like Manager.allreduce
        manager.report_error(err)
        done.set_result(None)
        return done


def group_size(manager: Any) -> int:
    return manager._pg.size() if not manager.errored() else max(1, manager.num_participants())


def group_rank(manager: Any) -> int:
    """This replica's rank in the quorum's process group (its slot in gathered buffers).

    The wrapper's own ``rank()`` is the one it was constructed with; the reconfigured
    group underneath (``parent``) has the quorum rank.
    """
    return manager._pg.parent.rank() if not manager.errored() else 0


def all_reduce(manager: Any, tensor: torch.Tensor):
    """Sum ``tensor`` over the quorum, in place (torchft's own managed all-reduce)."""
    return manager.allreduce(tensor, reduce_op=ReduceOp.SUM)


def all_gather(manager: Any, out: torch.Tensor, tensor: torch.Tensor) -> torch.futures.Future:
    """Every replica's ``tensor`` (same size everywhere) into the rows of ``out`` (K, size),
    in quorum rank order."""
    rows = list(out.unbind(0))
    return _managed(manager, lambda pg: pg.allgather([rows], [tensor], AllgatherOptions()))


def all_to_all(
    manager: Any, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]
) -> tuple[torch.Tensor, torch.futures.Future]:
    """``send`` cut by ``send_splits`` goes to ranks 0..K-1; returns what arrives, cut by ``recv_splits``."""
    recv = send.new_empty(sum(recv_splits))
    fut = _managed(
        manager, lambda pg: pg.alltoall_base(recv, send, list(recv_splits), list(send_splits), AllToAllOptions())
    )
    return recv, fut
