"""A run's model written as a Hugging Face folder (``config.json``, weights, tokenizer, model card),
what ``python -m muloco.export`` does (its docstring says what the folder holds and how it loads)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from muloco.hf.config import llama_config
from muloco.hf.remote_code import FOLDER as REMOTE_CODE
from muloco.launch.group import LAUNCHER_KEYS
from muloco.objectives.sampling_options import READOUT_KEY
from muloco.runs.facts import RUN_FILE
from muloco.utils import optional
from muloco.utils.atomic_file import as_umask_says
from muloco.utils.errors import BadInput

if TYPE_CHECKING:
    import torch

# torch, safetensors and torchtitan are imported once the command line is parsed (in the
# functions that use them): ``--help`` and a usage error answer without them.


SHARD_BYTES = 5 * 1024**3
"""Above this, the weights go to several files with a ``model.safetensors.index.json``."""


class ExportError(BadInput, ValueError):
    """A run this export cannot write as a Hugging Face folder; the message names the feature."""


def _unsupported(model_config, objective, tokenizer) -> str | None:
    """Why this run cannot be exported yet (None: it can). ``objective``: the run's objective class
    (what it says of itself: its attention direction, whether its model reads a mask token)."""
    attention = model_config.layers[0].attention
    if objective.mask_token and getattr(tokenizer, "mask_id", None) is None:
        return f"a {objective.title} run whose tokenizer has no mask token"
    if attention.rope.scaling not in ("none", "llama"):
        return f"RoPE scaling {attention.rope.scaling!r}: only plain RoPE and Llama 3's scaling are exported"
    return None


def _tokenizer_file(tokenizer) -> Path | None:
    """The run's tokenizer.json (None: a tiktoken tokenizer)."""
    return Path(tokenizer.path) if getattr(tokenizer, "kind", None) == "huggingface" else None


MDLM_CODE = REMOTE_CODE / "modeling_muloco_mdlm.py"
"""The bidirectional model class a masked-diffusion export ships (``trust_remote_code``)."""
MULOCO_CODE = REMOTE_CODE / "modeling_muloco.py"
"""The sandwich-block class (output norms, QK norms, optionally bidirectional) an export ships
for flavors transformers has no class for."""


def hf_config(model_config, tokenizer, seq_len: int, bidirectional: bool = False) -> dict:
    """``config.json`` with this model's shapes: ``LlamaForCausalLM`` (``Qwen3ForCausalLM`` with QK
    norms) for next-token runs, the shipped bidirectional Llama class for a bidirectional (masked
    diffusion) model, and the shipped sandwich-block class (:data:`MULOCO_CODE`) for output norms,
    or QK norms in a bidirectional model."""
    config = _llama_config(model_config, tokenizer, seq_len)
    if bidirectional and config.get("model_type") in (None, "llama"):
        module = MDLM_CODE.stem
        config.update(
            architectures=["MulocoMdlmForMaskedLM"],
            model_type="muloco_mdlm",
            mask_token_id=tokenizer.mask_id,
            auto_map={
                "AutoConfig": f"{module}.MulocoMdlmConfig",
                "AutoModel": f"{module}.MulocoMdlmForMaskedLM",
                "AutoModelForMaskedLM": f"{module}.MulocoMdlmForMaskedLM",
            },
        )
    elif bidirectional or config.get("model_type") == "muloco":
        module = MULOCO_CODE.stem
        block = model_config.layers[0]
        config.update(
            architectures=["MulocoForCausalLM"],
            model_type="muloco",
            use_sliding_window=False,
            qk_norm=block.attention.qk_norm is not None,
            qkv_bias=bool(block.attention.qkv_linear.wq.bias),
            post_attention_norm=block.post_attention_norm is not None,
            post_ffn_norm=block.post_ffn_norm is not None,
            bidirectional=bidirectional,
            auto_map={
                "AutoConfig": f"{module}.MulocoConfig",
                "AutoModel": f"{module}.MulocoForCausalLM",
                "AutoModelForCausalLM": f"{module}.MulocoForCausalLM",
                "AutoModelForMaskedLM": f"{module}.MulocoForCausalLM",
            },
        )
        if bidirectional:
            config["mask_token_id"] = tokenizer.mask_id
    return config


def _longest_context(config, ours: int) -> int:
    """The context a model started from an ``hf:DIR`` folder keeps: the folder's
    ``max_position_embeddings`` (Llama 3.1's 131,072), where longer than the run's own."""
    from muloco.hf.config import read
    from muloco.models import hf_folder

    folder = hf_folder(config.model.flavor)
    theirs = read(folder).get("max_position_embeddings") if folder is not None else None
    return max(ours, theirs) if isinstance(theirs, int) else ours


def _shipped_code(config: dict) -> Path | None:
    """The model class file a folder with this config needs (None: transformers has the class)."""
    return {"muloco_mdlm": MDLM_CODE, "muloco": MULOCO_CODE}.get(config.get("model_type"))


def _llama_config(model_config, tokenizer, seq_len: int) -> dict:
    return llama_config(model_config, tokenizer.bos_id, tokenizer.eos_id, seq_len)


def global_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 over θ_g's bytes in parameter order: what the outer loop records as
    ``final_global_sha256`` (its fragments hold the parameters in this order)."""
    import torch

    h = hashlib.sha256()
    for p in model.parameters():
        if p.requires_grad:  # the outer loop holds trainable parameters only (a LoRA run's adapters)
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _check_global(model: torch.nn.Module, summary: dict, step: int) -> str:
    """θ_g's fingerprint; at the run's last step it must be the one the run recorded."""
    fingerprint = global_fingerprint(model)
    recorded = (summary.get("diloco") or {}).get("final_global_sha256")
    if recorded and summary.get("steps") == step and recorded != fingerprint:
        raise ExportError(
            f"θ_g of step {step} hashes to {fingerprint[:16]}…, but the run recorded "
            f"{recorded[:16]}… at its end: the checkpoint is not the run's final θ_g"
        )
    return fingerprint


LICENSE_ID = re.compile(r"[a-z0-9][a-z0-9.+-]*")
"""The Hub's license ids (apache-2.0, mit, cc-by-4.0, llama3, other, ...)."""


def _card(
    run: Path,
    config,
    step: int,
    is_global: bool,
    summary: dict,
    fingerprint: str | None,
    remote_code: bool = False,
    license: str | None = None,
) -> str:
    """The model card: what was trained, how (the run's own command), and what it reached."""
    record = json.loads((run / RUN_FILE).read_text())
    ft = getattr(config, "fault_tolerance", None)
    k = getattr(ft, "group_size", 1) if ft is not None and getattr(ft, "enable", False) else 1
    diloco = summary.get("diloco") or {}
    name = config.objective._owner.name
    what = config.objective.describe()
    lines = [
        *_front_matter(config, config.objective._owner, license),
        f"# {config.model.flavor}, trained with muloco",
        "",
        f"- objective: {what} (`{name}`)",
        f"- weights: {'θ_g, the global model of the run' if is_global else 'the model'} at step {step}",
        f"- config module: `{_config_name(record['config'])}`; "
        f"overrides: `{' '.join(_shown(record['args'])) or '(none)'}`",
    ]
    if k > 1:
        outer = config.outer
        lines.append(f"- outer loop: K={k} replica groups, H={outer.sync_every}")
        if diloco.get("bits_per_parameter") is not None:
            lines.append(f"- bits per parameter sent per sync: {diloco['bits_per_parameter']}")
    if fingerprint:
        lines.append(f"- θ_g sha256: `{fingerprint}`")
    lines += [
        f"- tokens seen (per replica group): {summary.get('tokens_seen', 'not recorded')}",
        f"- final validation loss: {summary.get('final_validation_loss', 'not recorded')} nats/token, "
        f"{summary.get('final_validation_bits_per_byte', 'not recorded')} bits/byte",
        "",
        *(_ar_usage(remote_code) if config.objective._owner.causal else _mdlm_usage(config.objective.recipe)),
        "",
    ]
    return "\n".join(lines)


def _front_matter(config, objective, license: str | None = None) -> list[str]:
    """The Hub's YAML header: the license when given (muloco cannot know the weights' terms: they
    follow the training data's), library, pipeline, tags and the training data when it is a Hub dataset."""
    source = config.dataloader.source
    dataset = getattr(source, "dataset", "") if getattr(source, "name", "") == "huggingface" else ""
    dataset = "" if getattr(source, "dataset_path", None) else dataset
    lines = [
        "---",
        *([f"license: {license}"] if license else []),
        "library_name: transformers",
        f"pipeline_tag: {objective.pipeline_tag}",
        "tags:",
        "  - muloco",
        f"  - {objective.hub_tag}",
    ]
    if hasattr(config, "outer"):
        lines.append("  - diloco")
    if dataset:
        lines += ["datasets:", f"  - {dataset}"]
    return [*lines, "---", ""]


def _mdlm_usage(recipe) -> list[str]:
    """How to sample: the loop below for a full-attention model; a shifted or block-wise one needs
    muloco's samplers, which read ``diffusion_readout`` from config.json."""
    readout = recipe.build().readout
    if readout.to_json() is None:
        return _MDLM_USAGE
    how = [f"This model's recipe changes how it is read (config.json's `{READOUT_KEY}`):"]
    if readout.shift:
        how.append("- the logits at position i - 1 predict token i (Dream's token shift);")
    if readout.block_size:
        how.append(
            f"- it attends block-wise: blocks of {readout.block_size} tokens, each seeing itself and the "
            "finished blocks before it; sample block by block."
        )
    return how + [
        "",
        "`python -m muloco.generate --checkpoint RUN` and `python -m muloco.evaluate DIR` sample and "
        "score it as it was trained (block-wise models with an exact key/value cache).",
    ]


def _ar_usage(remote_code: bool) -> list[str]:
    shipped = ", trust_remote_code=True" if remote_code else ""
    return [
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"model = AutoModelForCausalLM.from_pretrained(DIR{shipped})",
        "tokenizer = AutoTokenizer.from_pretrained(DIR)",
        "```",
    ]


_MDLM_USAGE = [
    "Load it with the model class shipped here, then denoise: start from mask tokens after the prompt and,",
    "at each step, fix the most confident of the masked positions (LLaDA's low-confidence remasking).",
    "",
    "```python",
    "import torch",
    "from transformers import AutoModelForMaskedLM, AutoTokenizer",
    "model = AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True).eval()",
    "tokenizer = AutoTokenizer.from_pretrained(DIR)",
    "mask, length = model.config.mask_token_id, 32",
    'x = torch.tensor([tokenizer("Once upon a time")["input_ids"] + [mask] * length])',
    "with torch.no_grad():",
    "    for _ in range(length):",
    "        logits = model(x).logits",
    '        logits[..., mask] = -float("inf")',
    "        confidence, token = logits.softmax(-1).max(-1)",
    "        confidence[x != mask] = -1",
    "        i = confidence.argmax()",
    "        x.view(-1)[i] = token.view(-1)[i]",
    "print(tokenizer.decode(x[0]))",
    "```",
    "",
    "`python -m muloco.generate --checkpoint RUN` samples with muloco's own sampler (blocks, cache, threshold).",
]


def _config_name(path: str) -> str:
    """``ddp/adamw`` for ``/somewhere/config/ddp/adamw.py`` (no path of this machine in the card)."""
    parts = Path(path).with_suffix("").parts
    return "/".join(parts[parts.index("config") + 1 :]) if "config" in parts else Path(path).stem


def _shown(args: list[str]) -> list[str]:
    """The user's overrides: without the output folder, the options the launcher adds for each
    replica group (its id, K, the quorum), and no path of the machine it ran on."""
    shown, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--dump_folder", *LAUNCHER_KEYS):
            skip = True
        elif not arg.startswith(("--dump_folder=", *(f"{key}=" for key in LAUNCHER_KEYS))):
            key, eq, value = arg.partition("=")
            if (value if eq else key).startswith(("/", "~")):
                arg = f"{key}=<path>" if eq else "<path>"
            shown.append(arg)
    return shown


def _hf_tokenizer(tokenizer):
    """The run's tokenizer as a ``tokenizers`` object: its tokenizer.json, or its tiktoken file
    converted (:mod:`muloco.hf.tokenizer`)."""
    from tokenizers import Tokenizer

    if _tokenizer_file(tokenizer) is not None:
        return Tokenizer.from_file(str(_tokenizer_file(tokenizer)))
    optional.require("transformers", "exporting a tiktoken tokenizer")
    # start-up: the tokenizer conversion loads transformers (seconds), only for the export itself
    from muloco.data.tokenizer import LLAMA3_PAT_STR, read_tiktoken_ranks, tiktoken_special_tokens
    from muloco.hf.tokenizer import tiktoken_to_hf

    return tiktoken_to_hf(read_tiktoken_ranks(tokenizer.path), LLAMA3_PAT_STR, tiktoken_special_tokens())


def _write_tokenizer(tokenizer, out: Path, max_length: int) -> None:
    """tokenizer.json with BOS added in front of every text, as muloco's loader adds it, and its config."""
    from tokenizers.processors import TemplateProcessing

    hf = _hf_tokenizer(tokenizer)
    bos, eos = hf.id_to_token(tokenizer.bos_id), hf.id_to_token(tokenizer.eos_id)
    hf.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_id)]
    )
    hf.save(str(out / "tokenizer.json"))
    special = {"bos_token": bos, "eos_token": eos}
    if getattr(tokenizer, "mask_id", None) is not None:
        special["mask_token"] = hf.id_to_token(tokenizer.mask_id)
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **special, "model_max_length": max_length}, indent=2)
    )


def _summary(run: Path) -> dict:
    try:
        return json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def _save_weights(state: dict[str, torch.Tensor], out: Path) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if total <= SHARD_BYTES:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        if current and size + t.numel() * t.element_size() > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += t.numel() * t.element_size()
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


ADAPTER_FOLDER = "adapter"
"""A LoRA run's export keeps its adapter alone here, as a peft folder."""


def _export_lora(model, config, lora_base: bool, target: Path, staging: Path) -> None:
    """A LoRA run's adapter written alone as a peft folder (:mod:`muloco.hf.peft`) under
    :data:`ADAPTER_FOLDER`, then merged into the weights unless ``lora_base`` keeps the frozen base."""
    from muloco.hf.peft import save_adapter
    from muloco.models.lora import lora_modules, merge_lora

    if not lora_modules(model):
        if lora_base:
            raise ExportError("--lora-base exports the frozen base of a LoRA run; this run trained every parameter")
        return
    ckpt = config.checkpoint
    if ckpt.initial_load_path and ckpt.initial_load_in_hf:
        base = ckpt.initial_load_path  # the folder the run started from: the adapter goes onto it
    else:  # OUT itself only when it holds the base; a merged OUT would take the update twice
        base = str(target) if lora_base else ""
    save_adapter(model, model.config, config.model.lora, staging / ADAPTER_FOLDER, base_model_name_or_path=base)
    if not lora_base:
        merge_lora(model)


def _check_writable(out: str) -> None:
    """Before the checkpoint is converted: the folder can be made there (not below a file, not in
    /proc); the probe leaves nothing."""
    from muloco.config.checks import check_dump_folder
    from muloco.config.loader import ConfigError

    try:
        check_dump_folder(out, flag="--out")
    except ConfigError as err:
        raise ExportError(str(err)) from None


def export(
    checkpoint: str,
    out: str,
    *,
    step: int | None = None,
    replica: int | None = None,
    force: bool = False,
    license: str | None = None,
    lora_base: bool = False,
) -> Path:
    """Write the Hugging Face folder ``out`` (atomically: a failed export leaves nothing)."""
    target = Path(out).resolve()
    if target == Path.cwd().resolve() or target in Path.cwd().resolve().parents:
        raise ExportError(f"--out {out} is the current folder or holds it; choose a folder of its own")
    if target.exists() and not target.is_dir():
        raise ExportError(f"--out {out} is a file; choose a folder")
    if target.exists() and any(target.iterdir()) and not force:
        raise ExportError(f"--out {out} exists and is not empty; choose another folder or pass --force")
    _check_writable(out)
    # torch-bound, so imported only once the command line parsed (--help and usage errors stay fast)
    from muloco import compat

    compat.apply()  # before torchtitan is imported (idempotent)
    import torch

    from muloco.hf.adapter import Llama3Adapter
    from muloco.objectives.recipes import readout_of
    from muloco.trained_model import load_config, load_model, locate

    run, step = locate(checkpoint, replica, step)
    config = load_config(run, prog="python -m muloco.export")
    model, tokenizer, objective, step, is_global = load_model(run, config, step, torch.device("cpu"))
    why = _unsupported(model.config, objective, tokenizer)
    if why:
        raise ExportError(f"cannot export {run}: {why}")
    summary = _summary(run)
    fingerprint = _check_global(model, summary, step) if is_global else None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    as_umask_says(staging, folder=True)  # the export is a normal folder: teammates read it as the umask says
    try:
        _export_lora(model, config, lora_base, target, staging)
        state = {k: v.float() for k, v in model.state_dict().items() if ".lora_" not in k}  # --lora-base: the base
        _save_weights(Llama3Adapter(model.config).to_hf(state), staging)
        written = hf_config(model.config, tokenizer, config.training.seq_len, not objective.causal)
        written["max_position_embeddings"] = _longest_context(config, written["max_position_embeddings"])
        readout = readout_of(config.objective).to_json()
        if readout is not None:  # how the outputs line up: muloco's samplers and scorers read it back
            written[READOUT_KEY] = readout
        (staging / "config.json").write_text(json.dumps(written, indent=2))
        code = _shipped_code(written)
        if code is not None:
            shutil.copyfile(code, staging / code.name)
        (staging / "generation_config.json").write_text(
            json.dumps({"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}, indent=2)
        )
        _write_tokenizer(tokenizer, staging, config.training.seq_len)
        (staging / "README.md").write_text(
            _card(run, config, step, is_global, summary, fingerprint, remote_code=code is not None, license=license)
        )
        for path in staging.rglob("*"):  # safetensors writes its files 0600
            as_umask_says(path, folder=path.is_dir())
        old = None
        if target.exists():  # --force: the old folder goes only once the new one is in place
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, old / target.name)
        os.replace(staging, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
