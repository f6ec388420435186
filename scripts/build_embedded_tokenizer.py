#!/usr/bin/env python
"""Build the embedded byte-level BPE (``muloco/data/assets/stdlib_bpe.json``).

The embedded tokenizer lets every example run without downloading anything:
it is trained on the running interpreter's standard library (train split only,
so validation loss is measured on text the tokenizer never saw) and committed
to the repository. The build is deterministic: the trainer runs on one thread
and the inputs are read in sorted order, so rebuilding on the same Python
version gives byte-identical files, which ``--check``-style comparisons and
the tests rely on.

Usage:
    python scripts/build_embedded_tokenizer.py                  # rebuild the asset
    python scripts/build_embedded_tokenizer.py --max-files 20 --vocab-size 400 --output /tmp/t.json
"""

from __future__ import annotations

import os

# Must precede the first `import tokenizers`: the Rust thread pool reads these
# once. One thread makes merge ties and word-count order independent of timing.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["RAYON_RS_NUM_CPUS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse
import hashlib
import importlib.util
import json
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO / "muloco" / "data" / "assets" / "stdlib_bpe.json"
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|mask|>"]


def _load_split_module():
    """Import muloco/data/split.py by path: the script must not depend on the
    package being installed, nor pay for importing the rest of muloco."""
    spec = importlib.util.spec_from_file_location("_muloco_split", REPO / "muloco" / "data" / "split.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_files(root: Path, max_files: int | None) -> list[str]:
    split = _load_split_module()
    files = [r for r in split.stdlib_sources(root) if not split.is_validation(r)]
    return files if max_files is None else files[:max_files]


def read_texts(root: Path, rel_paths: list[str]) -> Iterator[str]:
    for rel in rel_paths:
        yield (root / rel).read_text(encoding="utf-8", errors="replace")


def build_tokenizer(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def write_outputs(tokenizer: Tokenizer, output: Path, meta: dict) -> dict:
    # to_str() is the exact bytes save() would write; writing them ourselves
    # lets us hash what lands on disk without reading it back.
    data = tokenizer.to_str(pretty=True).encode("utf-8")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_bytes(data)
    meta = {**meta, "vocab_size": tokenizer.get_vocab_size(), "sha256": hashlib.sha256(data).hexdigest()}
    meta_path = output.with_name(output.name.removesuffix(".json") + ".meta.json")
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return {**meta, "bytes": len(data), "meta_path": str(meta_path)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="tokenizer.json to write (a .meta.json is written beside it)",
    )
    parser.add_argument(
        "--max-files", type=int, default=None, help="use only the first N train files in sorted order (for tests)"
    )
    parser.add_argument("--vocab-size", type=int, default=2048)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    split = _load_split_module()
    root = split.stdlib_root()
    files = train_files(root, args.max_files)
    n_bytes = sum((root / f).stat().st_size for f in files)
    print(
        f"training byte-level BPE (vocab {args.vocab_size}) on {len(files)} train-split "
        f"files, {n_bytes / 1e6:.1f} MB, of {root} (Python {platform.python_version()})",
        flush=True,
    )

    tokenizer = build_tokenizer(read_texts(root, files), args.vocab_size)
    meta = {"python_version": platform.python_version(), "n_files": len(files), "n_bytes": n_bytes}
    info = write_outputs(tokenizer, args.output, meta)
    print(
        f"wrote {args.output} ({info['bytes']} bytes, vocab {info['vocab_size']}, "
        f"sha256 {info['sha256'][:12]}…) and {info['meta_path']} "
        f"in {time.perf_counter() - start:.1f} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
