"""What a run is, taken from its resolved config: the facts ``run.json`` records.

The report, the sweeps and anything that compares runs read these facts instead of guessing
from a config module's file name or from regular expressions over command lines: a config
module ``exp_a.py`` that loads ``diloco/muloco_2bit`` is MuLoCo 2-bit because its resolved
config has Muon inside, an outer loop and a 2-bit codec, whatever it is called.

``facts_of`` reads a trainer config (imports nothing heavy itself); ``method_of`` names the
method from facts alone (no torch import: the report uses it). A ``run.json`` written before
facts were recorded has none: ``missing_facts`` names what is unknown, and nothing is guessed.
``dump_folder_in`` finds a run's folder in a trainer command line, for what does not parse the
config (a launcher's custom command, a sweep manifest's line).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from muloco.utils.atomic_file import write_atomically

RUN_FILE = "run.json"
"""In a run folder: the command that made it (config module, overrides, working directory),
written by ``muloco.train`` (how ``muloco.generate`` rebuilds the model), and its ``facts``."""
FACTS_VERSION = 2
"""2: a codec's facts carry its method ``tag``, name ``detail`` and ``lossless`` (``Codec.Config.facts``)."""
FACT_KEYS = ("method", "objective", "model", "inner_optimizer", "outer", "data", "seed", "versions", "commit")
"""Every key ``facts_of`` writes (``outer`` is None for a run without an outer loop)."""
PACKAGES = ("torch", "torchtitan", "torchft", "muloco")


def _variant_name(config: Any) -> str:
    """The name a variant config class is chosen by (``quantize``, ``allgather``, ``mdlm``)."""
    owner = getattr(type(config), "_owner", None)
    return str(getattr(owner, "name", type(config).__name__))


def _settings(config: Any) -> dict[str, Any]:
    return {
        f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init and not f.name.startswith("_")
    }


def codec_facts(exchange: Any) -> dict[str, Any]:
    """The codec's facts as it states them (``Codec.Config.facts``: name, wire bits per element,
    the tag a method's name carries, lossless or not, its settings)."""
    return exchange.codec.facts()


def outer_facts(config: Any) -> dict[str, Any] | None:
    """K, H, fragments and overlap, the outer optimizer, codec, error feedback and strategy."""
    outer = getattr(config, "outer", None)
    if outer is None:
        return None
    exchange = outer.exchange
    codec = codec_facts(exchange)
    ef = exchange.error_feedback
    lossy = not codec["lossless"]  # what ErrorFeedback.applies_to asks
    return {
        "replica_groups": config.fault_tolerance.group_size,
        "quorum": config.fault_tolerance.min_replica_size or None,
        "sync_every": outer.sync_every,
        "fragments": outer.num_fragments,
        "overlap_steps": outer.fragment_sync_delay,
        "fragment_update_alpha": outer.fragment_update_alpha,
        "optimizer": outer.optimizer.facts(),
        "step_schedule": {
            name: _settings(getattr(outer.step_schedule, name))
            for name in ("lr", "momentum", "feedback_beta")
            if not getattr(outer.step_schedule, name).constant
        },
        "codec": codec,
        "error_feedback": {"enabled": bool(ef.enabled) and lossy, "beta": ef.beta},
        "strategy": _variant_name(exchange.resolved_strategy()),
        "skip_pattern": exchange.skip_pattern,
        "tiles": exchange.tiles,
        "weighting": exchange.resolved_weighting(outer.round.auto_weighting),
        "round": {"mode": _variant_name(outer.round), **_settings(outer.round)},
        "link": _link_facts(getattr(outer, "link", None)),
    }


def _link_facts(link: Any) -> dict[str, float] | None:
    """The emulated link (None: the real network)."""
    if link is None or not link.enabled:
        return None
    return {"mbps": float(link.mbps), "latency_ms": float(link.latency_ms)}


def data_facts(dataloader: Any) -> dict[str, Any]:
    """The data source and the settings it reads (each source's config holds only those)."""
    source = dataloader.source
    return {"source": source.name, **{f.name: getattr(source, f.name) for f in dataclasses.fields(source)}}


def facts_of(config: Any, *, parameters: int | None = None, environment: bool = True) -> dict[str, Any]:
    """Every fact of a resolved trainer config; ``parameters`` once the model is built;
    ``environment``: the package versions and the project's commit too (a sweep naming its
    runs needs only the config's)."""
    optimizer = config.optimizer
    facts = {
        "facts_version": FACTS_VERSION,
        "objective": _variant_name(config.objective),
        "model": {"flavor": config.model.flavor, "parameters": parameters},
        "inner_optimizer": {"name": optimizer.name, "lr": optimizer.lr, "weight_decay": optimizer.weight_decay},
        "outer": outer_facts(config),
        "data": data_facts(config.dataloader),
        "seed": config.debug.seed,
    }
    recipe = getattr(config.objective, "recipe", None)
    if recipe is not None:  # masked diffusion: its conversion recipe (muloco.objectives.recipes)
        facts["recipe"] = recipe.build().describe()
    if environment:
        facts.update(versions=package_versions(), commit=source_commit())
    facts["method"] = method_of(facts)
    return facts


def method_of(facts: dict[str, Any]) -> str:
    """ddp-adamw, ddp-muon, diloco[-codec][-streaming], muloco[-codec][-streaming], from facts:
    MuLoCo is Muon inside an outer loop; the codec suffix is ``-<bits>bit``, ``-topk`` or the
    wire dtype of a dense exchange other than float32; streaming is more than one fragment; a round
    mode other than the default lockstep adds its name (``-deadline``)."""
    inner = str(facts["inner_optimizer"]["name"]).lower()
    outer = facts["outer"]
    if outer is None:
        return f"ddp-{inner}"
    codec = outer["codec"]
    tag = codec["tag"] if "tag" in codec else _tag_before_codecs_named_it(codec)
    suffix = f"-{tag}" if tag else ""
    streaming = "-streaming" if outer["fragments"] > 1 else ""
    mode = (outer.get("round") or {}).get("mode") or "lockstep"
    rounds = "" if mode == "lockstep" else f"-{mode}"
    return ("muloco" if inner == "muon" else "diloco") + suffix + streaming + rounds


def _tag_before_codecs_named_it(codec: dict[str, Any]) -> str:
    """The method tag of a codec recorded before codecs stated their own (facts version 1): the
    three codecs that existed then, as they were named."""
    if codec["name"] == "quantize":
        return f"{codec['bits']}bit"
    if codec["name"] == "topk":
        return "topk"
    dtype = codec.get("dtype", "float32")
    return "" if dtype == "float32" else dtype


def missing_facts(record: dict[str, Any] | None) -> list[str]:
    """The facts a ``run.json`` (None: no file) does not record; [] when it records them all."""
    facts = (record or {}).get("facts")
    if not isinstance(facts, dict):
        return list(FACT_KEYS)
    return [k for k in FACT_KEYS if k not in facts]


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def source_commit() -> dict[str, Any] | None:
    """The project's git commit and whether tracked files differ from it; None outside a checkout."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return {"sha": head.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def update_run_record(folder: str | os.PathLike, **parts: Any) -> None:
    """Set ``parts`` (``config``/``args``/``cwd`` of the command, ``facts``) in ``folder``'s
    ``run.json``, keeping what else it holds; readers see the old file or the new one whole."""

    path = Path(folder) / RUN_FILE
    try:
        record = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        record = {}
    if not isinstance(record, dict):
        record = {}
    record.update(parts)
    write_atomically(path, json.dumps(record, indent=2, default=str))


def dump_folder_in(overrides: list[str]) -> str | None:
    """The ``--dump_folder`` among trainer overrides (the last one, as the trainer reads them);
    for what does not parse the trainer config (a custom command, a sweep manifest's line)."""
    folder = None
    for i, arg in enumerate(overrides):
        if arg == "--dump_folder" and i + 1 < len(overrides):
            folder = overrides[i + 1]
        elif arg.startswith("--dump_folder="):
            folder = arg.split("=", 1)[1]
    return folder
