"""What an evaluation scores: a muloco run's checkpoint or a Hugging Face folder, as one model.

Both become muloco's own torchtitan model (so a folder exported from a run scores exactly as
the run does, and the diffusion sampler and scorer work on either): a run through
:mod:`muloco.trained_model` (newest complete checkpoint or ``--step``, verified, θ_g where the
run has one), a folder by building the architecture its ``config.json`` states and mapping its
safetensors weights in with torchtitan's Llama 3 adapter, the same mapping export writes with.
Nothing is unpickled; no code from the folder runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from muloco.components.checkpoint import RUN_FILE
from muloco.data.tokenizer import MulocoTokenizer
from muloco.hf import config as hf_config
from muloco.objectives import named_by_attention
from muloco.objectives.sampling_options import READOUT_KEY, Readout
from muloco.utils.errors import BadInput


class SourceError(BadInput, ValueError):
    """A folder that is neither a run nor a Hugging Face model folder this can score."""


class EvaluationError(BadInput, ValueError):
    """A request this model cannot answer (a continuation longer than it was trained on)."""


@dataclass
class Source:
    """A model ready to score: ids → logits, and how text becomes ids."""

    model: torch.nn.Module
    tokenizer: MulocoTokenizer
    causal: bool
    max_length: int
    """The longest sequence the model was trained on: contexts are cut on the left to fit."""
    results_dir: Path
    """Where ``eval/<task>.json`` goes: the run's dump folder (a DiLoCo job's, above its replica
    folders: θ_g is the same in each), or the Hugging Face folder."""
    facts: dict = field(default_factory=dict)
    """What was loaded (source, step, θ_g or not), written with every result."""
    readout: Readout = Readout()
    """How a diffusion model's outputs line up with the canvas (its recipe's)."""

    @property
    def mask_id(self) -> int:
        return self.tokenizer.mask_id


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / RUN_FILE).is_file()


def load(
    path: str, *, step: int | None, replica: int | None, device: torch.device, adapter: str | None = None
) -> Source:
    folder = Path(path)
    if is_hf_folder(folder):
        if step is not None or replica is not None:
            raise SourceError(f"--step/--replica choose a checkpoint of a run; {path} is a Hugging Face folder")
        return from_hf_folder(folder, device, adapter=Path(adapter) if adapter else None)
    if adapter is not None:
        raise SourceError(
            f"--adapter applies a LoRA adapter to a Hugging Face folder; {path} is a run, which loads its own adapters"
        )
    return from_run(path, step=step, replica=replica, device=device)


def from_run(path: str, *, step: int | None, replica: int | None, device: torch.device) -> Source:
    from muloco.trained_model import load_config, load_model, locate  # a run's loader, only for a run

    run, step = locate(path, replica, step)
    config = load_config(run, prog="python -m muloco.evaluate")
    model, tokenizer, objective, step, is_global = load_model(run, config, step, device)
    job = run.parent if run.name.startswith("replica_") and not (run.parent / RUN_FILE).is_file() else run
    from muloco.objectives.recipes import readout_of  # a run's objective config, only for a run

    readout = readout_of(config.objective)
    return Source(
        model=model,
        tokenizer=tokenizer,
        causal=objective.causal,
        max_length=config.training.seq_len,
        readout=readout,
        results_dir=job,
        facts={"source": "run", "objective": objective.name, "step": step, "weights": "θ_g" if is_global else "model"},
    )


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    if not files:
        raise SourceError(f"{folder} holds no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            state.update(load_file(str(folder / name)))
        except Exception as e:  # safetensors raises its own error types for truncated or foreign files
            raise SourceError(f"{folder / name} is not a readable safetensors file ({e})") from None
    return state


def _apply_adapter(model: torch.nn.Module, folder: Path) -> None:
    """``model`` with the peft LoRA adapter of ``folder`` (SourceError naming what does not fit)."""
    from muloco.hf.peft import adapter_settings, load_adapter
    from muloco.models.lora import LoraConfig, apply_lora

    try:
        apply_lora(model, LoraConfig(**adapter_settings(folder)))
        load_adapter(model, folder)
    except ValueError as e:
        raise SourceError(f"--adapter {folder}: {e}") from None


def from_hf_folder(folder: Path, device: torch.device, adapter: Path | None = None) -> Source:
    # the Hugging Face side, only for a folder (a run's evaluation never loads it)
    from muloco.hf.adapter import adapter_for
    from muloco.models import Architecture, architecture_config, build

    try:
        theirs = hf_config.read(folder)
        arch = Architecture.from_hf(theirs)
    except ValueError as e:
        raise SourceError(f"{folder}: {e}") from None
    if not (folder / "tokenizer.json").is_file():
        raise SourceError(f"{folder} holds no tokenizer.json; muloco scores text with the folder's own tokenizer")
    causal = not hf_config.bidirectional(theirs)
    config = architecture_config(arch, causal)
    model = build(config, device)
    try:
        state = adapter_for(str(folder))(config).from_hf({k: v.float() for k, v in _weights(folder).items()})
    except KeyError as e:
        raise SourceError(f"{folder}'s weights do not fit its config.json: {e.args[0]}") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which the config does not describe"
        raise SourceError(f"{folder}'s weights do not fit its config.json: it {what}")
    if adapter is not None:
        _apply_adapter(model, adapter)
    model.eval()
    tokenizer = MulocoTokenizer(MulocoTokenizer.Config(path=str(folder)))
    if not causal and theirs.get("mask_token_id") not in (None, tokenizer.mask_id):
        raise SourceError(
            f"{folder}: config.json's mask_token_id {theirs['mask_token_id']} is not its tokenizer's "
            f"mask token ({tokenizer.mask_id})"
        )
    from muloco.hf.llada import is_llada, llama_view  # the Hugging Face side, only for a folder

    length = (llama_view(theirs) if is_llada(theirs) else theirs).get("max_position_embeddings") or 2048
    try:
        readout = Readout.from_json(theirs.get(READOUT_KEY))
    except ValueError as e:
        raise SourceError(f"{folder}: {e}") from None
    return Source(
        model=model,
        tokenizer=tokenizer,
        causal=causal,
        max_length=int(length),
        results_dir=folder,
        readout=readout,
        facts={"source": "huggingface", "objective": named_by_attention(causal), "weights": "folder"},
    )
