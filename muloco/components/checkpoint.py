"""torchtitan's DCP checkpointing, with a completeness mark, verification and one clear error.

Loading goes through ``muloco.compat.checkpoint_safety`` (no arbitrary unpickling).
Every finished save is sealed with a checksum manifest (:mod:`muloco.runs.manifest`);
a step folder without one is incomplete (its save never finished) and is skipped when
resuming from the latest checkpoint, and one whose bytes changed is refused before DCP
reads it. ``keep_latest_k`` counts complete checkpoints, the last one included. When
a checkpoint cannot be used the user gets the folder or file, the cause and the fix
instead of a DCP traceback from deep inside a collective.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from muloco.runs import manifest
from muloco.runs.facts import RUN_FILE  # noqa: F401 - where a run folder's command and facts are
from muloco.utils.errors import BadCheckpoint
from muloco.utils.values import require_steps_or_fraction


class CheckpointLoadError(BadCheckpoint, RuntimeError):
    pass


FIX = (
    "Delete that step folder to resume from an earlier one, pick one with "
    "--checkpoint.load_step N, or start afresh with a new --dump_folder."
)
FIX_INITIAL = "Point --checkpoint.initial_load_path at an intact checkpoint, or leave it unset."


def _cause(err: BaseException) -> str:
    """The first underlying failure, not DCP's per-rank wrapper."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))
        if isinstance(err, tuple):  # (exception, traceback summary) per rank
            err = err[0]
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0].rstrip('.') if text else 'file ended early or is unreadable'}"


def run_folder(config) -> str:
    """Where this process writes: the dump folder, or its replica group's own
    ``replica_<id>/`` under it (as DilocoTrainer sets it) for a DiLoCo config."""
    if hasattr(config, "outer"):
        return os.path.join(config.dump_folder, f"replica_{config.fault_tolerance.replica_id}")
    return config.dump_folder


def checkpoint_folder(config) -> str:
    return os.path.join(run_folder(config), config.checkpoint.folder)


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) or "none"


def resolve_step(folder: str, step: int, *, warn: bool = True, flag: str = "--checkpoint.load_step") -> int:
    """The step to load from ``folder``: ``step`` itself if it is a complete checkpoint,
    or for ``step == -1`` the newest complete one (-1: none). Newer incomplete folders
    are skipped with one warning line; asking for a missing or incomplete step is an error
    that names the caller's own option, ``flag`` (a trainer's, or export's ``--step``)."""
    folders, complete = manifest.step_folders(folder), manifest.complete_steps(folder)
    if step >= 0:
        if step not in folders:
            raise CheckpointLoadError(
                f"checkpoint step {step} does not exist in {folder}; steps present: "
                f"{_steps_text(complete)}. Pick one with {flag} N, or leave it out to "
                "take the latest."
            )
        if step not in complete:
            raise CheckpointLoadError(
                f"checkpoint {folders[step]} is incomplete (no {manifest.MANIFEST}: its save did "
                f"not finish); complete steps: {_steps_text(complete)}. Pick one with "
                f"{flag} N, or delete that folder."
            )
        return step
    newest = complete[-1] if complete else -1
    skipped = sorted(s for s in folders if s > newest)
    if skipped and warn:
        then = f"resuming from step {newest}" if newest >= 0 else "starting from scratch"
        logger.warning(
            f"skipping incomplete checkpoint(s) {', '.join(f'step-{s}' for s in skipped)} in "
            f"{folder} (no {manifest.MANIFEST}: the save did not finish); {then}"
        )
    return newest


def verify_step(step_dir: str, fix: str = FIX) -> None:
    """CheckpointLoadError naming the file when the folder differs from its manifest; ``fix``: the
    caller's own way out (the trainer's by default)."""
    try:
        manifest.verify(step_dir)
    except manifest.CorruptCheckpoint as err:
        raise CheckpointLoadError(f"checkpoint {step_dir} is corrupt: {err}. {fix}") from None
    except OSError as err:
        raise CheckpointLoadError(f"checkpoint {step_dir} cannot be read: {err}. {fix}") from None


def check_metadata(checkpoint_id: str, fix: str = FIX) -> None:
    """Read DCP's ``.metadata`` (with the safe unpickler) before DCP does: when it is
    unreadable DCP falls back to per-rank metadata and logs both failures with their
    tracebacks on the root logger before it raises."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        FileSystemReader(checkpoint_id).read_metadata()
    except Exception as err:  # noqa: BLE001 - unpickling errors of every kind
        raise CheckpointLoadError(
            f"cannot load checkpoint '{checkpoint_id}': its .metadata is unreadable ({_cause(err)}). {fix}"
        ) from None


def check_initial_load_path(path: str) -> None:
    """An initial checkpoint may come from elsewhere without a manifest: verify it when it
    has one, and read its metadata when it is a DCP checkpoint."""
    if not os.path.isdir(path):
        raise CheckpointLoadError(
            f"checkpoint.initial_load_path {path} is not a folder; give the step folder of a "
            "checkpoint (.../checkpoint/step-N), or leave it unset."
        )
    if manifest.is_complete(path):
        verify_step(path)
    elif os.path.isfile(os.path.join(path, ".metadata")):
        check_metadata(path, FIX_INITIAL)


def loadable_step(folder: str, step: int, initial_load_path: str | None, *, warn: bool = True) -> int:
    """The step the checkpointer will load (-1: none), verified: it exists, it is complete
    and its files match their checksums; or, with no checkpoint in ``folder``, the
    initial checkpoint is usable."""
    step = resolve_step(folder, step, warn=warn)
    if step >= 0:
        verify_step(os.path.join(folder, f"step-{step}"))
    elif initial_load_path:
        check_initial_load_path(initial_load_path)
    return step


def check_loadable(config) -> int:
    """Preflight: what the checkpointer will load, checked before anything is built or
    written (verified files are remembered, so the load does not hash them again); the step
    the run resumes from (-1: none)."""
    ckpt = config.checkpoint
    if ckpt.enable:
        return loadable_step(checkpoint_folder(config), ckpt.load_step, ckpt.initial_load_path, warn=False)
    return -1


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _all_ranks(ok: bool) -> bool:
    """True when every rank of the group says ``ok``: a collective, so every rank must
    call it at the same point. Also a barrier (every rank has got this far)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    device = "cpu" if "gloo" in str(dist.get_backend()) else torch.accelerator.current_accelerator()
    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class MulocoCheckpointManager(CheckpointManager):
    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        initial_load_model_only: bool = False
        """Load only model weights from checkpoint.initial_load_path (fine-tuning)."""
        interval: int | float = 500
        """Steps between checkpoints, or a fraction of training.steps (0.1: every tenth of the run;
        a DiLoCo run rounds it to a whole number of syncs)."""

        def __post_init__(self) -> None:
            """torchtitan's checks but the interval's: a fraction of the run becomes steps before the
            run (:mod:`muloco.config.run_length`), and a bad value is ``validate()``'s one error."""
            interval = self.interval
            self.interval = 1
            try:
                CheckpointManager.Config.__post_init__(self)
            finally:
                self.interval = interval

        def validate(self) -> None:
            """Local folders (every checkpoint's manifest is verified before it loads), a positive
            interval, pinned-memory staging only where there is CUDA."""
            if not self.enable:
                return
            require_steps_or_fraction("checkpoint.interval", self.interval)
            if "://" in self.folder or "://" in (self.initial_load_path or ""):
                raise ValueError(
                    "checkpoint.folder and checkpoint.initial_load_path must be local folders: muloco "
                    "verifies a checksum manifest of every checkpoint before loading it; mount the "
                    "bucket, or copy the checkpoint to local storage."
                )
            if self.async_mode == "async_with_pinned_mem" and not torch.cuda.is_available():
                raise ValueError(
                    "checkpoint.async_mode 'async_with_pinned_mem' stages checkpoints in pinned "
                    "CUDA memory and there is no CUDA device here; use 'async' or 'disabled'."
                )

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self._seal_lock = threading.Lock()
        self._unsealed: str | None = None  # the step folder of an async save in flight

    # ------------------------------------------------------------------ load
    def _find_load_step(self, folder: str = "") -> int:
        """The newest *complete* checkpoint (torchtitan takes any folder with .metadata)."""
        complete = manifest.complete_steps(folder or self.folder)
        return complete[-1] if complete else -1

    def _checked_step(self, step: int) -> int:
        """Resolve and verify on every rank, then agree: no rank enters DCP's collective
        load while another has refused the checkpoint (that would hang the group)."""
        problem = None
        try:
            step = loadable_step(self.folder, step, self.initial_load_path)
        except CheckpointLoadError as err:
            problem = err
        if not _all_ranks(problem is None):
            raise problem or CheckpointLoadError(
                f"another rank of this group could not use the checkpoint in {self.folder}; see its log. {FIX}"
            )
        return step

    def _load(self, step: int = -1) -> bool:
        step = self._checked_step(step)
        try:
            return super()._load(step)
        except CheckpointLoadError:
            raise
        # DCP's CheckpointException derives from BaseException, not Exception.
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - re-raised with the fix
            if step >= 0:
                where, fix = self._create_checkpoint_id(step), FIX
            else:
                where, fix = self.initial_load_path or self.folder, FIX_INITIAL
            raise CheckpointLoadError(
                f"cannot load checkpoint '{where}': {_cause(err)}. It is corrupt, incomplete or "
                f"from an incompatible run. {fix}"
            ) from err

    def dcp_load(self, state_dict, checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        if not from_hf:
            check_metadata(checkpoint_id, FIX_INITIAL if checkpoint_id == self.initial_load_path else FIX)
        super().dcp_load(state_dict, checkpoint_id=checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)

    # ------------------------------------------------------------------ save
    def dcp_save(
        self,
        state_dict,
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ):
        manifest.discard_manifest(checkpoint_id)  # every rank, before any of them writes
        result = super().dcp_save(
            state_dict,
            checkpoint_id=checkpoint_id,
            async_mode=async_mode,
            enable_garbage_collection=enable_garbage_collection,
            to_hf=to_hf,
        )
        if async_mode == AsyncMode.DISABLED:
            self._seal_when_all_ranks_saved(checkpoint_id)
        else:
            self._seal_when_done(result, checkpoint_id)
        return result

    def _seal_when_all_ranks_saved(self, checkpoint_id: str) -> None:
        _all_ranks(True)  # under FSDP every rank writes its own files into the folder
        if _is_rank0():
            manifest.write_manifest(checkpoint_id)

    def _seal_when_done(self, result, checkpoint_id: str) -> None:
        """Async save: seal when it finishes (rank 0's future completes after every rank
        has written), and at the latest when torchtitan waits for it."""
        if not _is_rank0():
            return
        future = result.upload_completion if isinstance(result, AsyncSaveResponse) else result
        self._unsealed = checkpoint_id
        future.add_done_callback(lambda f: f.exception() is None and self._seal_async(checkpoint_id))

    def _seal_async(self, checkpoint_id: str | None = None) -> None:
        """Seal the async save in flight (only ``checkpoint_id``'s, when given), once."""
        with self._seal_lock:
            pending = self._unsealed
            if pending is not None and checkpoint_id in (None, pending):
                manifest.write_manifest(pending)
                self._unsealed = None

    def _wait_for_saving(self) -> None:
        super()._wait_for_saving()  # raises if the save failed: the folder stays incomplete
        self._seal_async()

    _force_save = False
    _saved_step: int | None = None
    due = None
    """``due(step, interval)``: whether to save after ``step``, for a trainer whose save points are not
    torchtitan's every ``interval`` steps (a DiLoCo trainer asks its round mode); None, or a ``due``
    that answers None: torchtitan's rule."""

    def save_now(self, step: int) -> bool:
        """A full, resumable checkpoint at ``step`` whatever the interval (a run stopped on
        request), written before this returns; False with checkpoints off or one already there."""
        if not self.enable or self.load_only:
            return False
        if step == self._saved_step or step in manifest.complete_steps(self.folder):
            self.maybe_wait_for_saving()  # saved at this step already (maybe still in flight), or loaded
            return False
        self._force_save = True
        try:
            saved = self.save(step)
        finally:
            self._force_save = False
        self.maybe_wait_for_saving()
        return saved

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        verdict = None if self.due is None else self.due(curr_step, self.interval)
        if self._force_save or verdict is None:
            return self._force_save or super()._should_save(curr_step, last_step)
        # saves where ``due`` says (deadline rounds: a group's step count says nothing of the run's end)
        return self.enable and not self.load_only and verdict

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        if saved:
            self._saved_step = curr_step
        if saved and last_step:  # torchtitan purges after interval saves only
            self._purge_stale_checkpoints()
        return saved

    def _purge_stale_checkpoints(self) -> None:
        """Keep the newest ``keep_latest_k`` complete checkpoints. Incomplete folders older
        than the newest complete one go too; newer ones may be a save in flight."""
        if not self._should_purge():
            return
        complete = manifest.complete_steps(self.folder)
        keep = set(complete[-self.keep_latest_k :])
        newest = complete[-1] if complete else -1
        for step, path in sorted(manifest.step_folders(self.folder).items()):
            if step not in keep and step < newest:
                self.purge_queue.put(path)


class ReplicaCheckpointManager(MulocoCheckpointManager):
    """One full checkpoint per replica group, in that replica's own folder.

    torchtitan's torchft checkpointer saves the model and optimizers from one replica
    only and the dataloader of every replica every step, and it does not save the
    outer loop. Replica groups differ in their inner optimizer state, data position
    and error-feedback residuals, so each saves everything it needs to continue
    exactly (the trainer points ``dump_folder`` at ``replica_<id>/``) and the outer
    loop's state (θ_g, outer momentum, torchft step) goes in as a state entry.
    Manifests, verification and purging work per replica folder, as above.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MulocoCheckpointManager.Config):
        pass

    def __init__(self, config: Config, *, ft_manager=None, **kwargs):
        super().__init__(config, **kwargs)
