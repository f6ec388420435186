"""The DiLoCo trainer: torchtitan's FaultTolerantTrainer with muloco's outer loop.

One process per rank of a replica group; the groups find each other through a
torchft lighthouse. Inner steps are ordinary torchtitan steps inside the group;
after each one the :class:`~muloco.outer.OuterLoop` decides whether a fragment is
synced across groups. torchtitan's own ``maybe_semi_sync_training`` stays off
(``fault_tolerance.semi_sync_method`` is None): it would hard-code the outer
optimizer and stack torchft's DiLoCo on top of ours.

Healing: a replica that starts behind its peers (late, or restarted) joins their next
sync before it trains and receives from a healthy peer the model, inner optimizer, LR
schedule, step counters, θ_g, outer momentum and torchft step (never the peer's
error-feedback state). At the end every group waits until all of them stand at the same
sync, so they finish with the same θ_g (its hash is in the summary).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torchtitan.experiments.torchft.trainer as fault_tolerant_trainer
from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.tools.logging import logger

from muloco.compat import lone_rank_sleep
from muloco.compat.lr_position import set_position
from muloco.components.checkpoint import ReplicaCheckpointManager
from muloco.models.lora import frozen_keys
from muloco.outer import OuterLoop
from muloco.outer.coordinator import CoordinationError, Coordinator, OutOfDateError
from muloco.outer.loop import SyncRecord, SyncsKeepFailing
from muloco.outer.manager import ReplicaGroupError, ReplicaGroupManager, ReplicaOutOfDate
from muloco.runs.lives import Lives
from muloco.trainer import MulocoTrainer, MulocoTrainerMixin

lone_rank_sleep.apply(fault_tolerant_trainer)

HEALING_KEY = "muloco"


def _first_line(err: BaseException) -> str:
    """An error's first line (its type's name when it says nothing)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested state dict (what a heal brought over)."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class DilocoTrainer(MulocoTrainerMixin, fault_tolerant_trainer.FaultTolerantTrainer):
    @dataclass(kw_only=True, slots=True)
    class Config(MulocoTrainer.Config):
        fault_tolerance: ReplicaGroupManager.Config = field(default_factory=ReplicaGroupManager.Config)
        """Replica group membership: id, number of groups, lighthouse, timeouts."""
        outer: OuterLoop.Config = field(default_factory=OuterLoop.Config)
        """DiLoCo outer loop: H, fragments, τ, α, outer optimizer, exchange."""
        checkpoint: ReplicaCheckpointManager.Config = field(default_factory=ReplicaCheckpointManager.Config)

    outer: OuterLoop
    lives: Lives | None = None
    """This group's lives across restarts (``runs/lives.py``), on the rank that writes its summary."""

    def __init__(self, config: Config):
        self._resolve(config)
        config.dump_folder = os.path.join(config.dump_folder, f"replica_{config.fault_tolerance.replica_id}")
        super().__init__(config)
        self._build_objective()
        manager = self.ft_manager.manager
        logging.getLogger("torchft").setLevel(logging.WARNING)  # per-sync INFO lines; ours say it once
        ft = config.fault_tolerance
        coordinator = Coordinator(
            manager,
            lighthouse_url=ft.lighthouse_url(),
            group_size=ft.group_size,
            quorum_size=self.ft_manager.quorum_size,
            lost_timeout=ft.lost_seconds(),
            quorum_timeout=ft.quorum_timeout_seconds,
            device=self.device,
        )
        self.outer = config.outer.build(
            model=self.model_parts[0],
            manager=manager,
            device=self.device,
            replica_id=ft.replica_id,
            coordinator=coordinator,
            max_commit_failures=ft.max_commit_failures,
            sync_retries=ft.sync_retries,
            total_steps=config.lr_scheduler.total_steps or config.training.steps,
            inner_lr_factor=self.lr_schedulers.schedulers[0].lr_lambdas[0],
            run_steps=config.training.steps,
            groups=ft.group_size,
        )
        self.checkpointer.due = self.outer.round.checkpoint_due  # None: torchtitan's every-interval rule
        if config.outer.link.enabled:  # the step and summary figures include its waits: they say so
            self.metrics_processor.emulated_link = config.outer.link.describe()
        if self.checkpointer.enable:
            self.checkpointer.states["outer"] = self.outer
        self._model_state = ModelWrapper(self.model_parts)  # healing works with checkpoints off too
        manager.register_state_dict_fn(HEALING_KEY, self._load_healing_state, self._healing_state)
        if config.validator.enable:
            self.validator.evaluate_with(self.outer.global_params, self.outer.round.validation_due)
            self._validate_on_the_same_data_as_peers()
        self._log_start()
        s = self.outer.schedule
        logger.info(
            f"DiLoCo replica {config.fault_tolerance.replica_id} of {config.fault_tolerance.group_size}: "
            f"H={s.sync_every}, {s.num_fragments} fragment(s) every {s.interval} steps, "
            f"τ={s.delay}, α={config.outer.fragment_update_alpha}, outer {config.outer.optimizer.describe()}, "
            "schedules: "
            f"{config.outer.step_schedule.describe()}"
        )
        logger.info(self.outer.describe_memory())

    def _validate_on_the_same_data_as_peers(self) -> None:
        """All replica groups validate θ_g on the same held-out batches, so they report the
        same validation loss (torchtitan's FT trainer would shard validation across groups)."""
        pd = self.parallel_dims
        if pd.dp_enabled:
            mesh = pd.get_mesh("batch")
            self.validator.dp_world_size, self.validator.dp_rank = mesh.size(), mesh.get_local_rank()
        else:
            self.validator.dp_world_size, self.validator.dp_rank = 1, 0

    def _batch_ranks(self) -> int:
        """The group's data-parallel ranks: each trains a batch of its own."""
        return self.parallel_dims.get_mesh("batch").size() if self.parallel_dims.dp_enabled else 1

    # -------------------------------------------------------------- healing
    def _replica_index(self) -> int:
        return self.config.fault_tolerance.replica_id

    def _healing_state(self) -> dict[str, Any]:
        """What a healing peer receives. Frozen parameters (a LoRA run's base model) stay: every
        group loaded the same base and never changes it, and it never leaves a group."""
        frozen = frozen_keys(self.model_parts)
        return {
            "model": {k: v for k, v in self._model_state.state_dict().items() if k not in frozen},
            "optimizer": self.optimizers.state_dict(),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "train_state": self.state_dict(),
            "outer": self.outer.healing_state_dict(),
        }

    def _load_healing_state(self, state: dict[str, Any]) -> None:
        self._model_state.load_state_dict(state["model"])
        self.optimizers.load_state_dict(state["optimizer"])
        self.lr_schedulers.load_state_dict(state["lr_scheduler"])
        self.load_state_dict(state["train_state"])
        self.outer.load_healing_state_dict(state["outer"], step=self.step, received_bytes=_tensor_bytes(state))

    # ----------------------------------------------------------------- loop
    def _on_loop_start(self) -> None:
        super()._on_loop_start()
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            self.lives = Lives.begin(
                self.config.dump_folder, step=self.step, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            )
        if self.step == 0:  # after torchtitan's checkpoint load: an initial load changed the model
            self.outer.start_from_model()
        ft = self.config.fault_tolerance
        if ft.group_size <= 1:
            return
        with self._coordination_errors():
            if ft.start_wait_seconds > 0:
                seen = self.outer.coordinator.wait_for_groups(
                    ft.group_size, ft.start_wait_seconds, "waiting for replica groups"
                )
                if len(seen) < ft.group_size:
                    logger.warning(
                        f"only {len(seen)}/{ft.group_size} replica groups up after "
                        f"{ft.start_wait_seconds:g}s; starting anyway (the others heal from a peer "
                        "when they arrive)"
                    )
            before = self.step
            with self._logging_syncs():
                self.step, _ = self.outer.catch_up(self.step, wait_seconds=max(ft.start_wait_seconds, 1.0))
        if self.step != before:
            self.metrics_processor.begin(start_step=self.step, total_steps=self.config.training.steps)
        self._follow_round_schedule()  # a heal above may have moved the run: its first step's lr, and pace,
        self.outer.round.start_round()  # start here

    def train_step(self, data_iterator):
        before, started = self.ntokens_seen, time.perf_counter()  # its group's pace (a timed round mode)
        super().train_step(data_iterator)
        if self.lives is not None:  # the group's tokens: this rank's times the data-parallel ranks
            self.lives.trained(self.step, (self.ntokens_seen - before) * self._batch_ranks())
        with self._logging_syncs(), self._coordination_errors():
            self.outer.after_inner_step(self.step, tokens=self.ntokens_seen - before, started=started)
        self._follow_round_schedule()

    def _follow_round_schedule(self) -> None:
        """The next step's inner lr where the round mode places this group (deadline rounds: its place in
        the round, not its own step count, so every group sweeps the run's schedule at the same pace);
        a mode that places nothing leaves torchtitan's count."""
        position = self.outer.round.inner_position()
        if position is None:
            return
        for scheduler in self.lr_schedulers.schedulers:
            set_position(scheduler, position)

    def _steps_left(self) -> bool:
        """The round mode's answer (deadline rounds end the run on the shared progress)."""
        return self.outer.round.steps_left(super()._steps_left())

    def should_continue_training(self) -> bool:
        if super().should_continue_training():
            return True
        if not self.preempted and not getattr(self, "_finished", False):
            self._finished = True
            if self.outer.round.saves_at_end():  # its save points are its own, not torchtitan's last step
                self.checkpointer.save_now(self.step)
            self._meet_peers_at_the_end()
        return False

    def _stop_requested(self) -> bool:
        """Only at a sync boundary, where no exchange is in flight (the checkpoint holds θ_g and
        the outer state of a finished sync, as periodic checkpoints do), and the same boundary
        for every group of the job."""
        boundary = self.outer.round.boundary(self.step)
        return boundary is not None and self._stop.agreed_at_sync(*boundary) and self._can_stop()

    def _meet_peers_at_the_end(self) -> None:
        """Stay until every replica group stands at the same sync; re-validate and re-save if
        this group had to heal (its last sync failed, or it came back after the others ended)."""
        ft = self.config.fault_tolerance
        with self._logging_syncs(), self._coordination_errors():
            healed = self.outer.finish(wait_seconds=ft.end_wait_seconds, step=self.step)
        if healed:
            self.metrics_processor.last_validation_step = None  # θ_g changed: validate it again
            self.checkpointer.save(self.step, last_step=True)

    @contextlib.contextmanager
    def _logging_syncs(self):
        """Log every sync record the outer loop made meanwhile (a sync tried again makes one per
        try), also when it then fails: the tries before a lost quorum are in the metrics."""
        first, heals = len(self.outer.records), len(self.outer.heals)
        try:
            yield
        finally:
            records = self.outer.records[first:]
            for record in records:
                self._log_sync(record)
            self._count_in_lives(records, self.outer.heals[heals:])

    def _count_in_lives(self, records: list[SyncRecord], heals: list) -> None:
        """File the heals (each one once, wherever it happened: they come before the syncs they
        joined) and the syncs' outcomes (their last tries) in the ledger."""
        if self.lives is None:
            return
        for heal in heals:
            if heal.failure is None:
                self.lives.healed(heal.step_to)
        for record in records:
            if not record.retried:
                self.lives.synced(
                    sync=record.sync, step=record.step, committed=record.committed, contributed=record.contributed
                )

    def _log_sync(self, record: SyncRecord) -> None:
        fields = asdict(record)
        parts, weights = fields.pop("parts"), fields.pop("weights")  # flat rows: one number per key
        self.metrics_processor.log_sync(
            {
                **fields,
                "bits_per_parameter": record.bits_per_parameter,
                **{f"time_{part}": v for part, v in parts.items()},
                **{f"weight_{rank}": w for rank, w in weights.items()},
            },
            record.step,
        )

    @contextlib.contextmanager
    def _coordination_errors(self):
        """torchft and lighthouse failures become one clear ReplicaGroupError."""
        try:
            yield
        except CoordinationError as err:  # lighthouse gone, quorum timeout
            raise ReplicaGroupError(self._quorum_failure(err)) from err
        except OutOfDateError as err:
            raise ReplicaOutOfDate(str(err)) from err
        except SyncsKeepFailing as err:
            raise ReplicaGroupError(f"replica {self.config.fault_tolerance.replica_id}: {err}") from err

    def _quorum_failure(self, err: BaseException) -> str:
        ft = self.config.fault_tolerance
        first = _first_line(err)
        if "lighthouse at" in first:  # the watcher saw the lighthouse go away, or this group was cut off
            return (
                f"replica {ft.replica_id} lost its quorum at step {self.step}: {first}, after "
                f"{ft.lost_seconds():g}s (--fault_tolerance.lighthouse_lost_seconds; 0 = connect_timeout_seconds). "
                "This group cannot tell a lighthouse that is down from a link that is: if the other groups still "
                "train, restart only this group with its own command (the local launcher restarts it with "
                "--max-restarts; SLURM requeues its task) and it heals from its peers; if the lighthouse is down, "
                "restart it and every group: they resume from their last checkpoints."
            )
        return (
            f"replica {ft.replica_id} lost its quorum at step {self.step}: {first}. "
            f"No quorum of {self.ft_manager.quorum_size} of {ft.group_size} replica groups formed within "
            f"{ft.quorum_timeout_seconds:g}s (--fault_tolerance.quorum_timeout_seconds): peers died or hang, "
            "or the lighthouse lost them. Restart the job; it resumes from the last checkpoints."
        )

    def train(self):
        try:
            super().train()
        except BaseException as err:  # the ledger says how this life ended (a SIGKILL cannot)
            if self.lives is not None:
                self.lives.end(
                    f"stopped at step {self.step} (asked to; it resumes)"
                    if self.preempted
                    else f"failed at step {self.step}: {_first_line(err)}"
                )
            raise
        finally:
            self.ft_manager.manager.shutdown(wait=False)

    def _summarize(self, wall_seconds: float) -> dict[str, Any]:
        summary = super()._summarize(wall_seconds)
        outer = self.outer.summary(self.step)
        outer["replica_id"] = self.config.fault_tolerance.replica_id
        if self.lives is not None:
            self.lives.end("finished")
            outer["over_lives"] = self.lives.totals()
        outer["sync_share_of_wall_time"] = outer["sync_seconds_total"] / wall_seconds if wall_seconds else None
        summary["diloco"] = outer
        return summary

    def _train_loss_note(self) -> str:
        return (
            "; this group's own data and local model, so groups differ: the validation loss, of θ_g, "
            "is the one they share"
        )

    def _report(self, s: dict[str, Any]) -> None:
        super()._report(s)
        d = s["diloco"]
        mb = 1e6
        sent = d["bytes_sent"]
        logger.info(
            f"DiLoCo replica {d['replica_id']}: syncs committed {d['syncs_committed']}/{d['syncs']}"
            + (f" ({d['syncs_retried']} tried again in a fresh quorum)" if d.get("syncs_retried") else "")
            + (f" (missed {d['syncs_missed']} the others committed without it)" if d.get("syncs_missed") else "")
            + (f", cut off from the lighthouse {d['cut_off_seconds']:.1f}s" if d.get("cut_off_seconds") else "")
            + ", "
            f"sync time {d['sync_seconds_total']:.1f}s ({100 * (d['sync_share_of_wall_time'] or 0):.1f}% of wall"
            + (f"; includes the {d['link']}" if d.get("link") else "")
            + "), "
            f"bytes sent {sent / mb:,.1f}MB received {d['bytes_received'] / mb:,.1f}MB"
            + (
                f"; against DDP (an fp32 all-reduce of every step, {d['per_step_fp32_allreduce_bytes'] / mb:,.1f}MB): "
                f"{d['per_step_fp32_allreduce_bytes'] / sent:,.0f}x fewer bytes"
                if sent
                else " (one replica group: nothing to send)"
            )
        )
        total = d["sync_seconds_total"] or 0.0
        if total:
            parts = ", ".join(
                f"{'link (emulated)' if part == 'link' else part} {100 * sec / total:.0f}%"
                for part, sec in d["sync_seconds_by_part"].items()
                if sec / total >= 0.005
            )
            logger.info(
                f"DiLoCo replica {d['replica_id']}: sync time by part: {parts}; peak extra memory of a "
                f"sync {d['sync_peak_extra_bytes'] / mb:,.1f}MB"
            )
        if d.get("over_lives") and self.lives is not None:
            logger.info(f"DiLoCo replica {d['replica_id']}: {self.lives.describe()}")
        heals = ", ".join(
            f"{h['phase']}: from replica {h['peer']} to step {h['step_to']} (sync {h['sync']}, "
            f"{h['bytes_received'] / mb:,.1f}MB)"
            for h in d["heal_log"]
            if not h.get("failure")
        )
        failed = ", ".join(f"{h['phase']}: {h['failure']}" for h in d["heal_log"] if h.get("failure"))
        logger.info(
            f"DiLoCo replica {d['replica_id']}: final θ_g sha256 {d['final_global_sha256']} (sync "
            f"{d['final_sync']})"
            + (f"; healed {d['heals']}x: {heals}" if heals else "")
            + (f"; {d['heals_failed']} heal(s) failed: {failed}" if failed else "")
        )
        logger.info(
            f"DiLoCo replica {d['replica_id']}: exchange {d['exchange']}: "
            f"{d['payload_bits_per_parameter']:.2f} bits per parameter (dense fp32: 32); "
            + (
                f"against the same syncs sent dense in fp32 ({d['dense_fp32_exchange_bytes'] / mb:,.1f}MB): "
                f"{d['reduction_vs_dense_fp32']:,.1f}x fewer bytes"
                if d["reduction_vs_dense_fp32"]
                else "nothing sent (K=1)"
            )
        )
