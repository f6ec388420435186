"""A run's length in epochs, and its intervals as fractions of the run, resolved to steps.

Transformer Lab (and Hugging Face's Trainer) let a fine-tune say "3 epochs" instead of a step
count, and "evaluate every 0.1 of the run" instead of a step interval; torchtitan counts steps
only. So before the trainer is built, ``training.epochs`` becomes ``training.steps`` and a
fractional ``validator.freq`` / ``checkpoint.interval`` / ``metrics.log_freq`` becomes a step
interval, and torchtitan sees the integers it always did.

An epoch is one pass over the training split by the whole job: replica groups read disjoint
shards of it (torchft's data-parallel info puts group k's ranks after group k-1's), so K groups
together pass over it K times as fast as one. Its rows are counted the way the loader makes
them: one SFT example per row (those whose prompt fills a row skipped), or packed documents
cut into ``seq_len``-token rows.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools.logging import logger

from muloco.config.loader import ConfigError
from muloco.data.loader import PackedTextDataLoader
from muloco.data.sources import HuggingFaceDataset
from muloco.utils.values import is_fraction, steps_of

INTERVALS = (("validator", "freq"), ("checkpoint", "interval"), ("metrics", "log_freq"))
"""The settings that may be given as a fraction of the run."""


def sync_interval(config) -> int:
    """Steps between syncs (1 without an outer loop): a DiLoCo run's length and checkpoints are
    whole numbers of them."""
    return config.outer.schedule().interval if hasattr(config, "outer") else 1


def groups(config) -> int:
    return max(1, config.fault_tolerance.group_size) if hasattr(config, "outer") else 1


def batch_degree(config, world_size: int) -> int:
    """Data-parallel ranks of one replica group: torchtitan's ParallelDims resolves the degrees (a
    shard degree of -1 included) without building a mesh."""
    dims = ParallelDims.from_config(config.parallelism, world_size)
    return dims.dp_replicate * dims.dp_shard


def rows_per_step(config, world_size: int) -> int:
    """Training rows one optimizer step consumes, summed over the replica groups."""
    t = config.training
    per_group = (
        t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * batch_degree(config, world_size)
    )
    return per_group * groups(config)


def count_rows(config, data: PackedTextDataLoader.Config | None = None, why: str = "training.epochs") -> int:
    """Rows in one pass over a split (the training split by default), read by the loader itself
    (one shard of one); ``why`` names the setting that needs the count."""
    data = data or replace(config.dataloader, split="train")
    if isinstance(data.source, HuggingFaceDataset):
        raise ConfigError(
            f"{why} needs a split that can be counted before the run, and a huggingface source is "
            "streamed: give --training.steps, or save the split as JSON lines and read it with "
            "--dataloader.source jsonl (or sft)."
        )
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    loader = PackedTextDataLoader(
        replace(data, infinite=False),
        dp_world_size=1,
        dp_rank=0,
        tokenizer=tokenizer,
        seq_len=config.training.seq_len,
        local_batch_size=64,
    )
    logger.info(f"{why}: counting the {data.split} rows of {loader.source.describe()} ...")
    return sum(len(labels) for _, labels in loader)


def resolve_epochs(config, world_size: int) -> str | None:
    """``training.steps`` from ``training.epochs`` (0: the steps as given); what was decided, in words."""
    epochs = config.training.epochs
    if not epochs:
        return None
    rows, per_step, interval = count_rows(config), rows_per_step(config, world_size), sync_interval(config)
    if rows == 0:
        raise ConfigError(
            "training.epochs: the training split makes no row (every SFT prompt fills "
            f"training.seq_len {config.training.seq_len}?); give data, or raise training.seq_len."
        )
    steps = math.ceil(math.ceil(epochs * rows / per_step) / interval) * interval
    config.training.steps = steps
    whole = f", rounded up to whole syncs of {interval} steps" if interval > 1 else ""
    return (
        f"training.epochs {epochs:g}: {steps} steps ({rows} rows in the training split, {per_step} rows a step "
        f"over {groups(config)} replica group(s){whole})"
    )


def resolve_intervals(config) -> list[str]:
    """Each fractional interval as steps of this run (a checkpoint on a sync boundary)."""
    said = []
    for part, key in INTERVALS:
        value = getattr(getattr(config, part), key)
        if not is_fraction(value):
            continue
        multiple = sync_interval(config) if part == "checkpoint" else 1
        steps = steps_of(value, config.training.steps, multiple)
        setattr(getattr(config, part), key, steps)
        said.append(f"{part}.{key} {value:g} of {config.training.steps} steps: every {steps}")
    return said


def resolve_run_length(config, world_size: int | None = None) -> None:
    """Epochs to steps, then fractional intervals to steps; each decision logged once."""
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    said = [resolve_epochs(config, world), *resolve_intervals(config)]
    for line in filter(None, said):
        logger.info(line)
