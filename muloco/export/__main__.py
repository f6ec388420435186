"""Export a run's model to a Hugging Face folder that ``transformers`` loads.

    python -m muloco.export RUN_FOLDER [--step N] [--replica i] --out DIR [--force]
        [--push-to-hub OWNER/NAME [--private]]

Writes ``config.json`` (``LlamaForCausalLM``), ``model.safetensors`` (sharded with an index above
5 GB), ``generation_config.json``, the tokenizer (``tokenizer.json`` and its config) and a model
card (``README.md``) with the run's recipe and figures. A DiLoCo/MuLoCo run exports θ_g, the
global model, read from a checkpoint verified against its checksums, like ``muloco.generate``.
The weight names and the rotary permutation come from torchtitan's ``Llama3StateDictAdapter``
(:class:`muloco.hf.adapter.Llama3Adapter`: the same, with the QK norms).

Next-token (``ar``) runs load as ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` with the per-head QK
norms of the ``_qk_torch-rmsnorm`` flavors); masked-diffusion (``mdlm``) runs ship a small
bidirectional model class (``modeling_muloco_mdlm.py``: transformers' Llama layers, no causal
mask, the mask token in the config) loaded with ``trust_remote_code=True``. Flavors transformers
has no class for (the sandwich block's output norms of ``_pa``/``_pf``, QK norms in a diffusion
model, Qwen2's q/k/v biases in a diffusion model) ship ``modeling_muloco.py`` instead. Models
started from a Qwen2/Qwen2.5 folder export as ``Qwen2ForCausalLM``; Llama 3.x's RoPE scaling is
written as transformers reads it. A tiktoken tokenizer (Llama 3's ``tokenizer.model``) is
converted to ``tokenizer.json`` with its special tokens where muloco put them. What this export
cannot express is one clear error naming it, and nothing is written.

``--push-to-hub`` then uploads the folder to that Hub model repository (created if missing) in
one commit, so the repository gets every file or none. The token is huggingface_hub's own lookup
(``HF_TOKEN``, or what ``hf auth login`` saved; ``HF_ENDPOINT`` for a private Hub), never a flag, and
is never printed or written.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from muloco.utils.command_line import UsageError, failed, parse, tyro
from muloco.utils.errors import BAD_INPUT, MulocoError

if TYPE_CHECKING:
    pass

# torch, safetensors and torchtitan are imported once the command line is parsed (in the
# functions that use them): ``--help`` and a usage error answer without them.
from muloco.export.folder import ADAPTER_FOLDER, LICENSE_ID, ExportError, export
from muloco.export.hub import hub_token, push_to_hub
from muloco.utils.command_line import run_main

PROG = "python -m muloco.export"


@dataclass
class ExportOptions:
    """Export a run's model to a Hugging Face folder that ``transformers`` loads."""

    checkpoint: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="RUN_FOLDER")]]
    """Run dump folder, replica folder or checkpoint/step-N."""
    out: str
    """The Hugging Face folder to write."""
    step: int | None = None
    """Checkpoint step (default: the newest complete)."""
    replica: int | None = None
    """A DiLoCo run's replica folder to read (default 0)."""
    force: bool = False
    """Replace a non-empty --out."""
    push_to_hub: Annotated[str | None, tyro.conf.arg(metavar="OWNER/NAME")] = None
    """Then upload the folder to this Hub model repository (token: HF_TOKEN, or what `hf auth login` saved)."""
    private: bool = False
    """With --push-to-hub: create the repository private."""
    license: str | None = None
    """The card's license, a Hub license id: apache-2.0, mit, other... (default: none; your data's terms apply)."""
    lora_base: bool = False
    """A LoRA run: write its frozen base, not the merged model (the adapter goes to OUT/adapter either way;
    peft.PeftModel.from_pretrained(model of OUT, OUT/adapter) is then the merged model)."""


def _check(args: ExportOptions) -> None:
    if args.license is not None and not LICENSE_ID.fullmatch(args.license):
        raise UsageError(
            f"--license {args.license!r} is not a license id: lowercase letters, digits, '.', '-' and "
            "'+', e.g. apache-2.0, mit, cc-by-4.0 or other"
        )
    if args.private and not args.push_to_hub:
        raise UsageError("--private applies to --push-to-hub; add it or drop --private")


def main(argv: list[str] | None = None) -> int:
    try:
        args, _ = parse(
            ExportOptions,
            list(sys.argv[1:] if argv is None else argv),
            prog=PROG,
            description=__doc__.split("\n\n")[0],
            overrides=False,
        )
        _check(args)
    except UsageError as e:
        return failed("export", e)
    # torch-bound, so imported only once the command line parsed (--help and usage errors stay fast)
    from muloco import compat

    compat.apply()  # before torchtitan is imported
    try:
        if args.push_to_hub:
            hub_token(args.push_to_hub)
        out = export(
            args.checkpoint,
            args.out,
            step=args.step,
            replica=args.replica,
            force=args.force,
            lora_base=args.lora_base,
            license=args.license,
        )
    except MulocoError as e:
        return failed("export", e)
    except ValueError as e:  # a library's refusal of the folder or the weights (transformers, safetensors)
        return failed("export", e, BAD_INPUT)
    config = json.loads((out / "config.json").read_text())
    auto = "AutoModelForMaskedLM" if config.get("mask_token_id") is not None else "AutoModelForCausalLM"
    how = f"{auto}.from_pretrained({str(out)!r}{', trust_remote_code=True' if 'auto_map' in config else ''})"
    print(f"exported to {out}: load it with transformers.{how}; its README.md says how it was trained")
    if (out / ADAPTER_FOLDER).is_dir():
        print(
            f"its LoRA adapter alone: {out / ADAPTER_FOLDER} (peft.PeftModel.from_pretrained(<the base model>, "
            f"'{out / ADAPTER_FOLDER}'))"
        )
    if args.push_to_hub:
        try:
            url = push_to_hub(out, args.push_to_hub, private=args.private)
        except ExportError as e:
            return failed("export", e)
        print(f"pushed to the Hub as {args.push_to_hub}: {url}")
    return 0


if __name__ == "__main__":
    run_main(main)
