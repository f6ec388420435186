"""The bash of the generated SLURM jobs, as files: each ``NAME.sh`` here is a block of a job
script, rendered by :func:`render` from this one place. ``@{key}`` marks a value filled in
(bash's own ``$``, ``${...}`` and ``"$@"`` pass through untouched); a value may span lines.
The parts that differ per job kind (the ``srun`` lines) are built in ``slurm.py``."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

_KEY = re.compile(r"@\{(\w+)\}")


@cache
def _text(name: str) -> str:
    return (Path(__file__).parent / f"{name}.sh").read_text()


def render(name: str, **values: object) -> list[str]:
    """Template ``name``'s lines with every ``@{key}`` replaced by ``values[key]``; a key without
    a value, or a value no key uses, is a programming error."""
    text = _text(name)
    keys = set(_KEY.findall(text))
    if keys != set(values):
        raise KeyError(f"template {name}.sh takes {sorted(keys)}, was given {sorted(values)}")
    return _KEY.sub(lambda m: str(values[m.group(1)]), text).rstrip("\n").split("\n")
