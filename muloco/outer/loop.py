"""DiLoCo's outer loop on a torchft Manager: global parameters, syncs, commit, rollback.

Per replica group: θ_g (per fragment, on the backup device) and one outer optimizer
per fragment. After inner step t the trainer calls :meth:`after_inner_step`:

- prepare (t ≡ −τ mod H/P): quorum (a late or restarted replica heals here from a
  peer: model, inner optimizer, schedule, θ_g, outer momentum, torchft step), pick
  the fragment from the torchft step, Δ = θ_g − θ_local, start the exchange;
- perform (τ steps later): wait for the average, ``should_commit()``; on commit the
  outer optimizer steps θ_g and θ_local ← θ_g + α·(θ_local − θ_g); on a failed
  commit θ_g is untouched and θ_local ← θ_g (the round's local progress is dropped,
  no partial average is ever applied).

Validation uses θ_g (:meth:`global_params`), never a replica's drifting local model.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.config import Configurable
from torchtitan.tools.logging import logger

from muloco.outer.exchange import Exchange, PendingExchange
from muloco.outer.optimizer import OuterOptimizer
from muloco.outer.schedule import SyncSchedule, model_fragments


def _drill_kill_in_exchange(replica_id: int, step: int) -> None:
    """Fault drill: SIGKILL this process after it joined the quorum, before it sends.

    ``MULOCO_DRILL_KILL_IN_EXCHANGE=R:N`` makes replica group R die inside the sync it
    prepares at step N, so its peers are left with an exchange that cannot complete
    (the case a random kill rarely hits). Unset in normal runs.
    """
    drill = os.environ.get("MULOCO_DRILL_KILL_IN_EXCHANGE")
    if drill and drill == f"{replica_id}:{step}":
        logger.warning(f"fault drill: killing replica {replica_id} inside the exchange at step {step}")
        os.kill(os.getpid(), signal.SIGKILL)


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (its shard under FSDP): replicas exchange shards rank by rank."""
    return p.to_local() if isinstance(p, DTensor) else p


class CoordinationError(RuntimeError):
    """A torchft quorum or commit call failed (lighthouse gone, no quorum in time)."""


@contextlib.contextmanager
def coordination():
    """Mark failures of the quorum/commit calls, so the trainer can explain them as a lost
    lighthouse or quorum while any other error surfaces as what it is."""
    try:
        yield
    except Exception as err:
        raise CoordinationError(str(err)) from err


@dataclass
class SyncRecord:
    step: int
    fragment: int
    committed: bool
    participants: int
    contributors: int
    quorum_id: int
    seconds: float
    """Time this replica was blocked by the sync (prepare + perform, not the overlapped steps)."""
    bytes_sent: float
    bytes_received: float
    payload_bytes: int = 0
    """This replica's encoded Δ (what compression produced), flag bytes included."""
    numel: int = 0
    """Elements of the synced fragment on this rank."""
    dense_fp32_bytes: float = 0
    """What a dense fp32 ring all-reduce of this Δ would have sent."""
    global_sha256: str | None = None

    @property
    def bits_per_parameter(self) -> float:
        return 8.0 * self.payload_bytes / max(self.numel, 1)


@dataclass
class _Open:
    fragment: int
    exchange: PendingExchange
    seconds: float
    participants: int
    quorum_id: int


class _Fragment:
    """θ_g and the outer optimizer for one slice of the model."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], device: torch.device, opt: OuterOptimizer.Config):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.globals = [_local(p).detach().to(device, copy=True, dtype=torch.float32) for p in self.params]
        self.optimizer = opt.build(params=self.globals)

    def locals(self) -> list[torch.Tensor]:
        return [_local(p) for p in self.params]

    def _wrap(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Name → tensor, as DTensors shaped like the parameters so DCP saves shards correctly."""
        out = {}
        for name, p, t in zip(self.names, self.params, tensors):
            if isinstance(p, DTensor):
                t = DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            out[name] = t
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"global": self._wrap(self.globals), "momentum": self._wrap(self.optimizer.momentum)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, tensors in (("global", self.globals), ("momentum", self.optimizer.momentum)):
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
        backup_device: str = "cpu"
        """Where θ_g and the outer momentum live: cpu (saves accelerator memory) or device."""
        optimizer: OuterOptimizer.Config = field(default_factory=OuterOptimizer.Config)
        exchange: Exchange.Config = field(default_factory=Exchange.Config)

        def schedule(self) -> SyncSchedule:
            return SyncSchedule(self.sync_every, self.num_fragments, self.fragment_sync_delay)

        def validate(self) -> None:
            self.schedule()
            self.optimizer.validate()
            self.exchange.validate()
            if not 0.0 <= self.fragment_update_alpha <= 1.0:
                raise ValueError(
                    f"outer.fragment_update_alpha must be in [0, 1], got {self.fragment_update_alpha}"
                )
            if self.backup_device not in ("cpu", "device"):
                raise ValueError(f"outer.backup_device must be cpu or device, got {self.backup_device!r}")

    def __init__(
        self, config: Config, *, model: nn.Module, manager: Any, device: torch.device, replica_id: int = 0
    ):
        config.validate()
        self.replica_id = replica_id
        self.config = config
        self.manager = manager
        self.schedule = config.schedule()
        self.device = device
        backup = torch.device("cpu") if config.backup_device == "cpu" else device
        self.fragments = [_Fragment(f, backup, config.optimizer) for f in model_fragments(model, config.num_fragments)]
        self.exchange = config.exchange.build()
        for frag in self.fragments:
            self.exchange.allocate(frag.names, frag.locals())
        self.records: list[SyncRecord] = []
        self._open: _Open | None = None
        self._healed = False
        self.num_params = sum(t.numel() for f in self.fragments for t in f.globals)

    # ----------------------------------------------------------------- schedule
    def after_inner_step(self, step: int) -> SyncRecord | None:
        if self.schedule.prepare_due(step):
            self._prepare(step)
        if self.schedule.perform_due(step):
            return self._perform(step)
        return None

    @torch.no_grad()
    def _prepare(self, step: int) -> None:
        started = time.perf_counter()
        self._healed = False
        with coordination():
            self.manager.start_quorum()  # heals this replica from a peer if it is behind
        contributes = not self._healed
        _drill_kill_in_exchange(self.replica_id, step)
        index = self.manager.current_step() % len(self.fragments)
        frag = self.fragments[index]
        deltas = [g.to(self.device) - l for g, l in zip(frag.globals, frag.locals())]
        pending = self.exchange.start(self.manager, frag.names, deltas, contributes)
        self._open = _Open(
            fragment=index,
            exchange=pending,
            seconds=time.perf_counter() - started,
            participants=self.manager.num_participants(),
            quorum_id=getattr(self.manager, "_quorum_id", -1),
        )

    @torch.no_grad()
    def _perform(self, step: int) -> SyncRecord:
        assert self._open is not None, "perform without prepare"
        started = time.perf_counter()
        sync, self._open = self._open, None
        frag = self.fragments[sync.fragment]
        averaged = sync.exchange.wait()
        with coordination():
            committed = self.manager.should_commit()
        locals_ = frag.locals()
        if committed:
            backup = frag.globals[0].device
            frag.optimizer.step([a.to(backup) for a in averaged])
            self._pull(frag.globals, locals_, self.config.fragment_update_alpha)
        else:
            sync.exchange.rollback()  # e.g. error-feedback residuals of the dropped Δ
            self._pull(frag.globals, locals_, 0.0)
        record = SyncRecord(
            step=step,
            fragment=sync.fragment,
            committed=committed,
            participants=sync.participants,
            contributors=sync.exchange.contributors,
            quorum_id=sync.quorum_id,
            seconds=sync.seconds + time.perf_counter() - started,
            bytes_sent=sync.exchange.bytes_sent,
            bytes_received=sync.exchange.bytes_received,
            payload_bytes=sync.exchange.payload_bytes,
            numel=sum(g.numel() for g in frag.globals),
            dense_fp32_bytes=sync.exchange.dense_fp32_bytes,
        )
        if self.config.fingerprint:
            record.global_sha256 = self.fingerprint()
        self.records.append(record)
        return record

    def _pull(self, globals_: list[torch.Tensor], locals_: list[torch.Tensor], alpha: float) -> None:
        """θ_local ← θ_g + α·(θ_local − θ_g)."""
        if alpha == 0.0:
            for l, g in zip(locals_, globals_):
                l.copy_(g)
            return
        for l, g in zip(locals_, globals_):
            l.lerp_(g.to(l.device, l.dtype), 1.0 - alpha)

    def fingerprint(self) -> str:
        """SHA-256 over the bytes of θ_g (all fragments, this rank's shards)."""
        h = hashlib.sha256()
        for frag in self.fragments:
            for g in frag.globals:
                h.update(g.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    # --------------------------------------------------------------- evaluation
    def validation_due(self, step: int, freq: int) -> bool:
        """At a full-round sync boundary, once per ``freq`` inner steps."""
        h = self.config.sync_every
        return self.schedule.round_complete(step) and step // freq > (step - h) // freq

    @contextlib.contextmanager
    def global_params(self):
        """Swap θ_g into the model for the duration (validation of the global model)."""
        saved = []
        with torch.no_grad():
            for frag in self.fragments:
                for l, g in zip(frag.locals(), frag.globals):
                    saved.append(l.clone())
                    l.copy_(g)
        try:
            yield
        finally:
            with torch.no_grad():
                it = iter(saved)
                for frag in self.fragments:
                    for l in frag.locals():
                        l.copy_(next(it))

    # -------------------------------------------------------------------- state
    def state_dict(self, *, with_exchange: bool = True) -> dict[str, Any]:
        """θ_g, outer momentum and the torchft step; the exchange's replica-local state
        (error feedback) only for this replica's own checkpoint."""
        state: dict[str, Any] = {f"fragment_{i}": f.state_dict() for i, f in enumerate(self.fragments)}
        state["torchft"] = dict(self.manager.state_dict())
        if with_exchange:
            state["exchange"] = self.exchange.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, f in enumerate(self.fragments):
            f.load_state_dict(state[f"fragment_{i}"])
        self.manager.load_state_dict({k: int(v) for k, v in state["torchft"].items()})
        if "exchange" in state:
            self.exchange.load_state_dict(state["exchange"])

    def healing_state_dict(self) -> dict[str, Any]:
        return self.state_dict(with_exchange=False)

    def load_healing_state_dict(self, state: dict[str, Any]) -> None:
        """State received from a peer: never its exchange state, and ours is reset."""
        for i, f in enumerate(self.fragments):
            f.load_state_dict(state[f"fragment_{i}"])
        self.exchange.reset()
        self._healed = True

    # ------------------------------------------------------------------ summary
    def summary(self, steps: int) -> dict[str, Any]:
        recs = self.records
        committed = [r for r in recs if r.committed]
        seconds = [r.seconds for r in recs]
        return {
            "syncs": len(recs),
            "syncs_committed": len(committed),
            "syncs_failed": len(recs) - len(committed),
            "sync_seconds_total": sum(seconds),
            "sync_seconds_mean": sum(seconds) / len(seconds) if seconds else None,
            "bytes_sent": sum(r.bytes_sent for r in recs),
            "bytes_received": sum(r.bytes_received for r in recs),
            "payload_bits_per_parameter": 8 * sum(r.payload_bytes for r in recs) / max(1, sum(r.numel for r in recs)),
            "dense_fp32_exchange_bytes": sum(r.dense_fp32_bytes for r in recs),
            "reduction_vs_dense_fp32": (sum(r.dense_fp32_bytes for r in recs) / sum(r.bytes_sent for r in recs)
                                        if sum(r.bytes_sent for r in recs) else None),  # None: K=1, nothing sent
            "exchange": self.exchange.describe(),
            "per_step_fp32_allreduce_bytes": steps * self.num_params * 4,
            "outer_parameters": self.num_params,
        }
