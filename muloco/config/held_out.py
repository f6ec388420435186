"""The held-out split must hold the tuning batches apart from the reported ones.

``validator.tuning_steps`` scores θ_g on the held-out batches *after* the ``validator.steps``
reported ones (``components/validate.py``), and ``compare --tune`` picks outer steps by that score
so that no reported loss is one a setting was chosen on. The validation loader is infinite: on a
split too short for both, the tuning batches wrap around into the reported documents and the
separation silently goes. So the split is counted before the run (the loader's own rows, as
``training.epochs`` counts the training split) and a short one is refused with its sizes.
"""

from __future__ import annotations

from torchtitan.tools.logging import logger

from muloco.config.loader import ConfigError
from muloco.config.run_length import batch_degree, count_rows
from muloco.data.sources import HuggingFaceDataset


def check_held_out_rows(config, world_size: int) -> None:
    """ConfigError when one pass over the held-out split is fewer rows than the reported and the
    tuning batches of every data-parallel rank of a group take (all groups read the same ones)."""
    v = config.validator
    if not v.enable or v.tuning_steps <= 0:
        return
    data = v.data_config(config.dataloader)
    if isinstance(data.source, HuggingFaceDataset):  # streamed: it cannot be counted before the run
        logger.warning(
            "validator.tuning_steps: a huggingface held-out split is streamed and not counted before "
            "the run; if it is shorter than validator.steps + validator.tuning_steps batches, the tuning "
            "batches wrap around into the reported ones"
        )
        return
    ranks = batch_degree(config, world_size)
    batch = config.training.local_batch_size
    needed = (v.steps + v.tuning_steps) * batch * ranks
    rows = count_rows(config, data, why="validator.tuning_steps")
    if rows < needed:
        fits = rows // (batch * ranks) - v.steps
        fix = (
            f"at most --validator.tuning_steps {fits}"
            if fits > 0
            else "fewer --validator.steps and --validator.tuning_steps"
        )
        raise ConfigError(
            f"the held-out split makes {rows} rows of {config.training.seq_len} tokens, and "
            f"validator.steps {v.steps} + validator.tuning_steps {v.tuning_steps} batches of {batch} rows "
            f"on {ranks} rank(s) need {needed}: the tuning batches would wrap around into the reported "
            f"ones. Give {fix}, or more held-out data."
        )
