"""A trained run's model, as sampling, export and evaluation read it.

A path is a run's dump folder (a DiLoCo job's: replica 0 unless ``replica``), one replica's
folder, or a ``checkpoint/step-N`` folder. The model is rebuilt from the run's ``run.json``
(its config module and overrides) and loaded from the newest complete checkpoint (or ``step``),
verified against its checksums and read without unpickling arbitrary objects; θ_g, the global
model the replicas agreed on, where the run has one.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

from muloco import compat

compat.apply()

import torch  # noqa: E402

from muloco.components.checkpoint import RUN_FILE, CheckpointLoadError, check_metadata, resolve_step, verify_step  # noqa: E402
from muloco.config.cli import parse_args  # noqa: E402
from muloco.models import HF_FLAVOR, hf_folder, init_model  # noqa: E402
from muloco.runs.manifest import complete_steps  # noqa: E402
from muloco.utils.errors import BadInput  # noqa: E402

GLOBAL_KEY = ".global."
"""θ_g in a DiLoCo checkpoint: ``outer.fragment_<i>.global.<parameter name>``."""


class RunLoadError(BadInput, ValueError):
    """A path that is not a run this can load; the message says what to give instead."""


def locate(path: str, replica: int | None, step: int | None) -> tuple[Path, int | None]:
    """The run folder holding ``run.json`` for ``path``, and the step named by a step folder.
    ``replica``: which replica folder of a DiLoCo run (None: replica 0); a run without replica
    groups refuses one."""
    folder = Path(path)
    if folder.name.startswith("step-") and folder.name[5:].isdigit():
        return locate(str(folder.parent.parent), replica, int(folder.name[5:]) if step is None else step)
    if replica is not None and (folder / RUN_FILE).is_file() and not folder.name.startswith("replica_"):
        raise RunLoadError(
            f"--replica {replica}: {path} is a run without replica groups (one folder, "
            "no replica_<i>/); leave --replica out."
        )
    for candidate in (folder, folder / f"replica_{replica or 0}"):
        if (candidate / RUN_FILE).is_file():
            return candidate, step
    if not folder.is_dir():
        raise RunLoadError(f"{path} is not a folder; give a run's dump folder or a checkpoint/step-N folder of it.")
    raise RunLoadError(
        f"{path} holds no {RUN_FILE} (nor replica_{replica or 0}/{RUN_FILE}): "
        "it is not a folder written by python -m muloco.train; give the run's dump folder."
    )


def load_config(run: Path, prog: str = "muloco"):
    """The run's trainer config, parsed from its ``run.json`` in the folder it was started from
    (an ``hf:DIR`` flavor's relative folder made absolute there, so the model builds from anywhere)."""

    record = json.loads((run / RUN_FILE).read_text())
    with contextlib.chdir(record["cwd"]) if os.path.isdir(record["cwd"]) else contextlib.nullcontext():
        _, config = parse_args(["--config", record["config"], *record["args"]], prog=prog)
        folder = hf_folder(config.model.flavor)
        if folder is not None:
            config.model.flavor = HF_FLAVOR + os.path.abspath(folder)
    return config


def load_model(run: Path, config, step: int | None, device: torch.device):
    """The run's model with the weights of ``step`` (newest complete: None), θ_g where the run has one."""
    import torch.distributed.checkpoint as dcp

    folder = run / config.checkpoint.folder
    step = resolve_step(str(folder), -1 if step is None else step, warn=False, flag="--step")
    if step < 0:
        raise RunLoadError(
            f"{folder} holds no complete checkpoint; train with checkpoints on "
            "(--checkpoint.enable, the default) or wait for the run's first save."
        )
    step_dir = str(folder / f"step-{step}")
    others = [s for s in complete_steps(str(folder)) if s != step]
    fix = (
        f"Pick an intact step with --step N (steps present: {', '.join(map(str, others))})"
        if others
        else "It is the run's only complete checkpoint: delete that step folder and resume the run with its own "
        "command to write a new one"
    )
    verify_step(step_dir, fix)
    check_metadata(step_dir, fix)
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    objective = config.objective._owner
    model = init_model(config.model, tokenizer.get_vocab_size(), objective.causal, device)
    saved = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    params = dict(model.state_dict())
    globals_ = {k.split(GLOBAL_KEY, 1)[1]: k for k in saved if GLOBAL_KEY in k}
    wanted = {globals_.get(name, name): t for name, t in params.items()}
    missing = sorted(k for k in wanted if k not in saved)
    if missing:
        raise CheckpointLoadError(
            f"checkpoint {step_dir} lacks {missing[0]} (and {len(missing) - 1} more) of "
            f"this model ({config.model.flavor}); was it written by another config?"
        )
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, checkpoint_id=step_dir, no_dist=True)
    model.eval()
    return model, tokenizer, objective, step, bool(globals_)
