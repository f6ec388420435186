"""The sizing CLI: ``muloco map`` (``python -m muloco.model_map``): the model map's table, or with
``--link-mbps`` the link planner's report, for one or more flavors (``flavors.py`` holds the map,
``link_plan.py`` the planner; this module only reads the command line and prints)."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from muloco.models.flavors import (
    LLAMA3_VOCAB,
    SHAPES,
    SOURCES,
    VOCAB_MULTIPLE,
    WD_REFERENCE_BATCH,
    default_vocab,
    embedded_vocab,
    padded_vocab,
    parse_flavor,
    sizing,
)
from muloco.utils.command_line import failed, parse, tyro
from muloco.utils.errors import BAD_INPUT, MulocoError

_DESCRIPTION = (
    "The model map: every flavor's shape, parameter count, token budget and tuned settings; with "
    "--link-mbps, what the link between replica groups costs."
)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


PLANNER_DEFAULTS = {
    "latency_ms": 0.0,
    "bits": 32,
    "strategy": "auto",
    "sync_every": 30,
    "step_seconds": None,
    "mfu": None,
    "gpu": None,
    "gpus_per_group": 1,
    "streaming_fragments": 1,
    "overlap": 0,
    "max_share": 0.05,
    "group_slowdowns": (),
    "round_quantile": 1.0,
    "round_min_steps": 1,
    "round_max_steps": 0,
}
"""The planner's options and their defaults (``None`` in ``PlannerOptions``, so a planner option
given without ``--link-mbps`` is seen and refused instead of dropped)."""
PLANNER_REPLICAS = 2
"""K the planner assumes when ``--replicas`` is not given (a link joins at least two groups)."""


VOCAB_NAMES = ("auto", "embedded", "llama3")


@dataclass
class PlannerOptions:
    """With --link-mbps: what the link between the K replica groups costs one --flavor (python -m muloco.model_map
    --flavor F --replicas K --link-mbps B --bits b --sync-every H --step-seconds s)."""

    link_mbps: float | None = None
    """Bandwidth between replica groups, each direction, in megabits per second (turns the planner on)."""
    latency_ms: float | None = None
    """One-way latency per collective round (default 0)."""
    bits: int | None = None
    """32 (default) | 16 (dense fp32 / bf16) | 8 | 4 | 2 | 1 (quantized)."""
    strategy: str | None = None
    """auto (default) | allreduce | allgather | reduce_scatter."""
    sync_every: int | None = None
    """H: inner steps between syncs (default 30)."""
    step_seconds: float | None = None
    """Seconds per inner step (else from --mfu and --gpu)."""
    mfu: float | None = None
    """Model FLOPs utilization (default 0.4)."""
    gpu: str | None = None
    """h100 (default) | h200 | a100 | b200 | l40s, or a peak in TFLOPS."""
    gpus_per_group: int | None = None
    """GPUs of one replica group (default 1)."""
    streaming_fragments: int | None = None
    """n: fragments synced in turn (default 1)."""
    overlap: int | None = None
    """τ: inner steps each sync overlaps (default 0)."""
    max_share: float | None = None
    """Largest share of a round on the link (default 0.05)."""
    group_slowdowns: tuple[float, ...] | None = None
    """Each replica group's step time as a multiple of the step, one per group (e.g. 1 1 1.5: the third
    1.5x slower): what lockstep rounds lose waiting for the slowest, and what deadline rounds train
    instead (default: equal groups)."""
    round_quantile: float | None = None
    """Deadline rounds: H times this quantile of the groups' step times (default 1: the slowest's H steps)."""
    round_min_steps: int | None = None
    """Deadline rounds: fewest inner steps a group trains per round (default 1)."""
    round_max_steps: int | None = None
    """Deadline rounds: most inner steps a group trains per round (default 0: 2H)."""


@dataclass
class MapOptions:
    """The model map, or with --link-mbps the link planner."""

    flavor: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """Only this flavor (repeatable); any llama3-w{width}-d{depth}-h{heads} shape, not only the map's rows."""
    global_batch: int = WD_REFERENCE_BATCH
    """Sequences per optimizer step."""
    seq_len: int = 2048
    """Tokens per sequence."""
    vocab: int | str = "auto"
    """auto (default) | embedded | llama3 | a number of tokens | a tokenizer file or folder.
    auto: the tokenizer the shipped configs train each shape with (embedded below width 512, else llama3).
    Padded to a multiple of 64, as the model pads it."""
    replicas: int | None = None
    """K replica groups (DiLoCo/MuLoCo weight-decay rule; default 1, and 2 for the link planner)."""
    json: bool = False
    """One JSON object per flavor (or the plan as one object)."""
    link_planner: Annotated[PlannerOptions, tyro.conf.OmitArgPrefixes] = field(default_factory=PlannerOptions)


def _check_vocab(vocab: int | str) -> None:
    """``--vocab``: a size of at least 1, a name, or a tokenizer path that exists."""
    if isinstance(vocab, int):
        if vocab < 1:
            raise ValueError(f"--vocab: {vocab} is not a vocabulary size (at least 1)")
    elif vocab not in VOCAB_NAMES and not Path(vocab).expanduser().exists():
        raise ValueError(
            f"--vocab: {vocab!r} is not a vocabulary: give a number of tokens, auto, embedded, llama3, "
            "or a tokenizer file or folder"
        )


def resolve_vocab(vocab: int | str, flavor: str) -> tuple[int, str]:
    """(embedding rows, where the number comes from) for ``--vocab``, padded as the model pads."""
    if vocab == "auto":
        return default_vocab(flavor)
    if vocab == "embedded":
        return padded_vocab(embedded_vocab(), VOCAB_MULTIPLE), "embedded"
    if vocab == "llama3":
        return padded_vocab(LLAMA3_VOCAB, VOCAB_MULTIPLE), "llama3"
    if isinstance(vocab, int):
        return padded_vocab(vocab, VOCAB_MULTIPLE), str(vocab)
    from muloco.data.tokenizer import MulocoTokenizer  # a tokenizer file: only this path pays for the import

    return padded_vocab(MulocoTokenizer(tokenizer_path=vocab).get_vocab_size(), VOCAB_MULTIPLE), Path(vocab).name


def _plan(args: MapOptions, flavors: list[str]):
    """The link planner's report (``muloco/sizing/link_plan.py``), as text or as a JSON object."""
    from muloco.sizing import link_plan  # torch: only the planner pays for it

    if len(flavors) != 1:
        raise ValueError("--link-mbps plans one model: give exactly one --flavor")
    planner = args.link_planner
    given = {
        key: (PLANNER_DEFAULTS[key] if getattr(planner, key) is None else getattr(planner, key))
        for key in PLANNER_DEFAULTS
    }
    vocab, _ = resolve_vocab(args.vocab, flavors[0])
    inputs = link_plan.Inputs(
        flavor=flavors[0],
        replicas=args.replicas or PLANNER_REPLICAS,
        mbps=planner.link_mbps,
        latency_ms=given["latency_ms"],
        bits=given["bits"],
        strategy=given["strategy"],
        sync_every=given["sync_every"],
        step_seconds=given["step_seconds"],
        mfu=given["mfu"],
        gpu=given["gpu"],
        gpus_per_group=given["gpus_per_group"],
        fragments=given["streaming_fragments"],
        overlap=given["overlap"],
        max_share=given["max_share"],
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        vocab=vocab,
        group_slowdowns=tuple(given["group_slowdowns"]),
        round_quantile=given["round_quantile"],
        round_min_steps=given["round_min_steps"],
        round_max_steps=given["round_max_steps"],
    )
    planned = link_plan.plan(inputs)
    if args.json:
        return json.dumps(link_plan.as_dict(planned))
    report = link_plan.text(planned)
    return report if args.replicas else f"{report}\n  K={PLANNER_REPLICAS} is the default: set --replicas K"


def _check(args: MapOptions) -> list[str]:
    for key in ("global_batch", "seq_len"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1; got {getattr(args, key)}")
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be at least 1; got {args.replicas}")
    _check_vocab(args.vocab)
    if args.link_planner.link_mbps is None:
        stray = [
            f"--{key.replace('_', '-')}" for key in PLANNER_DEFAULTS if getattr(args.link_planner, key) is not None
        ]
        if stray:
            raise ValueError(
                f"{', '.join(stray)} {'is a' if len(stray) == 1 else 'are'} link planner option"
                f"{'' if len(stray) == 1 else 's'}: add --link-mbps B (the bandwidth between replica "
                "groups) to plan a link, or leave "
                f"{'it' if len(stray) == 1 else 'them'} out for the sizing table"
            )
    flavors = args.flavor or list(SHAPES)
    for f in flavors:
        parse_flavor(f)
    return flavors


def table(rows, args: MapOptions) -> str:
    head = (
        f"{'flavor':<42}{'params':>9}{'non-emb':>9}{'vocab':>8}{'tokens':>9}{'steps':>9}{'micro':>7}{'GPUs':>6}"
        f"  tuned (weight decay at B={args.global_batch}, K={args.replicas or 1}; inner lr)"
    )
    lines = [
        f"model map: global batch {args.global_batch} x {args.seq_len} tokens, 20 tokens per parameter",
        head,
        "-" * len(head),
    ]
    for r in rows:
        tuned = [f"wd[{k}] {v:.3g}" for k, v in r.weight_decay.items()] + [
            f"lr[{k}] {v:.3g}" for k, v in r.tuned_lr.items()
        ]
        micro = f"{'' if r.in_map else '~'}{r.max_micro_batch}"
        lines.append(
            f"{r.flavor:<42}{_count(r.parameters):>9}{_count(r.non_embedding_parameters):>9}{r.vocab:>8,}"
            f"{_count(r.token_budget):>9}{r.steps:>9,}{micro:>7}{r.gpus:>6}  "
            f"{', '.join(tuned) or '-'}"
        )
    used = sorted({k for r in rows for k in (*r.weight_decay, *r.tuned_lr)})
    if used:
        lines += ["", "sources:"] + [f"  {k}: {SOURCES[k]}" for k in used]
    sources = sorted({r.vocab_source for r in rows})
    lines += [
        "",
        f"vocab: embedding rows, padded to a multiple of {VOCAB_MULTIPLE} ("
        + "; ".join(_VOCAB_SOURCES.get(v, f"from {v}") for v in sources)
        + ")",
        f"weight decay: tuned at global batch {WD_REFERENCE_BATCH}, times steps({WD_REFERENCE_BATCH}) / "
        "steps(B), divided by K for DiLoCo/MuLoCo (MuLoCo's launchers); micro: largest micro-batch per "
        "GPU at seq 2048 (MuLoCo's LBS_MAP; tiny flavors: CPU; ~: a shape outside the map, the next larger "
        "row's); GPUs: global batch / micro, rounded up",
    ]
    return "\n".join(lines)


_VOCAB_SOURCES = {
    "embedded": "embedded: the embedded standard-library BPE, what the CPU flavors train with",
    "llama3": "llama3: Llama 3's tokenizer, what the GPU configs are meant for",
}


def main(argv: list[str] | None = None) -> int:
    try:
        args, _ = parse(
            MapOptions,
            list(sys.argv[1:] if argv is None else argv),
            prog="python -m muloco.model_map",
            description=_DESCRIPTION,
            overrides=False,
        )
        flavors = _check(args)
        if args.link_planner.link_mbps is not None:
            print(_plan(args, flavors))
            return 0
        rows = []
        for f in flavors:
            vocab, source = resolve_vocab(args.vocab, f)
            rows.append(
                sizing(
                    f,
                    global_batch=args.global_batch,
                    vocab_size=vocab,
                    seq_len=args.seq_len,
                    replicas=args.replicas or 1,
                    vocab_source=source,
                )
            )
    except MulocoError as err:
        return failed("map", err)
    except ValueError as err:  # a value no check above named (a bad number in the planner's arithmetic)
        return failed("map", err, BAD_INPUT)
    if args.json:
        for r in rows:
            print(json.dumps(dataclasses.asdict(r)))
    else:
        print(table(rows, args))
    return 0
