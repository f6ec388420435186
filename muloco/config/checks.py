"""Checks that run before anything is built or written.

Each failure is one :class:`ConfigError` naming the key, the bad value and what is
allowed, so a bad run stops before it creates folders, logs or checkpoints.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Iterator

from muloco.utils import optional
from muloco.config.loader import ConfigError
from muloco.utils.created_dirs import make_dirs, missing_dirs, remove_dirs
from muloco.data.sources import HuggingFaceDataset, JsonlFiles
from muloco.sizing.flavors import UnknownFlavorError, parse_flavor


def _positive(key: str, value, what: str = "a positive number") -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{key} is {value!r}; it must be {what}.")


def _check_finite(config) -> None:
    """inf and nan pass range checks written as comparisons (``inf > 0``; nan compares
    false both ways, so ``not 0 <= nan < 1`` depends on how the test is spelt), and a
    run with an infinite learning rate dies many steps later on a non-finite loss.
    So every float setting is rejected here, before the range checks run."""
    from muloco.config.cli import valid_keys

    for key, value in valid_keys(config).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key} is {value!r}; it must be a finite number.")


def _regex_settings(config) -> Iterator[tuple[str, str]]:
    """Every setting that is compiled as a regular expression when the trainer is built."""
    yield "optimizer.muon_pattern", config.optimizer.muon_pattern
    for i, group in enumerate(config.optimizer.param_groups):
        yield f"optimizer.param_groups[{i}].pattern", group.pattern
    if hasattr(config, "outer"):
        yield "outer.exchange.skip_pattern", config.outer.exchange.skip_pattern


def _check_patterns(config) -> None:
    for key, pattern in _regex_settings(config):
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(
                f"{key} {pattern!r} is not a valid regular expression ({err}); "
                "fix it (escape literal characters such as '(' or '.' with a backslash)."
            ) from None


def _check_training(config) -> None:
    t = config.training
    _positive("training.seq_len", t.seq_len, "a positive integer")
    _positive("training.local_batch_size", t.local_batch_size, "a positive integer")
    _positive("training.steps", t.steps, "a positive integer")
    if t.global_batch_size != -1:
        _positive("training.global_batch_size", t.global_batch_size, "a positive integer or -1")
        if t.global_batch_size % t.local_batch_size:
            raise ConfigError(
                f"training.global_batch_size {t.global_batch_size} is not a multiple of "
                f"training.local_batch_size {t.local_batch_size}."
            )
    _positive("training.max_norm", t.max_norm)


def _check_optimizer(config) -> None:
    opt = config.optimizer
    lr = getattr(opt, "lr", None)
    if lr is not None:
        _positive("optimizer.lr", lr, "a positive learning rate (e.g. 3e-3)")
    for key in ("beta1", "beta2"):
        value = getattr(opt, key, None)
        if value is not None and not 0 <= value < 1:
            raise ConfigError(f"optimizer.{key} is {value!r}; it must be in [0, 1).")
    wd = getattr(opt, "weight_decay", 0.0)
    if wd < 0:
        raise ConfigError(f"optimizer.weight_decay is {wd!r}; it must be >= 0.")
    if config.lr_scheduler.warmup_steps < 0:
        raise ConfigError("lr_scheduler.warmup_steps must be >= 0.")


def _check_model(config) -> None:
    from muloco.models import Architecture, hf_folder

    if hf_folder(config.model.flavor) is None:
        try:
            parse_flavor(config.model.flavor)
        except UnknownFlavorError as err:
            raise ConfigError(str(err)) from None
        return
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    try:
        arch = Architecture.of_flavor(config.model, tokenizer.get_vocab_size())
    except ValueError as err:
        raise ConfigError(f"model.flavor {config.model.flavor}: {err}") from None
    _check_hf_vocabulary(config, tokenizer, arch.vocab_size)


def _check_hf_vocabulary(config, tokenizer, rows: int) -> None:
    """The ids the run feeds an ``hf:DIR`` model fit its embedding (the mask only for masked
    diffusion: a tokenizer without one gets an extra id an autoregressive run never uses), and a
    diffusion run masks with the token the folder's model was trained to fill."""
    from muloco.hf.config import read
    from muloco.models import hf_folder

    folder = hf_folder(config.model.flavor)
    causal = config.objective._owner.causal
    needed = tokenizer.get_vocab_size()
    if causal and tokenizer.mask_id == needed - 1:  # a mask id added after the folder's vocabulary: never fed
        needed -= 1
    if needed > rows:
        raise ConfigError(f"model.flavor {config.model.flavor}: the tokenizer's ids need {needed} embedding rows and "
                          f"the folder's model has {rows}; use the folder's tokenizer (--tokenizer.path {folder})")
    trained_mask = read(folder).get("mask_token_id")
    if not causal and trained_mask is not None and trained_mask != tokenizer.mask_id:
        raise ConfigError(f"model.flavor {config.model.flavor}: its config.json masks with id {trained_mask} and the "
                          f"tokenizer's mask token is {tokenizer.mask_id}; use the folder's tokenizer "
                          f"(--tokenizer.path {folder})")


def model_units(flavor: str) -> int:
    """Layer-sized units the outer loop splits into fragments: the embedding, each
    transformer block, and the final norm with the output head together (see
    ``_units`` in :mod:`muloco.outer.schedule`; a test checks this against built models)."""
    from muloco.hf.config import read
    from muloco.models import Architecture, hf_folder

    folder = hf_folder(flavor)
    if folder is not None:
        return Architecture.from_hf(read(folder)).depth + 2
    return parse_flavor(flavor).shape.depth + 2


def _check_checkpoint(config) -> None:
    ckpt = config.checkpoint
    if not ckpt.enable:
        return
    if "://" in ckpt.folder or "://" in (ckpt.initial_load_path or ""):
        raise ConfigError(
            "checkpoint.folder and checkpoint.initial_load_path must be local folders: muloco "
            "verifies a checksum manifest of every checkpoint before loading it; mount the "
            "bucket, or copy the checkpoint to local storage."
        )
    if ckpt.async_mode == "async_with_pinned_mem":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "checkpoint.async_mode 'async_with_pinned_mem' stages checkpoints in pinned "
                "CUDA memory and there is no CUDA device here; use 'async' or 'disabled'."
            )


def _check_hf_initial_load(config) -> None:
    """A run started from a Hugging Face folder: the folder is one, its flavor maps onto it, and
    its shapes are this run's (else the first difference, before anything is built)."""
    ckpt = config.checkpoint
    if not (ckpt.enable and ckpt.initial_load_path and ckpt.initial_load_in_hf):
        return
    from pathlib import Path

    folder = Path(ckpt.initial_load_path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"checkpoint.initial_load_path {folder} holds no config.json: give a Hugging Face "
                          "model folder (config.json and *.safetensors), or drop --checkpoint.initial_load_in_hf "
                          "to load a muloco checkpoint.")
    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"checkpoint.initial_load_path {folder} holds no .safetensors weights.")
    from muloco.hf.config import first_mismatch, llama_config
    from muloco.models import build_model_config, hf_adapter

    from muloco.hf.adapter import adapter_for

    if adapter_for(str(folder)) is not hf_adapter(config.model):
        raise ConfigError(f"checkpoint.initial_load_path {folder} and model.flavor {config.model.flavor} name their "
                          f"weights differently (LLaDA's names, Llama's); take the folder's own shapes and names with "
                          f"--model.flavor hf:{folder}")
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    model = build_model_config(config.model, tokenizer.get_vocab_size(), config.objective._owner.causal)
    why = first_mismatch(folder, llama_config(model, tokenizer.bos_id, tokenizer.eos_id, config.training.seq_len))
    if why:
        raise ConfigError(f"{folder}/config.json does not fit model.flavor {config.model.flavor}: {why}. Pick the "
                          "flavor of that shape (llama3-w<hidden_size>-d<layers>-h<heads>) and its tokenizer, or take "
                          f"the folder's own shapes with --model.flavor hf:{folder}.")


def _check_data_source_keys(config) -> None:
    """torchtitan's loader config has ``dataset`` and ``dataset_path``; muloco reads neither (its
    data comes from ``source``), so a value there would be silently ignored."""
    for prefix, dl in (("dataloader", config.dataloader), ("validator.dataloader", config.validator.dataloader)):
        if getattr(dl, "dataset", "") or getattr(dl, "dataset_path", None):
            raise ConfigError(f"{prefix}.dataset / {prefix}.dataset_path are not read: the data comes from "
                              f"{prefix}.source; use --{prefix}.source jsonl --{prefix}.source.dataset_path PATH "
                              f"(or --{prefix}.source huggingface --{prefix}.source.dataset NAME).")


def _check_validation_source(config) -> None:
    """``validator.dataloader`` is read only with ``follow_training_data`` off: a value set there
    while validation follows the training data would be dropped without a word."""
    v = config.validator
    if getattr(v, "follow_training_data", False) and v.dataloader != type(v.dataloader)(split="validation"):
        raise ConfigError("validator.dataloader is set but not read: validation follows the training data's "
                          "held-out split (validator.follow_training_data). Add --validator.follow_training_data "
                          "False to validate on validator.dataloader, or drop its settings.")


def _check_paths(config) -> None:
    _check_data_source_keys(config)
    _check_validation_source(config)
    source = config.dataloader.source
    key = f"dataloader.source.dataset_path (dataloader.source is {source.name!r})"
    if isinstance(source, JsonlFiles):
        path = source.dataset_path
        if not path:
            raise ConfigError(f"{key} is empty; give the JSONL file, directory or glob to read.")
        if not any(ch in path for ch in "*?[") and not os.path.exists(path):
            raise ConfigError(f"{key} '{path}' does not exist; give an existing JSONL file or directory, or "
                              "use --dataloader.source stdlib for the embedded corpus.")
    if isinstance(source, HuggingFaceDataset) and source.dataset_path and not os.path.exists(source.dataset_path):
        raise ConfigError(f"{key} '{source.dataset_path}' does not exist; for a dataset on the Hugging Face hub "
                          "set --dataloader.source.dataset <name> and leave dataset_path empty.")
    tok_path = getattr(config.tokenizer, "path", "")
    if tok_path and not os.path.exists(tok_path):
        raise ConfigError(
            f"tokenizer.path '{tok_path}' does not exist; give a tiktoken BPE file, a "
            "tokenizer.json or a directory holding one, or leave it empty for the "
            "embedded standard-library BPE."
        )


def _check_metrics(config) -> None:
    _positive("metrics.log_freq", config.metrics.log_freq, "a positive integer")
    if config.validator.enable:
        _positive("validator.freq", config.validator.freq, "a positive integer")
        tuning = getattr(config.validator, "tuning_steps", 0)
        if tuning < 0:
            raise ConfigError(f"validator.tuning_steps is {tuning}; it must be >= 0 (0: no tuning batches).")
        if tuning and config.validator.steps == -1:
            raise ConfigError("validator.tuning_steps reads the held-out batches after the validator.steps reported "
                              "ones, and validator.steps -1 reports on all of them; give validator.steps a count.")
    if config.checkpoint.enable:
        _positive("checkpoint.interval", config.checkpoint.interval, "a positive integer")
    if config.metrics.enable_wandb:
        try:
            optional.require("wandb", "metrics.enable_wandb")
        except optional.MissingExtra as err:
            raise ConfigError(str(err)) from None


def _check_replicas(config) -> None:
    ft = config.fault_tolerance
    if not ft.enable:
        raise ConfigError("fault_tolerance.enable is false; a DiLoCo config needs its replica groups.")
    if ft.semi_sync_method is not None:
        raise ConfigError(
            "fault_tolerance.semi_sync_method must stay unset: muloco's outer loop "
            "(--outer.*) replaces torchtitan's torchft DiLoCo."
        )
    _positive("fault_tolerance.group_size", ft.group_size, "the number of replica groups (>= 1)")
    if not 0 <= ft.replica_id < ft.group_size:
        raise ConfigError(
            f"fault_tolerance.replica_id is {ft.replica_id}; it must be in [0, {ft.group_size}) "
            "(fault_tolerance.group_size is the number of replica groups)."
        )
    for key in ("timeout_seconds", "quorum_timeout_seconds", "connect_timeout_seconds"):
        _positive(f"fault_tolerance.{key}", getattr(ft, key))
    if ft.lighthouse_lost_seconds < 0:
        raise ConfigError(f"fault_tolerance.lighthouse_lost_seconds is {ft.lighthouse_lost_seconds:g}; it must be "
                          ">= 0 (0 = fault_tolerance.connect_timeout_seconds).")
    if not 0 <= ft.min_replica_size <= ft.group_size:
        raise ConfigError(
            f"fault_tolerance.min_replica_size is {ft.min_replica_size}; it must be in [0, {ft.group_size}] "
            "(0 = a majority of fault_tolerance.group_size; a larger value could never commit)."
        )
    for key in ("start_wait_seconds", "end_wait_seconds"):
        if getattr(ft, key) < 0:
            raise ConfigError(f"fault_tolerance.{key} is {getattr(ft, key)!r}; it must be >= 0.")
    if ft.max_commit_failures < -1:
        raise ConfigError(f"fault_tolerance.max_commit_failures is {ft.max_commit_failures}; "
                          "it must be >= 0, or -1 for no limit.")


def _check_outer(config) -> None:
    try:
        config.outer.validate()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    units, fragments = model_units(config.model.flavor), config.outer.num_fragments
    if fragments > units:
        raise ConfigError(
            f"outer.num_fragments is {fragments}, more than the {units} layer units of "
            f"model.flavor {config.model.flavor} (the embedding, each block, and the head); "
            f"use at most --outer.num_fragments {units}."
        )
    interval = config.outer.schedule().interval
    steps = config.training.steps
    if steps % interval:
        raise ConfigError(
            f"training.steps ({steps}) must be a multiple of the sync interval "
            f"outer.sync_every / outer.num_fragments = {interval}, so the run ends on a sync; "
            f"try --training.steps {steps + interval - steps % interval}."
        )
    ckpt = config.checkpoint
    if ckpt.enable and ckpt.interval % interval:
        raise ConfigError(
            f"checkpoint.interval ({ckpt.interval}) must be a multiple of the sync interval "
            f"({interval}) so no exchange is in flight when a checkpoint is taken."
        )


def _check_objective(config) -> None:
    try:
        config.objective.validate()
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if config.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError("parallelism.pipeline_parallel_degree > 1 is not supported by muloco's "
                          "objectives; use data parallelism (FSDP) inside a replica group.")


def check_config(config) -> None:
    """Raise ConfigError for the first problem found."""
    _check_finite(config)
    _check_objective(config)
    _check_training(config)
    _check_optimizer(config)
    _check_model(config)
    _check_patterns(config)
    _check_paths(config)
    _check_metrics(config)
    _check_checkpoint(config)
    _check_hf_initial_load(config)
    if hasattr(config, "outer"):
        _check_replicas(config)
        _check_outer(config)


def _probe_once(folder: str) -> None:
    created = make_dirs(folder)
    try:
        fd, probe = tempfile.mkstemp(prefix=".muloco-write-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    finally:
        remove_dirs(created)


def _check_not_under_a_file(folder: str) -> None:
    """The deepest existing part of ``folder``'s path must be a folder. A path that vanishes
    between the two looks (a peer rank's probe just removed the folder it made) is looked at
    again, not taken for a file."""
    for _ in range(10):
        missing = missing_dirs(folder)
        existing = os.path.dirname(missing[-1]) if missing else os.path.abspath(folder)
        if os.path.isdir(existing):
            return
        if os.path.lexists(existing):
            what = "is a file" if existing == os.path.abspath(folder) else f"is under {existing}, which is a file"
            raise ConfigError(f"dump_folder '{folder}' {what}; pass --dump_folder with a folder path.")


def check_dump_folder(folder: str) -> None:
    """The dump folder can be created and written to: tried for real (as root every
    ``os.access`` says yes, and a read-only filesystem says no only when written), and
    whatever the probe created is removed again, so a run that fails later in preflight
    leaves nothing behind."""
    _check_not_under_a_file(folder)
    for _ in range(3):
        try:
            _probe_once(folder)
            return
        except FileNotFoundError as err:
            failure = err  # ranks probing one new folder at once may remove it under each other
        except OSError as err:
            failure = err
            break
    raise ConfigError(
        f"dump_folder '{folder}' cannot be created or written ({failure.filename}: {failure.strerror}); "
        "pass --dump_folder with a folder you can write to."
    )
