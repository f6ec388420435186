"""torchtitan's DCP checkpointing with one clear error for an unreadable checkpoint.

Loading goes through ``muloco.compat.checkpoint_safety`` (no arbitrary unpickling).
When a checkpoint cannot be read the user gets the folder, the cause and the fix
instead of a DCP traceback from deep inside a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.checkpoint.api import CheckpointException
from torchtitan.components.checkpointer.dcp import CheckpointManager


class CheckpointLoadError(RuntimeError):
    pass


def _cause(err: BaseException) -> str:
    """The first underlying failure, not DCP's per-rank wrapper."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))
        if isinstance(err, tuple):  # (exception, traceback summary) per rank
            err = err[0]
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else 'file ended early or is unreadable'}"


class MulocoCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        initial_load_model_only: bool = False
        """Load only model weights from checkpoint.initial_load_path (fine-tuning)."""

    def _load(self, step: int = -1) -> bool:
        try:
            return super()._load(step)
        # DCP's CheckpointException derives from BaseException, not Exception.
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - re-raised with the fix
            found = self._find_load_step() if step == -1 else step
            where = self._create_checkpoint_id(found) if found >= 0 else self.folder
            raise CheckpointLoadError(
                f"cannot load checkpoint '{where}': {_cause(err)}. "
                "It is corrupt, incomplete or from an incompatible run. Delete that "
                "step folder to resume from an earlier one, pick one with "
                "--checkpoint.load_step N, or start afresh with a new --dump_folder."
            ) from err


class ReplicaCheckpointManager(MulocoCheckpointManager):
    """One full checkpoint per replica group, in that replica's own folder.

    torchtitan's torchft checkpointer saves the model and optimizers from one replica
    only and the dataloader of every replica every step, and it does not save the
    outer loop. Replica groups differ in their inner optimizer state, data position
    and error-feedback residuals, so each saves everything it needs to continue
    exactly (the trainer points ``dump_folder`` at ``replica_<id>/``) and the outer
    loop's state (θ_g, outer momentum, torchft step) goes in as a state entry.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MulocoCheckpointManager.Config):
        pass

    def __init__(self, config: Config, *, ft_manager=None, **kwargs):
        super().__init__(config, **kwargs)
