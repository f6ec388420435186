"""How one replica group meets the others: torchft quorums, watched against the lighthouse.

A sync starts with a torchft quorum: the lighthouse groups the replica groups that asked,
the Manager reconfigures the cross-group process group and heals this group from a peer
if it is behind. torchft's quorum call blocks, for up to the quorum timeout, even when the
lighthouse is gone (its Rust client does not report that back). The :class:`Coordinator`
runs the call on a helper thread and, while it waits, reads the lighthouse's status page:

- a lighthouse that stops answering (refused, unknown host, no answer) ends the wait within
  ``lost_timeout`` (``--fault_tolerance.lighthouse_lost_seconds``, by default the connect
  timeout), with a message that says which, instead of after the quorum timeout;
- a quorum that does not form ends the wait after the quorum timeout (plus ``lost_timeout``),
  even when torchft retries its quorum call (it does, to outlast a lighthouse that moves);
- a long wait says every 15 s what the lighthouse is waiting for.

It also answers the questions the outer loop asks around quorums: which replica groups are
alive, whether this group is behind the last quorum, and what the quorum it joined looked
like (:class:`QuorumView`, from the answer torchft received: members, the highest torchft
step among them, who stands at it, whom this group healed from).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torchtitan.tools.logging import logger

from muloco.compat.quorum_record import record_quorums
from muloco.outer.lighthouse_status import LighthouseStatus, LighthouseUnreachable, fetch_status, group_of
from muloco.utils.errors import OUT_OF_DATE, REPLICA_GROUP, MulocoError

PROGRESS_EVERY_S = 15.0
CUT_OFF_FIRST_S = 5.0
"""A group whose lighthouse stops answering says so after this long, then every PROGRESS_EVERY_S."""


def _due(said: float | None, unreachable_since: float) -> bool:
    """Whether to say (again) that the lighthouse does not answer: first after CUT_OFF_FIRST_S of
    silence, then every PROGRESS_EVERY_S."""
    now = time.monotonic()
    return now - (unreachable_since if said is None else said) >= (
        CUT_OFF_FIRST_S if said is None else PROGRESS_EVERY_S
    )


POLL_S = 0.5


class CoordinationError(MulocoError, RuntimeError):
    """A torchft quorum or commit call failed (lighthouse gone, no quorum in time)."""

    exit_status = REPLICA_GROUP


class OutOfDateError(MulocoError, RuntimeError):
    """This replica group is behind and no peer it could heal from is running any more."""

    exit_status = OUT_OF_DATE


@dataclass(frozen=True)
class QuorumView:
    """One quorum as this replica group saw it."""

    quorum_id: int
    groups: tuple[int, ...]
    """Replica groups in the quorum, in quorum rank order."""
    max_step: int
    """The highest torchft step among the members (this group's step after any heal)."""
    at_max_step: int
    """How many members stood at ``max_step`` when the quorum formed (the rest heal)."""
    healed_from: int | None
    """The replica group this group healed from in this quorum, if it healed."""

    @property
    def size(self) -> int:
        return len(self.groups)

    @property
    def settled(self) -> bool:
        """Every member stood at the same torchft step: nobody had to heal."""
        return self.at_max_step == self.size

    @classmethod
    def from_result(cls, result: Any) -> "QuorumView":
        ids = list(result.replica_ids)
        src = result.recover_src_replica_rank
        healed_from = group_of(ids[src]) if result.heal and src is not None and src < len(ids) else None
        return cls(
            quorum_id=int(result.quorum_id),
            groups=tuple(g if (g := group_of(r)) is not None else -1 for r in ids),
            max_step=int(result.max_step),
            at_max_step=int(result.max_world_size),
            healed_from=healed_from,
        )


class Coordinator:
    """Quorums of one replica group, and what the lighthouse says about its peers.

    ``lighthouse_url=None`` (unit tests driving a bare torchft Manager) joins quorums
    without watching the lighthouse.
    """

    def __init__(
        self,
        manager: Any,
        *,
        lighthouse_url: str | None = None,
        group_size: int = 1,
        quorum_size: int = 1,
        lost_timeout: float = 30.0,
        quorum_timeout: float | None = None,
        device: torch.device | None = None,
    ):
        self.manager = manager
        self.url = lighthouse_url
        self.group_size = group_size
        self.quorum_size = quorum_size
        self.lost_timeout = lost_timeout
        """How long the lighthouse may not answer before the group gives up."""
        self.quorum_timeout = quorum_timeout
        self.device = device
        self._recorder = record_quorums(manager)
        self.cut_off_seconds = 0.0
        """Seconds the lighthouse did not answer while this group waited for it (``take_cut_off``)."""

    # ------------------------------------------------------------ lighthouse
    def status(self) -> LighthouseStatus:
        """The lighthouse's status; CoordinationError if it does not answer within the connect timeout."""
        assert self.url is not None
        started = time.monotonic()
        said: float | None = None
        failing_since: float | None = None
        try:
            while True:
                try:
                    return fetch_status(self.url, timeout=min(5.0, self.lost_timeout))
                except LighthouseUnreachable as err:
                    failing_since = failing_since or started
                    if time.monotonic() - started >= self.lost_timeout:
                        raise CoordinationError(f"{err} (for {self.lost_timeout:g}s)") from err
                    if _due(said, started):
                        self._say_unreachable(started, started)
                        said = time.monotonic()
                    time.sleep(POLL_S)
        finally:
            if failing_since is not None:
                self.cut_off_seconds += time.monotonic() - failing_since

    def take_cut_off(self) -> float:
        """The seconds cut off from the lighthouse since the last call (a sync books them apart
        from its wait for slower peers)."""
        seconds, self.cut_off_seconds = self.cut_off_seconds, 0.0
        return seconds

    def _say_unreachable(self, waiting_since: float, unreachable_since: float) -> None:
        """A cut-off group says so while it waits: how long, and the setting that ends the wait."""
        now = time.monotonic()
        logger.warning(
            f"waiting {now - waiting_since:.0f}s for a quorum; the lighthouse at {self.url} has not "
            f"answered for {now - unreachable_since:.0f}s (this group may be cut off from it and its "
            f"peers); it gives up after {self.lost_timeout:g}s (--fault_tolerance.lighthouse_lost_seconds)"
        )

    def wait_for_groups(self, expected: int, timeout: float, what: str) -> set[int]:
        """Block until ``expected`` replica groups heartbeat (or ``timeout``); the groups seen."""
        deadline = time.monotonic() + timeout
        last_report = time.monotonic()
        while True:
            seen = self.status().alive_groups()
            if len(seen) >= expected or time.monotonic() >= deadline:
                return seen
            if time.monotonic() - last_report >= PROGRESS_EVERY_S:
                logger.info(f"{what}: {len(seen)}/{expected} replica groups up")
                last_report = time.monotonic()
            time.sleep(0.1)

    # ---------------------------------------------------------------- quorum
    def quorum(self, timeout: float | None = None) -> QuorumView:
        """Join the next quorum (healing this group if it is behind); returns what it was.

        Raises CoordinationError if the quorum call fails, times out, or the lighthouse
        stops answering for the connect timeout while we wait.
        """
        if self.url is None:
            with coordination():
                self._start_quorum(timeout)
            return self.last_quorum()
        self.status()  # a lighthouse that is already gone fails here, before torchft blocks
        failure: list[BaseException] = []
        worker = threading.Thread(
            target=self._quorum_worker, args=(timeout, failure), name="muloco-quorum", daemon=True
        )
        started = time.monotonic()
        worker.start()
        unreachable_since: float | None = None
        last_report = started
        said_cut_off: float | None = None
        limit = timeout or self.quorum_timeout
        while worker.is_alive():
            worker.join(POLL_S)
            if not worker.is_alive():
                break
            started_poll = time.monotonic()
            if limit and time.monotonic() - started > limit + self.lost_timeout:
                raise CoordinationError(f"no quorum formed within {limit:g}s")
            try:
                status = fetch_status(self.url, timeout=min(5.0, self.lost_timeout))
                if unreachable_since is not None:
                    self.cut_off_seconds += time.monotonic() - unreachable_since
                unreachable_since = said_cut_off = None
            except LighthouseUnreachable as err:
                unreachable_since = unreachable_since or started_poll
                if time.monotonic() - unreachable_since >= self.lost_timeout:
                    raise CoordinationError(f"{err} (for {self.lost_timeout:g}s, while waiting for a quorum)") from err
                if _due(said_cut_off, unreachable_since):  # a cut-off group says so as it waits
                    self._say_unreachable(started, unreachable_since)
                    said_cut_off = last_report = time.monotonic()
                continue
            if time.monotonic() - last_report >= PROGRESS_EVERY_S:
                alive = sorted(status.alive_groups())
                logger.info(
                    f"waiting {time.monotonic() - started:.0f}s for a quorum; replica groups alive: "
                    f"{alive}; lighthouse: {status.next_quorum}"
                )
                last_report = time.monotonic()
        if unreachable_since is not None:
            self.cut_off_seconds += time.monotonic() - unreachable_since
        if failure:
            raise CoordinationError(str(failure[0]) or type(failure[0]).__name__) from failure[0]
        return self.last_quorum()

    def _quorum_worker(self, timeout: float | None, failure: list[BaseException]) -> None:
        try:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # healing copies land on this group's device
            self._start_quorum(timeout)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting thread
            failure.append(err)

    def _start_quorum(self, timeout: float | None) -> None:
        self.manager.start_quorum(timeout=timedelta(seconds=timeout) if timeout else None)

    def last_quorum(self) -> QuorumView:
        result = self._recorder.last_quorum
        assert result is not None, "no quorum was received"
        return QuorumView.from_result(result)


@contextlib.contextmanager
def coordination():
    """Mark failures of torchft's quorum/commit calls, so the trainer can explain them as a
    lost lighthouse or quorum while any other error surfaces as what it is."""
    try:
        yield
    except CoordinationError:
        raise
    except Exception as err:
        raise CoordinationError(str(err).strip() or type(err).__name__) from err
