"""Config fields that hold one of several config classes, picked on the command line by name.

A field typed as a union of config classes, each annotated with
``tyro.conf.subcommand(NAME)`` (the exchange's ``codec`` and ``strategy``), is a *variant
field*. ``--outer.exchange.codec quantize`` puts a ``Quantizer.Config`` there (the one the
config module set, if it is already that class: its settings are kept), and the chosen
class's own settings are then ordinary keys (``--outer.exchange.codec.bits 2``): tyro
parses them because the fields are marked ``AvoidSubcommands`` (no subcommand syntax; the
default, i.e. the chosen instance, is what it fills in); ``--FIELD.name NAME`` is the same
as ``--FIELD NAME``. Switching variants keeps only the settings their common config class lists in
``carried_on_switch`` (the outer optimizers' lr and momentum). A setting of another variant is
an error that names the chosen one and where the setting belongs. The names come from the
type annotation itself: no registry to keep in step.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterator
from typing import Any, get_args, get_origin

from muloco.config.loader import ConfigError

AUTO = "auto"
"""Selects None in a variant field that allows it (the owner then picks a default)."""


def _strip_annotated(tp):
    while get_origin(tp) is typing.Annotated:
        tp = get_args(tp)[0]
    return tp


def _subcommand_name(tp) -> str | None:
    for meta in getattr(tp, "__metadata__", ()):
        name = getattr(meta, "name", None)
        if isinstance(name, str) and type(meta).__name__.lower().endswith("subcommandconfig"):
            return name
    return None


def choices(tp) -> dict[str, type | None] | None:
    """``{name: config class}`` (``auto``: None) of a variant field's type, or None if it is not one."""
    union = _strip_annotated(tp)
    if get_origin(union) not in (typing.Union, types.UnionType):
        return None
    out: dict[str, type | None] = {}
    for arg in get_args(union):
        if arg is type(None):
            out[AUTO] = None
            continue
        name = _subcommand_name(arg)
        if name is None:
            return None
        out[name] = _strip_annotated(arg)
    return out


def _hints(cls) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except Exception:  # noqa: BLE001 - a class whose hints do not resolve has no variant fields
        return {}


def variant_fields(config, prefix: str = "") -> Iterator[tuple[str, Any, str, dict[str, type | None]]]:
    """(dotted key, owner object, field name, choices) of every variant field under ``config``."""
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        if f.name.startswith("_") or not f.init:
            continue
        value = getattr(config, f.name)
        options = choices(hints.get(f.name))
        if options:
            yield f"{prefix}{f.name}", config, f.name, options
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from variant_fields(value, f"{prefix}{f.name}.")


def name_of(value, options: dict[str, type | None]) -> str:
    for name, cls in options.items():
        if (cls is None and value is None) or (cls is not None and type(value) is cls):
            return name
    return type(value).__name__


def _flag_value(args: list[str], i: int) -> tuple[str | None, int]:
    """The value of the flag at ``args[i]`` (``--k v`` or ``--k=v``) and how many args it spans."""
    if "=" in args[i]:
        return args[i].split("=", 1)[1], 1
    return (args[i + 1], 2) if i + 1 < len(args) and not args[i + 1].startswith("--") else (None, 1)


def _index(config) -> dict[str, tuple[Any, str, dict[str, type | None]]]:
    return {key: (owner, name, options) for key, owner, name, options in variant_fields(config)}


def _shared_settings(current, cls) -> dict[str, Any]:
    """The settings a switch from ``current`` to ``cls`` keeps: those their nearest common config
    class names in its ``carried_on_switch`` (``--outer.optimizer sgd`` keeps the lr and momentum a
    config module gave Nesterov). Nothing else is carried: a field both variants have may still mean
    different things or have other defaults in each (an objective's document mask, a recipe's
    annealing, a JSONL path against a Hugging Face dataset name)."""
    if current is None:
        return {}
    common = next((base for base in type(current).__mro__ if isinstance(base, type) and issubclass(cls, base)), None)
    return {name: getattr(current, name) for name in getattr(common, "carried_on_switch", ())}


def apply_choices(config, args: list[str]) -> list[str]:
    """Set every variant field named on the command line; returns the other arguments."""
    fields = _index(config)
    rest, i = [], 0
    while i < len(args):
        arg = args[i]
        key = arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") else None
        if key is not None and key.endswith(".name") and key[:-5] in fields:
            key = key[:-5]  # --objective.name mdlm spells --objective mdlm
        if key not in fields:
            rest.append(arg)
            i += 1
            continue
        owner, name, options = fields[key]
        value, span = _flag_value(args, i)
        if value not in options:
            raise ConfigError(f"--{key} must be one of {', '.join(options)}; got {value!r}.")
        current, cls = getattr(owner, name), options[value]
        if cls is None:
            setattr(owner, name, None)
        elif type(current) is not cls:
            setattr(owner, name, cls(**_shared_settings(current, cls)))
        fields = _index(config)  # the new value may hold variant fields of its own
        i += span
    return rest


def misplaced_key_hint(config, key: str) -> str | None:
    """Why ``key`` is not a setting, if it belongs to an unchosen variant or to a variant's
    settings spelt without the field's name (``--outer.exchange.bits`` for
    ``--outer.exchange.codec.bits``)."""
    for field_key, owner, name, options in variant_fields(config):
        chosen = name_of(getattr(owner, name), options)
        section = field_key.rpartition(".")[0]
        if key.startswith(field_key + "."):
            leaf, where = key[len(field_key) + 1 :], field_key
        elif section and key.startswith(section + ".") and "." not in key[len(section) + 1 :]:
            leaf, where = key[len(section) + 1 :], None
        else:
            continue
        owners = [
            n for n, cls in options.items() if cls is not None and leaf in {f.name for f in dataclasses.fields(cls)}
        ]
        if not owners:
            known = {f.name for cls in options.values() if cls is not None for f in dataclasses.fields(cls)}
            if where is not None and "." not in leaf and not difflib.get_close_matches(leaf, known):
                # not a typo of a variant's setting: --outer.round.mode, a spelling of picking one
                return (
                    f"no {field_key} variant ({', '.join(options)}; now {chosen}) has a setting {leaf!r}; "
                    f"a variant is picked with --{field_key} NAME."
                )
            continue
        if where is None:
            if chosen in owners:
                return f"did you mean --{field_key}.{leaf} (a setting of {field_key} {chosen})?"
            return (
                f"{leaf} is a setting of {field_key} {' or '.join(owners)}: pick it with "
                f"--{field_key} {owners[0]}, then set --{field_key}.{leaf}."
            )
        if chosen in owners:
            continue
        value = getattr(owner, name)
        mine = ", ".join(f.name for f in dataclasses.fields(value)) if value is not None else ""
        mine = f"its settings: {mine}" if mine else "it has none"
        return (
            f"{field_key} is {chosen}, which has no setting {leaf!r} ({mine}); "
            f"{leaf} belongs to {' or '.join(owners)}: pick it with --{field_key} {owners[0]}."
        )
    return None


def describe_choices(config) -> str:
    """One line for --help: every variant field, its choices and what is chosen now."""
    parts = [
        f"--{key} {'|'.join(options)} (now: {name_of(getattr(owner, name), options)})"
        for key, owner, name, options in variant_fields(config)
    ]
    return "Choices: " + "; ".join(parts) + "." if parts else ""
