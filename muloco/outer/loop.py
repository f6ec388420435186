"""DiLoCo's outer loop on a torchft Manager: global parameters, syncs, commit, rollback.

Per replica group: θ_g (per fragment, on the backup device) and one outer optimizer
per fragment. After inner step t the trainer calls :meth:`after_inner_step`:

- prepare (t ≡ −τ mod H/P): quorum (a replica that is behind heals here from a peer:
  model, inner optimizer, schedule, θ_g, outer momentum, torchft step, and the peer's
  trainer step), pick the fragment from the torchft step, Δ = θ_g − θ_local, start the
  exchange;
- perform (τ steps later): wait for the average, ``should_commit()``; on commit the
  outer optimizer steps θ_g and θ_local ← θ_g + α·(θ_local − θ_g). A sync is not
  committed when a collective failed, when no replica contributed, or when the average
  is not finite; then θ_g is untouched and θ_local ← θ_g (the round's local progress is
  dropped, no partial or broken average is ever applied).

Around the training loop: :meth:`catch_up` lets a group that starts behind its peers
(restarted, or late) heal before it trains a step, and :meth:`finish` keeps a group that
has finished meeting the others until every group stands at the same sync, so the run
ends with one θ_g everywhere.

Validation uses θ_g (:meth:`global_params`), never a replica's drifting local model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import tyro
from torch.distributed.tensor import DTensor
from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from muloco.outer.coordinator import (
    CoordinationError,
    Coordinator,
    OutOfDateError,
    QuorumView,
    coordination,
)
from muloco.outer.exchange import PARTS, Exchange, PendingExchange
from muloco.outer.exchange.link import Link
from muloco.outer.optimizer import Nesterov, OuterOptimizer, OuterOptimizerConfig
from muloco.outer.placement import Placement, resolve_backup_device
from muloco.outer.rounds import Lockstep, RoundConfig
from muloco.outer.schedule import SyncSchedule, model_fragments
from muloco.outer.step_schedule import StepSchedules
from muloco.utils.errors import REPLICA_GROUP, MulocoError

__all__ = ["CoordinationError", "OutOfDateError", "OuterLoop", "SyncRecord"]


HEAL_TRIES = 3
"""Quorums a group behind its peers tries to heal in before it trains on from its checkpoint."""


class SyncsKeepFailing(MulocoError, RuntimeError):
    """More consecutive syncs failed than fault_tolerance.max_commit_failures allows."""

    exit_status = REPLICA_GROUP


def _first_line(err: Any) -> str:
    """The first line of an error torchft recorded (it wraps them with their traceback)."""
    err = getattr(err, "original_exception", err)
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _codec_label(codec: Any) -> str:
    """A codec config as the user names it (``--outer.exchange.codec NAME``)."""
    return getattr(codec.build(), "name", type(codec).__qualname__)


def _named(err: Any) -> str:
    """The setting behind a collective's timeout (gloo says only "Timed out waiting 10000ms")."""
    if "timed out" not in _first_line(err).lower():
        return ""
    return (
        "; a collective waited past --fault_tolerance.process_group_timeout_ms (a peer cut off, dead, or "
        "still downloading its heal over a slow link)"
    )


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (its shard under FSDP): replicas exchange shards rank by rank."""
    return p.to_local() if isinstance(p, DTensor) else p


def _tensors(state: Any):
    """The tensors in a nested dict/list state."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _tensors(v)


class _Clock:
    """Consecutive laps of the caller's time, by name."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.start


def _parts(sync: "_Open", clock: _Clock, seconds: float) -> dict[str, float]:
    """The sync's blocked time by part (:data:`PARTS`); ``other`` makes them add up to ``seconds``."""
    exchange = sync.exchange.times
    slowest = sync.exchange.wait_for_slowest()
    parts = dict.fromkeys(PARTS, 0.0)
    parts["cut_off"] = min(sync.cut_off_seconds, sync.quorum_seconds)  # not waiting for peers: cut off from them
    parts["wait_slowest"] = min(slowest or 0.0, sync.quorum_seconds - parts["cut_off"])
    parts["quorum"] = sync.quorum_seconds - parts["cut_off"] - parts["wait_slowest"]
    for name in ("queued", "pseudo_gradient", "encode", "collective", "link", "decode"):
        parts[name] = exchange.get(name, 0.0)
    for name in ("commit", "outer_step", "pull"):
        parts[name] = clock.laps.get(name, 0.0)
    parts["other"] = max(0.0, seconds - sum(v for k, v in parts.items() if k != "other"))
    return parts


def _gib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**30


@dataclass
class SyncRecord:
    step: int
    fragment: int
    committed: bool
    participants: int
    contributors: int | None
    """Replicas whose Δ is in the average; None when the exchange failed (unknown)."""
    quorum_id: int
    seconds: float
    """Time this replica was blocked by the sync (prepare + perform, not the overlapped steps)."""
    bytes_sent: float
    """Bytes handed to the collectives for the other replicas (also when the sync then failed)."""
    bytes_received: float
    payload_bytes: int = 0
    """This replica's encoded Δ (what compression produced), flag bytes included."""
    numel: int = 0
    """Elements of the synced fragment on this rank."""
    dense_fp32_bytes: float = 0
    """What a dense fp32 ring all-reduce of this Δ would have sent."""
    failure: str | None = None
    """Why the sync was not committed."""
    sync: int = 0
    """torchft's step after it: the sync's number when committed (the last committed one else)."""
    contributed: bool = True
    """This replica offered its Δ (not one that just healed, or is catching up: it adds nothing)."""
    retried: bool = False
    """This failed attempt was tried again in a fresh quorum (``--fault_tolerance.sync_retries``; a
    peer that died or dropped out is not in it): the next record says how the sync ended. Its bytes
    and seconds were spent and are counted; it is not a sync of its own."""
    healed_from: int | None = None
    """The replica group this group healed from in this sync's quorum (only a heal that happened)."""
    heal_failure: str | None = None
    """A heal from a peer that this quorum started and that failed: the peer and the cause."""
    global_sha256: str | None = None
    peak_extra_bytes: int = 0
    """Peak bytes of the buffers this sync held (Δ, averages, buckets in flight)."""
    parts: dict[str, float] = field(default_factory=dict)
    """``seconds`` split into :data:`muloco.outer.exchange.PARTS` (they add up to it)."""
    outer_lr: float | None = None
    """The outer learning rate and momentum this sync stepped with (their schedules' values)."""
    outer_momentum: float | None = None
    feedback_beta: float | None = None
    """The error-feedback β this sync's payload was encoded with."""
    tokens: int = 0
    """Tokens this replica trained between its previous sync's prepare and this one's."""
    weight: float | None = None
    """This replica's weight in a weighted average (``outer.exchange.weighting tokens``, or ``auto`` in
    deadline rounds)."""
    weights: dict[int, float] = field(default_factory=dict)
    """A weighted average's weight per quorum rank."""
    round_steps: int | None = None
    """Deadline rounds: the inner steps this group trained in the round (its budget)."""
    progress: float | None = None
    """Deadline rounds: the run's progress in nominal steps after this sync."""

    @property
    def bits_per_parameter(self) -> float:
        return 8.0 * self.payload_bytes / max(self.numel, 1)


@dataclass
class HealRecord:
    """One heal of this replica group from a peer, wherever it happened."""

    phase: str
    """``start`` (behind its peers before training), ``sync`` (in a sync's quorum, mid-run) or
    ``end`` (in the end-of-run agreement)."""
    peer: int | None
    quorum_id: int
    step_from: int
    step_to: int
    sync: int
    """The torchft step (committed syncs) of the θ_g it received."""
    bytes_received: int
    """Bytes of the tensors in the state it received from the peer."""
    failure: str | None = None
    """Why the heal failed (None: it happened): the group stayed where it was."""
    missed: int = 0
    """Syncs the others committed without this group, which the heal jumped over (the sync the
    heal itself joins, with or without an exchange, counts as one this group took part in)."""


@dataclass
class _Open:
    fragment: int
    exchange: PendingExchange
    seconds: float
    quorum: QuorumView
    quorum_seconds: float
    cut_off_seconds: float = 0.0
    """Of the quorum's wait, the part the lighthouse did not answer (this group cut off)."""
    catching_up: bool = False
    tokens: int = 0
    round_steps: int | None = None
    contributes: bool = True


class _Fragment:
    """θ_g and the outer optimizer for one slice of the model."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], placement: Placement, opt: OuterOptimizer.Config):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.globals = [placement.home(_local(p)) for p in self.params]
        self.optimizer = opt.build(params=self.globals, zeros_like=placement.zeros_like)

    def locals(self) -> list[torch.Tensor]:
        return [_local(p) for p in self.params]

    def _wrap(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Name → tensor, as DTensors shaped like the parameters so DCP saves shards correctly."""
        out = {}
        for name, p, t in zip(self.names, self.params, tensors):
            if isinstance(p, DTensor):
                t = DTensor.from_local(
                    t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            out[name] = t
        return out

    def state_dict(self) -> dict[str, Any]:
        """θ_g and the outer optimizer's state tensors (``momentum``), by parameter name."""
        optimizer = {key: self._wrap(tensors) for key, tensors in self.optimizer.state_tensors().items()}
        return {"global": self._wrap(self.globals), **optimizer}

    def tensors(self) -> list[torch.Tensor]:
        """θ_g and the optimizer's state: what this fragment keeps in the backup device's memory."""
        return [*self.globals, *(t for ts in self.optimizer.state_tensors().values() for t in ts)]

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, tensors in (("global", self.globals), *self.optimizer.state_tensors().items()):
            for name, t in zip(self.names, tensors):
                t.copy_(_local(state[key][name]))


class OuterLoop(Configurable):
    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        sync_every: int = 30
        """H: inner steps between syncs of a fragment."""
        num_fragments: int = 1
        """Streaming DiLoCo: fragments synced in turn (1 = plain DiLoCo)."""
        fragment_sync_delay: int = 0
        """τ: inner steps the exchange overlaps before its result is applied."""
        fragment_update_alpha: float = 0.0
        """α: after a sync θ_local ← θ_g + α·(θ_local − θ_g); 0 keeps pure θ_g."""
        fingerprint: bool = False
        """Log a SHA-256 of θ_g after every sync (checks that replicas agree bitwise; costs a hash)."""
        backup_device: str = "auto"
        """Where θ_g and the outer momentum live: auto (the training device when it is an
        accelerator), device, or cpu (saves accelerator memory; pinned on CUDA)."""
        optimizer: tyro.conf.AvoidSubcommands[OuterOptimizerConfig] = field(default_factory=Nesterov.Config)
        """nesterov (default) | sgd | none: ``--outer.optimizer NAME``, its η and μ
        ``--outer.optimizer.lr``/``.momentum`` (``outer/optimizer.py``)."""
        step_schedule: StepSchedules = field(default_factory=StepSchedules)
        """Schedules of the outer lr, momentum and error-feedback β over the run (constant by
        default; ``outer/step_schedule.py``)."""
        exchange: Exchange.Config = field(default_factory=Exchange.Config)
        link: Link.Config = field(default_factory=Link.Config)
        """An emulated slow link between the replica groups (off by default): each collective of
        the exchange is held for the time its bytes would take (``outer/exchange/link.py``)."""
        round: tyro.conf.AvoidSubcommands[RoundConfig] = field(default_factory=Lockstep.Config)
        """lockstep (default) | deadline: rounds for replica groups of unequal speed, picked with
        ``--outer.round NAME``; a mode's settings are ``--outer.round.SETTING`` (``outer/rounds/``)."""

        def schedule(self) -> SyncSchedule:
            return SyncSchedule(self.sync_every, self.num_fragments, self.fragment_sync_delay)

        def validate(self) -> None:
            self.schedule()
            self.optimizer.validate()
            self.exchange.validate()
            self.optimizer.check_schedules(self.step_schedule, beta=self.exchange.error_feedback.beta)
            if not self.step_schedule.feedback_beta.constant and not self.exchange.carries_feedback():
                raise ValueError(
                    "outer.step_schedule.feedback_beta schedules the error-feedback β, but this exchange "
                    f"keeps no error feedback (its codec {_codec_label(self.exchange.codec)} is lossless, "
                    "or outer.exchange.error_feedback.enabled is off): drop "
                    "outer.step_schedule.feedback_beta.*"
                )
            self.link.validate()
            self.round.validate()
            self.round.validate_outer(self.schedule())
            self.exchange.check_weighting(self.round.auto_weighting, self.round.name)
            if not 0.0 <= self.fragment_update_alpha <= 1.0:
                raise ValueError(f"outer.fragment_update_alpha must be in [0, 1], got {self.fragment_update_alpha}")
            resolve_backup_device(self.backup_device, torch.device("cpu"))

    def __init__(
        self,
        config: Config,
        *,
        model: nn.Module,
        manager: Any,
        device: torch.device,
        replica_id: int = 0,
        coordinator: Coordinator | None = None,
        max_commit_failures: int = -1,
        total_steps: int = 0,
        inner_lr_factor: Callable[[int], float] | None = None,
        run_steps: int = 0,
        groups: int = 1,
        sync_retries: int = 0,
    ):
        """``total_steps``: the run's length the schedules' shares refer to (the inner schedule's
        total); ``inner_lr_factor``: the inner lr's factor at a step, for schedules tied to it;
        ``run_steps``: the run's length in inner steps (a round mode may end it on progress);
        ``groups``: the job's replica groups; ``sync_retries``: fresh quorums a sync whose exchange failed
        is tried in again (:meth:`_perform`)."""
        config.validate()
        self.replica_id = replica_id
        self.config = config
        self.manager = manager
        self.coordinator = coordinator or Coordinator(manager)
        self.max_commit_failures = max_commit_failures
        self.sync_retries = sync_retries
        self.schedule = config.schedule()
        self.device = device
        self.placement = Placement(resolve_backup_device(config.backup_device, device), device)
        self.fragments = [
            _Fragment(f, self.placement, config.optimizer) for f in model_fragments(model, config.num_fragments)
        ]
        self.round = config.round.build(
            schedule=self.schedule,
            total_steps=run_steps or total_steps,
            groups=groups,
            group=replica_id,
            device=device,
        )
        """The round mode (``outer/rounds/``): when syncs happen, where the run stands, what it keeps."""
        self.exchange = config.exchange.build(
            device=device,
            link=config.link.build(),
            auto_weighting=config.round.auto_weighting,
            gathers_work=config.round.gathers_work,
        )
        for frag in self.fragments:
            self.exchange.allocate(frag.names, frag.locals())
        self.records: list[SyncRecord] = []
        self._open: _Open | None = None
        self._round_tokens = 0
        """Tokens trained since the last prepare (a checkpoint is only taken between syncs, where
        it is 0 with τ = 0)."""
        self._healed_to: int | None = None
        self._heal_bytes = 0
        self._cut_off = 0.0  # of the last quorum: seconds the lighthouse did not answer
        self.cut_off_seconds = 0.0
        """All quorums' seconds cut off from the lighthouse, those of a sync without a record (a heal
        from peers that had finished) too."""
        self._meeting = "train"
        """The phase of the quorum this group is in (start, sync, end): a peer healing from it learns
        whether the quorum has an exchange (``end`` has none)."""
        self._source_phase: str | None = None
        """The phase of the peer this group last healed from, as it served its state."""
        self.heals: list[HealRecord] = []
        self._failures_in_a_row: list[str] = []
        self.num_params = sum(t.numel() for f in self.fragments for t in f.globals)
        steps = total_steps or self.schedule.sync_every
        self.lr_schedule, self.momentum_schedule, self.beta_schedule = (
            s.build(total_steps=steps, inner_factor=inner_lr_factor)
            for s in (config.step_schedule.lr, config.step_schedule.momentum, config.step_schedule.feedback_beta)
        )

    def describe_memory(self) -> str:
        """What the outer state costs this rank, and where it lives."""
        outer = _gib(t for f in self.fragments for t in f.tensors())
        feedback = _gib(_tensors(self.exchange.state_dict()))
        return (
            f"outer state on this rank: θ_g + outer momentum {outer:.3f} GiB in {self.placement.describe()}, "
            f"error feedback {feedback:.3f} GiB on {self.device}"
        )

    # ----------------------------------------------------------------- schedule
    def after_inner_step(self, step: int, tokens: int = 0, started: float | None = None) -> SyncRecord | None:
        """Prepare and/or perform the sync due after inner step ``step``, which trained
        ``tokens`` (on this rank: the work a weighted average counts) and began at ``started``
        (``time.perf_counter``: its group's pace, for a round mode that times its rounds).

        A heal during the prepare moves this replica to its peer's trainer step; the
        schedule and the record go on from there.
        """
        self._round_tokens += tokens
        record = None
        if self.round.step_trained(step, time.perf_counter() if started is None else started):
            step = self._prepare(step)
        if self._open is not None and self.round.perform_due(step):
            record, step = self._settle(step)
        self.round.step_ended(step)
        return record

    def _meet(self, step: int, phase: str, timeout: float | None = None) -> tuple[QuorumView, int]:
        """Join a quorum; (what it was, this replica's trainer step afterwards). A heal in it is
        recorded with ``phase`` (start, sync or end), so the summary counts it wherever it was."""
        self._healed_to = None
        self._meeting = phase
        sync_from = self.manager.current_step()
        self.coordinator.take_cut_off()  # only this quorum's
        try:
            view = self.coordinator.quorum(timeout)
        finally:
            self._meeting = "train"
            self._cut_off = self.coordinator.take_cut_off()
            self.cut_off_seconds += self._cut_off
        if self._healed_to is None and view.healed_from is not None:  # torchft started a heal that failed
            err = self.manager.errored()
            cause = _first_line(err) if err is not None else "the peer's state never arrived"
            heal = HealRecord(
                phase=phase,
                peer=view.healed_from,
                quorum_id=view.quorum_id,
                step_from=step,
                step_to=step,
                sync=self.manager.current_step(),
                bytes_received=0,
                failure=f"healing from replica {view.healed_from} failed: {cause}",
            )
            self.heals.append(heal)
            logger.warning(
                f"{heal.failure} (quorum {view.quorum_id}); this replica group stays at step {step}, sync {heal.sync}"
            )
            view = dataclasses.replace(view, healed_from=None)
        if self._healed_to is not None:
            sync = self.manager.current_step()
            joins_an_exchange = phase != "end" and self._source_phase != "end"  # else the heal is its sync
            heal = HealRecord(
                phase=phase,
                peer=view.healed_from,
                quorum_id=view.quorum_id,
                step_from=step,
                step_to=self._healed_to,
                sync=sync,
                bytes_received=self._heal_bytes,
                missed=max(0, sync - sync_from - (0 if joins_an_exchange else 1)),
            )
            self.heals.append(heal)
            missed = (
                f"; it missed {heal.missed} sync(s) the others committed without it (syncs "
                f"{sync_from + 1}..{sync_from + heal.missed})"
                if heal.missed
                else ""
            )
            logger.info(
                f"healed from replica {heal.peer if heal.peer is not None else '?'} in quorum "
                f"{view.quorum_id}: step {step} -> {heal.step_to}, sync {heal.sync} ({phase}){missed}"
            )
            step = self._healed_to
        return view, step

    @torch.no_grad()
    def _prepare(self, step: int) -> int:
        started = time.perf_counter()
        view, step = self._meet(step, "sync")
        if self._healed_to is not None and self._source_phase == "end":
            # its peers finished while it was away (cut off, slow) and served the heal from their
            # end-of-run agreement, which has no exchange: their final state is this group's now
            logger.info(
                f"the other groups have finished: this group took their final state (sync "
                f"{self.manager.current_step()}, step {step}); no exchange"
            )
            return step
        # a replica that just healed holds a copy of its peer's state: it adds nothing
        self._start_exchange(view, started, step, contributes=self._healed_to is None, catching_up=False)
        return step

    def _settle(self, step: int) -> tuple[SyncRecord, int]:
        """Perform the open sync; one whose exchange failed (a peer died or dropped out of it, or a
        heal in its quorum failed) is tried again in a fresh quorum, up to ``sync_retries`` times,
        instead of throwing the round away: the lighthouse leaves the lost peer out (or this group
        heals there, when its peers committed without it). Only with τ = 0, where the Δ is made
        again from the same θ_local (its error feedback was put back). Returns the last attempt's
        record and this group's trainer step after it (a heal moves it)."""
        for attempt in range(1, self.sync_retries + 2):
            sync = self._open
            may_retry = attempt <= self.sync_retries and self.schedule.delay == 0 and not sync.catching_up
            record = self._perform(step, may_retry=may_retry)
            if not record.retried:
                return record, step
            logger.warning(
                f"sync at step {step} was not committed ({record.failure}); trying it again in a fresh "
                f"quorum, without any group that dropped out (try {attempt + 1} of "
                f"{self.sync_retries + 1}, --fault_tolerance.sync_retries {self.sync_retries})"
            )
            started = time.perf_counter()
            view, step = self._meet(step, "sync")
            if self._healed_to is not None and self._source_phase == "end":
                logger.info(
                    f"the other groups have finished: this group took their final state (sync "
                    f"{self.manager.current_step()}, step {step}); no exchange"
                )
                return record, step
            self._round_tokens += sync.tokens  # the same work, offered again
            self._start_exchange(
                view, started, step, contributes=sync.contributes and self._healed_to is None, catching_up=False
            )
        raise AssertionError("unreachable: the last try is never retried")

    def _start_exchange(
        self, view: QuorumView, started: float, step: int, *, contributes: bool, catching_up: bool
    ) -> None:
        """Start the exchange of the fragment due now (after inner step ``step``, which sets the
        error-feedback β's schedule); ``started``: when its quorum began."""
        quorum_seconds = time.perf_counter() - started
        self.exchange.set_feedback_beta(
            self.config.exchange.error_feedback.beta * self.beta_schedule.factor(self.round.position(step))
        )
        self.exchange.set_outer_lr(self._outer_step_values(self.round.position(step))[0])
        index = self.manager.current_step() % len(self.fragments)
        frag = self.fragments[index]
        locals_ = frag.locals()

        def pseudo_gradient(views: list[torch.Tensor]) -> None:  # Δ = θ_g − θ_local, in the exchange's buffers
            self.placement.subtract_into(views, frag.globals, locals_)

        tokens, self._round_tokens = self._round_tokens, 0
        work = self.round.work(tokens, contributes, self.replica_id)
        pending = self.exchange.start(self.manager, frag.names, pseudo_gradient, contributes, quorum_seconds, work=work)
        self._open = _Open(
            fragment=index,
            exchange=pending,
            seconds=time.perf_counter() - started,
            quorum=view,
            quorum_seconds=quorum_seconds,
            cut_off_seconds=self._cut_off,
            catching_up=catching_up,
            tokens=tokens,
            round_steps=self.round.round_steps(work),
            contributes=contributes,
        )

    @torch.no_grad()
    def _perform(self, step: int, *, may_retry: bool = False) -> SyncRecord:
        """Wait for the open sync's average and commit it, or roll it back; ``may_retry``: a sync
        whose exchange failed keeps θ_local (the Δ is made again in the next try, ``_settle``)."""
        assert self._open is not None, "perform without prepare"
        sync, self._open = self._open, None
        frag = self.fragments[sync.fragment]
        clock = _Clock()
        averaged = sync.exchange.wait()
        exchange_failed = self.manager.errored() is not None
        vetoed = failure = None if exchange_failed else self._veto(sync.exchange, averaged)
        clock.lap("exchange")
        with coordination():
            committed = self.manager.should_commit()
        clock.lap("commit")
        if failure is None and not committed:
            err = self.manager.errored()
            failure = (
                f"a replica failed in the exchange or the commit vote ({_first_line(err)}){_named(err)}"
                if err
                else "fewer replica groups in the quorum than needed to commit"
            )
        locals_ = frag.locals()
        lr, momentum = self._outer_step_values(self.round.position(step))
        if committed:
            self.round.commit(sync.exchange.records)
            frag.optimizer.set(lr=lr, momentum=momentum)
            frag.optimizer.step(self.placement.to_backup(averaged))
            clock.lap("outer_step")
            self._pull(frag.globals, locals_, self.config.fragment_update_alpha)
        retry = (
            not committed and may_retry and self._group_agrees(vetoed is None and self.manager.errored() is not None)
        )
        if not committed:
            sync.exchange.rollback()  # e.g. error-feedback residuals of the dropped Δ
            clock.lap("outer_step")
            if not (sync.catching_up or retry):  # a catch-up round computed nothing locally: nothing to drop
                self._pull(frag.globals, locals_, 0.0)
        clock.lap("pull")
        seconds = sync.seconds + clock.total()
        record = SyncRecord(
            step=step,
            fragment=sync.fragment,
            committed=committed,
            participants=sync.quorum.size,
            contributors=None if exchange_failed else sync.exchange.contributors,
            quorum_id=sync.quorum.quorum_id,
            seconds=seconds,
            bytes_sent=sync.exchange.bytes_sent,
            bytes_received=sync.exchange.bytes_received,
            payload_bytes=sync.exchange.payload_bytes,
            numel=sum(g.numel() for g in frag.globals),
            dense_fp32_bytes=sync.exchange.dense_fp32_bytes,
            failure=None if committed else failure,
            sync=self.manager.current_step(),
            contributed=sync.contributes,
            retried=retry,
            healed_from=sync.quorum.healed_from,
            heal_failure=self._heal_failure_in(sync.quorum.quorum_id),
            peak_extra_bytes=sync.exchange.peak_extra_bytes,
            parts=_parts(sync, clock, seconds),
            outer_lr=lr,
            outer_momentum=momentum,
            feedback_beta=self.exchange.feedback_beta,
            tokens=sync.tokens,
            round_steps=sync.round_steps,
            progress=self.round.sync_progress(),
        )
        weights = sync.exchange.weights
        if weights is not None and not exchange_failed:
            record.weight, record.weights = weights[sync.exchange.rank], dict(enumerate(weights))
        if self.config.fingerprint:
            record.global_sha256 = self.fingerprint()
        self.records.append(record)
        self._count_failures(record)
        return record

    def _group_agrees(self, wants: bool) -> bool:
        """Whether any rank of this replica group wants it (all its ranks then do it): torchft agrees
        on "not committed" across a group's ranks, not on why, and each rank exchanges its own shard,
        so one rank's collective may have failed while another's finished. Called on every rank alike
        (every rank of a group sees the same commit decision)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return wants
        flag = torch.tensor([int(wants)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _heal_failure_in(self, quorum_id: int) -> str | None:
        return next((h.failure for h in self.heals if h.quorum_id == quorum_id and h.failure), None)

    def _outer_step_values(self, step: float) -> tuple[float, float]:
        """The outer lr and momentum of a sync performed at position ``step`` (the round mode's)."""
        return self.config.optimizer.values(self.lr_schedule.factor(step), self.momentum_schedule.factor(step))

    def _veto(self, exchange: PendingExchange, averaged: list[torch.Tensor]) -> str | None:
        """A reason to refuse this sync on every replica (they all hold the same average),
        reported to torchft so its commit vote fails; None if the sync may commit."""
        reason = None
        if exchange.contributors == 0:
            reason = "no replica contributed a pseudo-gradient"
        elif averaged and not bool(torch.stack(torch._foreach_norm(averaged)).sum().isfinite()):
            reason = (
                "the averaged pseudo-gradient is not finite (NaN/inf: a replica diverged; check the learning rates)"
            )
        if reason is not None:
            self.manager.report_error(RuntimeError(reason))
        return reason

    def _count_failures(self, record: SyncRecord) -> None:
        if record.retried:  # not a sync of its own: the next try counts
            return
        if record.committed:
            self._failures_in_a_row.clear()
            return
        self._failures_in_a_row.append(f"step {record.step}: {record.failure}")
        if 0 <= self.max_commit_failures < len(self._failures_in_a_row):
            raise SyncsKeepFailing(
                f"{len(self._failures_in_a_row)} syncs in a row were not committed (limit "
                f"--fault_tolerance.max_commit_failures {self.max_commit_failures}); last: "
                f"{self._failures_in_a_row[-1]}"
            )

    def _pull(self, globals_: list[torch.Tensor], locals_: list[torch.Tensor], alpha: float) -> None:
        """θ_local ← θ_g + α·(θ_local − θ_g)."""
        self.placement.pull(locals_, globals_, alpha)

    # ------------------------------------------------------- around the loop
    def catch_up(self, step: int, *, wait_seconds: float) -> tuple[int, list[SyncRecord]]:
        """At the start of training: a replica group behind its peers heals before it trains.

        Behind means the lighthouse's last quorum stood at a later sync than this group's
        checkpoint, or at the same sync with a member still alive (it restarted, or joined
        late): that quorum began the sync after the checkpoint, so a peer has trained past it
        and may have committed it (one sync behind: the lighthouse learns of a commit only at
        the next quorum). Its own steps until the next sync would be thrown away by the heal,
        and its peers would wait for them. It joins the peers' next quorum right away instead
        (they wait for heartbeating groups), heals, and takes part in that sync's exchange
        without contributing. If the peers have finished (they served the heal from their
        end-of-run agreement, which has no exchange), it heals to their final state. A heal that
        fails (its source died while serving it) is tried again in the next quorum, up to
        ``HEAL_TRIES`` times, instead of training steps the next heal would throw away. Returns
        (trainer step afterwards, the records of the syncs performed now).
        """
        if self.coordinator.url is None:
            return step, []
        status = self.coordinator.status()
        mine = self.manager.current_step()
        ahead = status.max_step > mine or (status.max_step == mine and bool(status.alive_members_at(mine)))
        if not ahead:
            return step, []
        logger.info(
            f"this replica group is behind: its checkpoint is at sync {mine}, the last quorum was at "
            f"sync {status.max_step}"
            + (" with peers still running (they may have committed it)" if status.max_step == mine else "")
            + "; healing from a peer before training"
        )
        need = self.coordinator.quorum_size
        alive = self.coordinator.wait_for_groups(need, wait_seconds, "waiting for peers to heal from")
        if len(alive) < need:
            raise OutOfDateError(
                f"replica {self.replica_id} is out of date by at least {status.max_step - mine} sync(s): its "
                f"checkpoint is at sync {mine} (step {step}), its peers reached sync {status.max_step}, and only "
                f"{len(alive)} of the {need} replica groups needed for a quorum are running (waited "
                f"{wait_seconds:g}s). Nothing to heal from: its outputs are out of date; use a replica "
                "that finished."
            )
        records: list[SyncRecord] = []
        for attempt in range(1, HEAL_TRIES + 1):
            started = time.perf_counter()
            before = self.manager.current_step()
            view, step = self._meet(step, "start")
            if self._healed_to is not None and self._source_phase == "end":
                return step, records  # the peers are done: their final state is ours now, no exchange
            self._start_exchange(view, started, step, contributes=False, catching_up=self._healed_to is None)
            if self._healed_to is not None:
                if self.round.perform_due(step):
                    records.append(self._perform(step))
                return step, records
            failed = self._heal_failure_in(view.quorum_id)
            retry = failed is not None and attempt < HEAL_TRIES  # still behind: heal in the next quorum
            why = failed or (
                f"no replica group in quorum {view.quorum_id} stood past sync {before}"
                if view.max_step <= before
                else f"quorum {view.quorum_id} stood at sync {view.max_step} and healed nobody"
            )
            then = (
                f"healing again in the next quorum (try {attempt + 1} of {HEAL_TRIES})"
                if retry
                else f"then training from step {step}"
            )
            logger.warning(f"{why}; taking part in quorum {view.quorum_id}'s sync without contributing, {then}")
            records.append(self._perform(step))
            if not retry:
                break
        return step, records

    def finish(self, *, wait_seconds: float, step: int) -> bool:
        """After the last step: meet the other groups until all of them stand at the same sync.

        Every group that finishes takes part in exchange-free quorums in which a group
        whose last sync failed, or that restarted late, heals to the final state; they all
        stop once a quorum of every group finds nobody behind, or after ``wait_seconds``.
        Returns True if this group healed (its θ_g changed after its last validation).
        """
        k = self.coordinator.group_size
        if self.coordinator.url is None or k <= 1:
            return False
        until = time.monotonic() + wait_seconds
        healed = False
        while True:
            remaining = until - time.monotonic()
            try:
                view, step = self._meet(step, "end", timeout=max(1.0, remaining))
            except CoordinationError as err:
                logger.warning(f"stopping without meeting every replica group again: {err}")
                return healed
            healed |= self._healed_to is not None
            if view.size >= k and view.settled:
                logger.info(f"all {k} replica groups stand at sync {view.max_step}")
                return healed
            if time.monotonic() >= until:
                missing = sorted(set(range(k)) - set(view.groups))
                logger.warning(
                    f"replica groups {missing} did not come back within {wait_seconds:g}s of the end of "
                    f"training (--fault_tolerance.end_wait_seconds); those that return later are out of date"
                    if missing
                    else "some replica groups were still behind at the end (see their logs)"
                )
                return healed
            time.sleep(0.5)

    def start_from_model(self) -> None:
        """θ_g ← θ before the first step: θ_g was copied when the loop was built, and a run may
        load its model afterwards (``--checkpoint.initial_load_path``, e.g. a Hugging Face folder)."""
        with torch.no_grad():
            for frag in self.fragments:
                for g, local in zip(frag.globals, frag.locals()):
                    g.copy_(local)

    def fingerprint(self) -> str:
        """SHA-256 over the bytes of θ_g (all fragments, this rank's shards)."""
        h = hashlib.sha256()
        for frag in self.fragments:
            for g in frag.globals:
                h.update(g.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # --------------------------------------------------------------- evaluation
    @contextlib.contextmanager
    def global_params(self):
        """Swap θ_g into the model for the duration (validation of the global model)."""
        saved = []
        with torch.no_grad():
            for frag in self.fragments:
                locals_ = frag.locals()
                saved.extend(torch._foreach_mul(locals_, 1.0))  # copies
                self.placement.pull(locals_, frag.globals, 0.0)
        try:
            yield
        finally:
            with torch.no_grad():
                locals_ = [t for frag in self.fragments for t in frag.locals()]
                torch._foreach_copy_(locals_, saved)

    # -------------------------------------------------------------------- state
    def state_dict(self, *, with_exchange: bool = True) -> dict[str, Any]:
        """θ_g, outer momentum and the torchft step; the exchange's replica-local state
        (error feedback) only for this replica's own checkpoint."""
        state: dict[str, Any] = {f"fragment_{i}": f.state_dict() for i, f in enumerate(self.fragments)}
        state["torchft"] = dict(self.manager.state_dict())
        rounds = self.round.state_dict()  # what the round mode agreed (deadline: paces, progress, budgets)
        if rounds:
            state["rounds"] = rounds
        if with_exchange:
            state["exchange"] = self.exchange.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, f in enumerate(self.fragments):
            f.load_state_dict(state[f"fragment_{i}"])
        self.manager.load_state_dict({k: int(v) for k, v in state["torchft"].items()})
        self.round.load_state_dict(state.get("rounds", {}))
        if "exchange" in state:
            self.exchange.load_state_dict(state["exchange"])

    def healing_state_dict(self) -> dict[str, Any]:
        """What a healing peer receives: θ_g, outer momentum, the torchft step, and the phase of the
        quorum serving it (a peer healing inside an exchange must take part in it)."""
        return {**self.state_dict(with_exchange=False), "phase": self._meeting}

    def load_healing_state_dict(self, state: dict[str, Any], *, step: int, received_bytes: int = 0) -> None:
        """State received from a peer: never its exchange state, and ours is reset.
        ``step`` is the trainer step that came with it (the peer's); ``received_bytes`` the size
        of everything that came with it (model, optimizers, θ_g), for the summary."""
        for i, f in enumerate(self.fragments):
            f.load_state_dict(state[f"fragment_{i}"])
        self.round.load_state_dict(state.get("rounds", {}))
        self.exchange.reset()
        self._source_phase = state.get("phase")
        self._healed_to = step
        self._heal_bytes = received_bytes

    # ------------------------------------------------------------------ summary
    def summary(self, steps: int) -> dict[str, Any]:
        """What this replica group took part in. A heal outside an exchange (before training,
        when its peers had finished, or in the end-of-run agreement) counts as a committed sync:
        the group took that sync's θ_g from a peer in a quorum, as a late member of it."""
        recs = self.records  # every attempt: their bytes and seconds were spent
        syncs = [r for r in recs if not r.retried]
        committed = [r for r in syncs if r.committed]
        in_a_sync = {r.quorum_id for r in recs}
        heals_alone = [h for h in self.heals if h.quorum_id not in in_a_sync and h.failure is None]
        seconds = [r.seconds for r in recs]
        return {
            "syncs": len(syncs) + len(heals_alone),
            "syncs_committed": len(committed) + len(heals_alone),
            "syncs_failed": len(syncs) - len(committed),
            "syncs_retried": len(recs) - len(syncs),
            "syncs_missed": sum(h.missed for h in self.heals),
            "final_sync": self.manager.current_step(),
            "heals": sum(h.failure is None for h in self.heals),
            "heals_failed": sum(h.failure is not None for h in self.heals),
            "heal_log": [asdict(h) for h in self.heals],
            "heal_bytes_received": sum(h.bytes_received for h in self.heals),
            "sync_seconds_total": sum(seconds),
            "sync_seconds_mean": sum(seconds) / (len(syncs) or len(recs))
            if recs
            else None,  # a sync's tries are its time
            "sync_seconds_by_part": {part: sum(r.parts.get(part, 0.0) for r in recs) for part in PARTS},
            "cut_off_seconds": self.cut_off_seconds,
            "sync_peak_extra_bytes": max((r.peak_extra_bytes for r in recs), default=0),
            "bytes_sent": sum(r.bytes_sent for r in recs),
            "bytes_received": sum(r.bytes_received for r in recs),
            "payload_bits_per_parameter": 8 * sum(r.payload_bytes for r in recs) / max(1, sum(r.numel for r in recs)),
            "dense_fp32_exchange_bytes": sum(r.dense_fp32_bytes for r in recs),
            "reduction_vs_dense_fp32": (
                sum(r.dense_fp32_bytes for r in recs) / sum(r.bytes_sent for r in recs)
                if sum(r.bytes_sent for r in recs)
                else None
            ),  # None: K=1, nothing sent
            "healed_from": sorted(
                {h.peer for h in self.heals if h.peer is not None and h.failure is None}
                | {r.healed_from for r in recs if r.healed_from is not None}
            ),
            "final_global_sha256": self.fingerprint(),
            "exchange": self.exchange.describe(),
            "link": self.config.link.describe() if self.config.link.enabled else None,
            "per_step_fp32_allreduce_bytes": steps * self.num_params * 4,
            "outer_parameters": self.num_params,
            "round": self.round.describe(steps),
        }
