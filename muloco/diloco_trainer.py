"""The DiLoCo trainer: torchtitan's FaultTolerantTrainer with muloco's outer loop.

One process per rank of a replica group; the groups find each other through a
torchft lighthouse. Inner steps are ordinary torchtitan steps inside the group;
after each one the :class:`~muloco.outer.OuterLoop` decides whether a fragment is
synced across groups. torchtitan's own ``maybe_semi_sync_training`` stays off
(``fault_tolerance.semi_sync_method`` is None): it would hard-code the outer
optimizer and stack torchft's DiLoCo on top of ours.

Healing: a replica that starts late or restarts receives, at its first sync, the
model, inner optimizer, LR schedule, step counters, θ_g, outer momentum and torchft
step of a healthy peer (never the peer's error-feedback state).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from torchtitan.components.checkpoint import ModelWrapper
from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
from torchtitan.tools.logging import logger

from muloco.checkpoint import ReplicaCheckpointManager
from muloco.outer import OuterLoop
from muloco.outer.loop import CoordinationError
from muloco.outer.manager import ReplicaGroupError, ReplicaGroupManager, wait_for_replica_groups
from muloco.trainer import MulocoTrainer, MulocoTrainerMixin

HEALING_KEY = "muloco"


class DilocoTrainer(MulocoTrainerMixin, FaultTolerantTrainer):
    @dataclass(kw_only=True, slots=True)
    class Config(MulocoTrainer.Config):
        fault_tolerance: ReplicaGroupManager.Config = field(default_factory=ReplicaGroupManager.Config)
        """Replica group membership: id, number of groups, lighthouse, timeouts."""
        outer: OuterLoop.Config = field(default_factory=OuterLoop.Config)
        """DiLoCo outer loop: H, fragments, τ, α, outer optimizer, exchange."""
        checkpoint: ReplicaCheckpointManager.Config = field(default_factory=ReplicaCheckpointManager.Config)

    outer: OuterLoop

    def __init__(self, config: Config):
        self._resolve(config)
        config.dump_folder = os.path.join(config.dump_folder, f"replica_{config.fault_tolerance.replica_id}")
        super().__init__(config)
        manager = self.ft_manager.manager
        logging.getLogger("torchft").setLevel(logging.WARNING)  # per-sync INFO lines; ours say it once
        self.outer = config.outer.build(
            model=self.model_parts[0], manager=manager, device=self.device, replica_id=config.fault_tolerance.replica_id
        )
        if self.checkpointer.enable:
            self.checkpointer.states["outer"] = self.outer
        self._model_state = ModelWrapper(self.model_parts)  # healing works with checkpoints off too
        manager.register_state_dict_fn(HEALING_KEY, self._load_healing_state, self._healing_state)
        if config.validator.enable:
            self.validator.evaluate_with(self.outer.global_params, self.outer.validation_due)
            self._validate_on_the_same_data_as_peers()
        self._log_start()
        s = self.outer.schedule
        logger.info(
            f"DiLoCo replica {config.fault_tolerance.replica_id} of {config.fault_tolerance.group_size}: "
            f"H={s.sync_every}, {s.num_fragments} fragment(s) every {s.interval} steps, "
            f"τ={s.delay}, α={config.outer.fragment_update_alpha}, outer {config.outer.optimizer.name} "
            f"lr={config.outer.optimizer.lr} momentum={config.outer.optimizer.momentum}"
        )

    def _validate_on_the_same_data_as_peers(self) -> None:
        """All replica groups validate θ_g on the same held-out batches, so they report the
        same validation loss (torchtitan's FT trainer would shard validation across groups)."""
        pd = self.parallel_dims
        if pd.dp_enabled:
            mesh = pd.get_mesh("batch")
            self.validator.dp_world_size, self.validator.dp_rank = mesh.size(), mesh.get_local_rank()
        else:
            self.validator.dp_world_size, self.validator.dp_rank = 1, 0

    # -------------------------------------------------------------- healing
    def _healing_state(self) -> dict[str, Any]:
        return {
            "model": self._model_state.state_dict(),
            "optimizer": self.optimizers.state_dict(),
            "lr_scheduler": self.lr_schedulers.state_dict(),
            "train_state": self.state_dict(),
            "outer": self.outer.healing_state_dict(),
        }

    def _load_healing_state(self, state: dict[str, Any]) -> None:
        before = self.step
        self._model_state.load_state_dict(state["model"])
        self.optimizers.load_state_dict(state["optimizer"])
        self.lr_schedulers.load_state_dict(state["lr_scheduler"])
        self.load_state_dict(state["train_state"])
        self.outer.load_healing_state_dict(state["outer"])
        logger.info(f"healed from a peer: step {before} -> {self.step}")

    # ----------------------------------------------------------------- loop
    def _on_loop_start(self) -> None:
        super()._on_loop_start()
        ft = self.config.fault_tolerance
        if ft.start_wait_seconds > 0 and ft.group_size > 1:
            wait_for_replica_groups(ft.lighthouse_url(), ft.group_size, ft.start_wait_seconds)

    def train_step(self, data_iterator):
        super().train_step(data_iterator)
        try:
            record = self.outer.after_inner_step(self.step)
        except CoordinationError as err:  # lighthouse gone, quorum timeout
            raise ReplicaGroupError(self._quorum_failure(err)) from err
        if record is not None:
            self.metrics_processor.log_sync({**asdict(record), "bits_per_parameter": record.bits_per_parameter},
                                            record.step)

    def _quorum_failure(self, err: BaseException) -> str:
        ft = self.config.fault_tolerance
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return (
            f"replica {ft.replica_id} lost its quorum at step {self.step}: {first}. "
            f"The torchft lighthouse ({ft.lighthouse_url()}) may be down or unreachable, or no peer "
            f"joined within {ft.quorum_timeout_seconds:g}s "
            "(--fault_tolerance.quorum_timeout_seconds). Restart the job; it resumes from the last checkpoint."
        )

    def train(self):
        try:
            super().train()
        finally:
            self.ft_manager.manager.shutdown(wait=False)

    def _summarize(self, wall_seconds: float) -> dict[str, Any]:
        summary = super()._summarize(wall_seconds)
        outer = self.outer.summary(self.step)
        outer["replica_id"] = self.config.fault_tolerance.replica_id
        outer["sync_share_of_wall_time"] = outer["sync_seconds_total"] / wall_seconds if wall_seconds else None
        summary["diloco"] = outer
        return summary

    def _report(self, s: dict[str, Any]) -> None:
        super()._report(s)
        d = s["diloco"]
        mb = 1e6
        logger.info(
            f"DiLoCo replica {d['replica_id']}: syncs committed {d['syncs_committed']}/{d['syncs']}, "
            f"sync time {d['sync_seconds_total']:.1f}s ({100 * (d['sync_share_of_wall_time'] or 0):.1f}% of wall), "
            f"bytes sent {d['bytes_sent'] / mb:,.1f}MB received {d['bytes_received'] / mb:,.1f}MB; "
            f"a per-step fp32 all-reduce would have sent {d['per_step_fp32_allreduce_bytes'] / mb:,.1f}MB "
            f"({d['per_step_fp32_allreduce_bytes'] / max(1, d['bytes_sent']):,.0f}x more)"
        )
        logger.info(
            f"DiLoCo replica {d['replica_id']}: exchange {d['exchange']}: "
            f"{d['payload_bits_per_parameter']:.2f} bits per parameter (dense fp32: 32); "
            + (f"{d['reduction_vs_dense_fp32']:,.1f}x fewer bytes sent than a dense fp32 exchange "
               f"({d['dense_fp32_exchange_bytes'] / mb:,.1f}MB)" if d["reduction_vs_dense_fp32"] else "nothing sent (K=1)")
        )
