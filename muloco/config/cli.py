"""Command line: ``--config <module> [--section.key value ...]``.

Overrides are parsed by tyro with torchtitan's rules, so every dataclass field is
reachable and ``--help`` lists each with its default. Before tyro sees them, fields that
hold one of several config classes are set from their names (``--outer.exchange.codec
quantize``, see ``variants.py``) and every ``--key`` is checked against the config's
fields: a misspelt key is an error that names the closest valid keys (MuLoCo's own
launcher silently drops them), a setting of an unchosen variant names where it belongs.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Iterator

import tyro
from torchtitan.config.manager import ConfigManager, custom_registry

from muloco.config.gpu_preset import split_batch_over_groups
from muloco.config.loader import ConfigError, load_config
from muloco.config.variants import apply_choices, describe_choices, misplaced_key_hint

DEFAULT_CONFIG = "base"

RETIRED_KEYS = {
    "dataloader.format": "SFT rows are a data source now: --dataloader.source sft "
    "--dataloader.source.dataset_path FILE (plain text: --dataloader.source jsonl).",
    "model.causal": "the attention direction follows the objective: --objective mdlm trains a "
    "bidirectional model, --objective ar (the default) a causal one.",
}
"""Keys that no longer exist, with what replaced them."""


def _leaf_keys(obj, prefix: str = "") -> Iterator[tuple[str, object]]:
    for f in dataclasses.fields(obj):
        if f.name.startswith("_") or not f.init:
            continue
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from _leaf_keys(value, key + ".")
        else:
            yield key, value


def valid_keys(config) -> dict[str, object]:
    """Every overridable key (underscore spelling) mapped to its current value."""
    keys = dict(_leaf_keys(config))
    keys.pop("model_spec", None)
    return keys


def _normalise(flag: str) -> str:
    return flag[2:].split("=", 1)[0].replace("-", "_")


DILOCO_SECTIONS = ("outer", "fault_tolerance")
"""Sections only a DiLoCo config has."""


def check_keys(config, args: list[str], config_name: str | None = None) -> None:
    keys = valid_keys(config)
    for arg in args:
        if not arg.startswith("--") or arg in ("--help", "-h"):
            continue
        key = _normalise(arg)
        section, _, leaf = key.rpartition(".")
        negated = f"{section}.{leaf[3:]}" if section else leaf[3:]
        if key in keys or (leaf.startswith("no_") and isinstance(keys.get(negated), bool)):
            continue
        retired = RETIRED_KEYS.get(negated if leaf.startswith("no_") else key)
        if retired:
            raise ConfigError(f"unknown config key '--{key}': {retired}")
        section_root = key.split(".", 1)[0]
        if section_root in DILOCO_SECTIONS and not any(k.startswith(section_root + ".") for k in keys):
            raise ConfigError(
                f"unknown config key '--{key}': {config_name or 'this config'} has no outer loop (it "
                "trains one data-parallel group); the outer-loop settings belong to a DiLoCo config "
                "such as --config diloco/diloco"
            )
        misplaced = misplaced_key_hint(config, key)
        if misplaced:
            raise ConfigError(f"unknown config key '--{key}': {misplaced}")
        close = _abbreviations(key, keys) + difflib.get_close_matches(key, list(keys), n=3, cutoff=0.5)
        close = list(dict.fromkeys(close))[:3]
        if not close and section:
            close = [k for k in keys if k.startswith(section + ".")][:8]
        hint = f" Closest valid keys: {', '.join('--' + c for c in close)}." if close else ""
        raise ConfigError(f"unknown config key '--{key}'.{hint} See --help for all keys.")


def _initials(name: str) -> str:
    return "".join(word[0] for word in name.split("_") if word)


def _abbreviations(key: str, keys) -> list[str]:
    """Keys of the same section whose name is the typed one's initials or the other way round
    (``optimizer.learning_rate`` → ``optimizer.lr``), which spelling similarity misses."""
    section, _, leaf = key.rpartition(".")
    out = []
    for k in keys:
        s, _, last = k.rpartition(".")
        initialled = _initials(leaf) == last or _initials(last) == leaf
        if s == section and last != leaf and "_" in (leaf + last) and initialled:
            out.append(k)
    return out


def split_config_arg(argv: list[str]) -> tuple[str, list[str]]:
    name, rest, i = DEFAULT_CONFIG, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a value, e.g. --config ddp/adamw")
            name, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            name = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return name, rest


def parse_args(argv: list[str] | None = None, prog: str = "python -m muloco.train"):
    """Load the config module named by --config and apply the overrides."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name, rest = split_config_arg(argv)
    loaded = load_config(name)
    rest = apply_choices(loaded, rest)
    check_keys(loaded, rest, name)
    _ensure_tyro_rules()
    config = tyro.cli(
        type(loaded),
        args=rest,
        default=loaded,
        registry=custom_registry,
        prog=prog,
        description=f"muloco trainer (config module: {name}). {describe_choices(loaded)}".strip(),
    )
    try:
        split_batch_over_groups(config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _steps_or_epochs(config, rest)
    return name, config


def _steps_or_epochs(config, overrides: list[str]) -> None:
    """The run's length from one of ``training.steps`` and ``training.epochs``: both on the command
    line is an error; steps on the command line win over epochs a config module set."""
    given = {arg[2:].split("=", 1)[0] for arg in overrides if arg.startswith("--")}
    if {"training.steps", "training.epochs"} <= given:
        raise ConfigError("--training.steps and --training.epochs both set the run's length; give one of them.")
    if "training.steps" in given:
        config.training.epochs = 0.0


_tyro_rules_registered = False


def _ensure_tyro_rules() -> None:
    """torchtitan's list[str] and override-import rules, registered once per process."""
    global _tyro_rules_registered
    if not _tyro_rules_registered:
        ConfigManager()  # its constructor registers the rules on custom_registry
        _tyro_rules_registered = True
