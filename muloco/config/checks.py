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
from pathlib import Path

from muloco import compat

compat.apply()  # before muloco.models imports torchtitan (a pre-flight may be the first to)

from muloco.config.cli import valid_keys  # noqa: E402
from muloco.config.loader import ConfigError  # noqa: E402
from muloco.hf.adapter import adapter_for  # noqa: E402
from muloco.hf.config import bidirectional, first_mismatch, llama_config, read  # noqa: E402
from muloco.models import Architecture, build_model_config, hf_adapter, hf_folder  # noqa: E402
from muloco.models.flavors import parse_flavor  # noqa: E402
from muloco.utils.created_dirs import make_dirs, missing_dirs, remove_dirs  # noqa: E402
from muloco.utils.values import is_fraction  # noqa: E402


def _check_finite(config) -> None:
    """inf and nan pass range checks written as comparisons (``inf > 0``; nan compares
    false both ways, so ``not 0 <= nan < 1`` depends on how the test is spelt), and a
    run with an infinite learning rate dies many steps later on a non-finite loss.
    So every float setting is rejected here, before the range checks run."""
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


def _check_hf_model(config) -> None:
    """An ``hf:DIR`` flavor: the folder's shapes with this run's tokenizer (model × tokenizer)."""
    if hf_folder(config.model.flavor) is None:
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
    folder = hf_folder(config.model.flavor)
    causal = config.objective._owner.causal
    needed = tokenizer.get_vocab_size()
    if causal and tokenizer.mask_id == needed - 1:  # a mask id added after the folder's vocabulary: never fed
        needed -= 1
    if needed > rows:
        unused = (
            ""
            if causal
            else (
                " (a masked-diffusion run: if the mask token was added after a full vocabulary, "
                "name an unused one of its special tokens with --tokenizer.mask_token, e.g. Llama "
                "3's <|reserved_special_token_0|>)"
            )
        )
        raise ConfigError(
            f"model.flavor {config.model.flavor}: the tokenizer's ids need {needed} embedding rows and "
            f"the folder's model has {rows}; use the folder's tokenizer (--tokenizer.path {folder}){unused}"
        )
    trained_mask = read(folder).get("mask_token_id")
    if not causal and trained_mask is not None and trained_mask != tokenizer.mask_id:
        raise ConfigError(
            f"model.flavor {config.model.flavor}: its config.json masks with id {trained_mask} and the "
            f"tokenizer's mask token is {tokenizer.mask_id}; use the folder's tokenizer "
            f"(--tokenizer.path {folder})"
        )


def model_units(flavor: str, lora: bool = False) -> int:
    """Layer-sized units the outer loop splits into fragments: the embedding, each
    transformer block, and the final norm with the output head together (see
    ``_units`` in :mod:`muloco.outer.schedule`; a test checks this against built models);
    with LoRA only the blocks, which hold the adapters."""
    folder = hf_folder(flavor)
    depth = Architecture.from_hf(read(folder)).depth if folder is not None else parse_flavor(flavor).shape.depth
    return depth if lora else depth + 2


def _check_hf_initial_load(config) -> None:
    """A run started from a Hugging Face folder: the folder is one, its flavor maps onto it, and
    its shapes are this run's (else the first difference, before anything is built)."""
    ckpt = config.checkpoint
    if not (ckpt.enable and ckpt.initial_load_path and ckpt.initial_load_in_hf):
        return

    folder = Path(ckpt.initial_load_path)
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"checkpoint.initial_load_path {folder} holds no config.json: give a Hugging Face "
            "model folder (config.json and *.safetensors), or drop --checkpoint.initial_load_in_hf "
            "to load a muloco checkpoint."
        )
    if not any(folder.glob("*.safetensors")):
        raise ConfigError(f"checkpoint.initial_load_path {folder} holds no .safetensors weights.")

    if adapter_for(str(folder)) is not hf_adapter(config.model):
        raise ConfigError(
            f"checkpoint.initial_load_path {folder} and model.flavor {config.model.flavor} name their "
            f"weights differently (LLaDA's names, Llama's); take the folder's own shapes and names with "
            f"--model.flavor hf:{folder}"
        )
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    model = build_model_config(config.model, tokenizer.get_vocab_size(), config.objective._owner.causal)
    why = first_mismatch(folder, llama_config(model, tokenizer.bos_id, tokenizer.eos_id, config.training.seq_len))
    if why:
        raise ConfigError(
            f"{folder}/config.json does not fit model.flavor {config.model.flavor}: {why}. Pick the "
            "flavor of that shape (llama3-w<hidden_size>-d<layers>-h<heads>) and its tokenizer, or take "
            f"the folder's own shapes with --model.flavor hf:{folder}."
        )


def _check_outer_fits_the_run(config) -> None:
    """The outer loop against the model (fragments), the run's length and its checkpoints."""
    lora = config.model.lora.rank > 0
    units, fragments = model_units(config.model.flavor, lora), config.outer.num_fragments
    if fragments > units:
        what = "(with LoRA only the blocks train)" if lora else "(the embedding, each block, and the head)"
        raise ConfigError(
            f"outer.num_fragments is {fragments}, more than the {units} layer units of "
            f"model.flavor {config.model.flavor} {what}; use at most --outer.num_fragments {units}."
        )
    interval = config.outer.schedule().interval
    steps = config.training.steps
    if steps % interval and not config.training.epochs:  # epochs resolve to whole syncs
        raise ConfigError(
            f"training.steps ({steps}) must be a multiple of the sync interval "
            f"outer.sync_every / outer.num_fragments = {interval}, so the run ends on a sync; "
            f"try --training.steps {steps + interval - steps % interval}."
        )
    ckpt = config.checkpoint
    if ckpt.enable and not is_fraction(ckpt.interval) and ckpt.interval % interval:
        raise ConfigError(
            f"checkpoint.interval ({ckpt.interval}) must be a multiple of the sync interval "
            f"({interval}) so no exchange is in flight when a checkpoint is taken."
        )


def _check_objective_parallelism(config) -> None:
    if config.parallelism.pipeline_parallel_degree > 1:
        raise ConfigError(
            "parallelism.pipeline_parallel_degree > 1 is not supported by muloco's "
            "objectives; use data parallelism (FSDP) inside a replica group."
        )


COMPONENTS = (
    "objective",
    "training",
    "optimizer",
    "model",
    "dataloader",
    "validator",
    "tokenizer",
    "metrics",
    "checkpoint",
    "fault_tolerance",
    "outer",
)
"""The parts of a trainer config that check themselves (``Config.validate()``), in the order they
are checked (the first problem is the one reported)."""


def _check_components(config) -> None:
    for key in COMPONENTS:
        part = getattr(config, key, None)
        if not hasattr(part, "validate") or (key == "fault_tolerance" and not hasattr(config, "outer")):
            continue  # a part torchtitan checks itself; a DDP run's fault_tolerance is torchtitan's, unused
        try:
            part.validate()
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _check_recipe(config) -> None:
    """A masked-diffusion recipe against the run: blocks that tile its rows, and the token shift
    only from weights whose outputs predict the next token (an AR model, or none loaded)."""
    recipe = getattr(config.objective, "recipe", None)
    if recipe is None:
        return
    readout = recipe.build().readout
    block = readout.block_size
    if block is not None and config.training.seq_len % block:
        raise ConfigError(
            f"objective.recipe.block_size {block} does not divide training.seq_len "
            f"{config.training.seq_len}; pick a divisor (e.g. --objective.recipe.block_size "
            f"{math.gcd(block, config.training.seq_len)}) so every row is whole blocks."
        )
    ckpt = config.checkpoint
    if readout.shift and ckpt.enable and ckpt.initial_load_path and ckpt.initial_load_in_hf:
        folder = Path(ckpt.initial_load_path)
        if (folder / "config.json").is_file() and bidirectional(read(folder)):
            raise ConfigError(
                f"objective.recipe {recipe._owner.name} shifts predictions (the output at i-1 predicts "
                f"token i, as an AR model's head does), but {folder} is a masked-diffusion model whose "
                "output at i predicts token i: convert an autoregressive model, or train this one with "
                "--objective.recipe full."
            )


def _check_lr_scheduler(config) -> None:
    if config.lr_scheduler.warmup_steps < 0:
        raise ConfigError("lr_scheduler.warmup_steps must be >= 0.")


def check_config(config) -> None:
    """Raise ConfigError for the first problem found: every value finite, each component's own
    ``validate()``, then what spans components (torchtitan's own settings among them)."""
    _check_finite(config)
    _check_patterns(config)
    _check_components(config)
    _check_lr_scheduler(config)
    _check_objective_parallelism(config)
    _check_hf_model(config)
    _check_hf_initial_load(config)
    _check_recipe(config)
    if hasattr(config, "outer"):
        _check_outer_fits_the_run(config)


def _probe_once(folder: str) -> None:
    created = make_dirs(folder)
    try:
        fd, probe = tempfile.mkstemp(prefix=".muloco-write-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    finally:
        remove_dirs(created)


def _label(flag: str) -> str:
    """How a message names the folder: the trainer's config key, another command's option."""
    return "dump_folder" if flag == "--dump_folder" else flag


def _check_not_under_a_file(folder: str, flag: str = "--dump_folder") -> None:
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
            raise ConfigError(f"{_label(flag)} '{folder}' {what}; pass {flag} with a folder path.")


def check_dump_folder(folder: str, flag: str = "--dump_folder") -> None:
    """The dump folder can be created and written to: tried for real (as root every
    ``os.access`` says yes, and a read-only filesystem says no only when written), and
    whatever the probe created is removed again, so a run that fails later in preflight
    leaves nothing behind. ``flag``: the command's option that names the folder."""
    _check_not_under_a_file(folder, flag)
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
        f"{_label(flag)} '{folder}' cannot be created or written ({failure.filename}: {failure.strerror}); "
        f"pass {flag} with a folder you can write to."
    )
