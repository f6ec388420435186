"""The docs point at real things: every relative link (file and #heading) resolves, every
``--config NAME`` an example uses is a config module, and every repository path a doc names in
backticks (``jobs/...``, ``bench/...``, ``config/...``, ``muloco/...``) exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    REPO / "README.md",
    REPO / "RUNNING_JOBS.md",
    REPO / "bench" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CONFIG = re.compile(r"--config ([A-Za-z0-9_]+/[A-Za-z0-9_]+|base)(?![\w./])")
PATH = re.compile(r"`((?:jobs|bench|config|muloco|scripts|tests)/[A-Za-z0-9_./-]+\.(?:py|sh|md|toml|json))`")


def anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    out, fenced = set(), False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_the_configs_and_paths_the_examples_name_exist(doc):
    text = doc.read_text()
    missing = [
        f"--config {name}"
        for name in sorted(set(CONFIG.findall(text)))
        if not (REPO / "config" / f"{name}.py").is_file()
    ]
    missing += [path for path in sorted(set(PATH.findall(text))) if "*" not in path and not (REPO / path).exists()]
    assert not missing, f"{doc.name} names what does not exist: {', '.join(missing)}"


def test_the_core_rows_the_docs_name_are_the_suites_core():
    """docs/compression.md's paper-long command lists the core rows the text counts (``CORE``)."""
    import shlex

    from muloco.compare.suites import CORE

    text = (REPO / "docs" / "compression.md").read_text()
    start = text.index("python -m muloco.compare --suite paper-long")
    words = shlex.split(text[start : text.index("\n\n", start)].replace("\\\n", " "))
    assert words[words.index("--only") + 1 :] == list(CORE)
    assert len(CORE) == 9 and "its nine core rows" in text  # the count the text gives
