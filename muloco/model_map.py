"""The sizing table: ``python -m muloco.model_map [--flavor F ...] [--global-batch B] [--vocab V]``.

For each flavor of the model map (:mod:`muloco.models.model_map`): parameters with and
without the embedding and head for a vocabulary, the token budget at 20 tokens per
parameter, the steps that spend it at a global batch of ``--seq-len`` sequences, the
largest micro-batch per GPU (MuLoCo's LBS_MAP, seq 2048), the GPUs that hold the global
batch without gradient accumulation, and the tuned values with where each comes from:
inner learning rates as MuLoCo's launchers set them, and weight decay tuned at batch 512
rescaled the way MuLoCo's launchers rescale it (× steps(512)/steps(B), ÷ K for
DiLoCo/MuLoCo with ``--replicas K``). ``--json`` prints one object per flavor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from muloco import compat

compat.apply()  # muloco.models imports torchtitan

from muloco.models.model_map import (  # noqa: E402
    LLAMA3_VOCAB,
    SHAPES,
    SOURCES,
    UnknownFlavorError,
    WD_REFERENCE_BATCH,
    parse_flavor,
    sizing,
)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m muloco.model_map", description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", action="append", default=None, help="only this flavor (repeatable)")
    p.add_argument("--global-batch", type=int, default=WD_REFERENCE_BATCH, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=LLAMA3_VOCAB, help="vocabulary size (default: Llama 3's)")
    p.add_argument("--replicas", type=int, default=1, help="K replica groups (DiLoCo/MuLoCo weight-decay rule)")
    p.add_argument("--json", action="store_true")
    return p


def _check(args) -> list[str]:
    for key in ("global_batch", "seq_len", "vocab", "replicas"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1; got {getattr(args, key)}")
    flavors = args.flavor or list(SHAPES)
    for f in flavors:
        parse_flavor(f)
    return flavors


def table(rows, args) -> str:
    head = (f"{'flavor':<42}{'params':>9}{'non-emb':>9}{'tokens':>9}{'steps':>9}{'micro':>7}{'GPUs':>6}"
            f"  tuned (weight decay at B={args.global_batch}, K={args.replicas}; inner lr)")
    lines = [f"model map: vocab {args.vocab:,}, global batch {args.global_batch} x {args.seq_len} tokens, "
             f"20 tokens per parameter", head, "-" * len(head)]
    for r in rows:
        tuned = [f"wd[{k}] {v:.3g}" for k, v in r.weight_decay.items()] + [f"lr[{k}] {v:.3g}" for k, v in r.tuned_lr.items()]
        lines.append(f"{r.flavor:<42}{_count(r.parameters):>9}{_count(r.non_embedding_parameters):>9}"
                     f"{_count(r.token_budget):>9}{r.steps:>9,}{r.max_micro_batch:>7}{r.gpus:>6}  "
                     f"{', '.join(tuned) or '-'}")
    used = sorted({k for r in rows for k in (*r.weight_decay, *r.tuned_lr)})
    if used:
        lines += ["", "sources:"] + [f"  {k}: {SOURCES[k]}" for k in used]
    lines += ["", f"weight decay: tuned at global batch {WD_REFERENCE_BATCH}, times steps({WD_REFERENCE_BATCH}) / "
              "steps(B), divided by K for DiLoCo/MuLoCo (MuLoCo's launchers); micro: largest micro-batch per "
              "GPU at seq 2048 (MuLoCo's LBS_MAP; tiny flavors: CPU); GPUs: global batch / micro, rounded up"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        flavors = _check(args)
    except (ValueError, UnknownFlavorError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    rows = [sizing(f, global_batch=args.global_batch, vocab_size=args.vocab, seq_len=args.seq_len,
                   replicas=args.replicas) for f in flavors]
    if args.json:
        for r in rows:
            print(json.dumps(dataclasses.asdict(r)))
    else:
        print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
