"""A sweep folder's ``manifest.jsonl``: one line per run (name, kind, config, overrides, run
folder, job ids, state), rewritten atomically. The SLURM sweep, ``--local`` sweeps and
``compare`` write it; ``report`` and ``--status`` read it. Torch-free."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from muloco.utils.atomic_file import write_atomically
from muloco.utils.errors import BadInput

MANIFEST = "manifest.jsonl"


class ManifestError(BadInput, ValueError):
    """A manifest line that does not parse (the message names the line and the fix)."""


@dataclass
class Entry:
    """One manifest line."""

    name: str
    kind: str
    config: str
    overrides: list[str]
    options: dict
    run_dir: str
    jobs: list[str] = field(default_factory=list)
    """The run's job (an array-kind run: its groups array) of every submission, oldest first."""
    state: str = "NEW"
    job_files: dict[str, str] = field(default_factory=dict)
    """Every job of the latest submission by script file, the lighthouse's included."""

    @property
    def job(self) -> str | None:
        return self.jobs[-1] if self.jobs else None


def read_manifest(folder: str) -> dict[str, Entry]:
    path = os.path.join(folder, MANIFEST)
    entries: dict[str, Entry] = {}
    if not os.path.exists(path):
        return entries
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                e = Entry(**json.loads(line))
            except (json.JSONDecodeError, TypeError) as err:
                raise ManifestError(f"{path}:{n} is not a manifest line ({err}); fix or move the file") from None
            entries[e.name] = e
    return entries


def write_manifest(folder: str, entries: dict[str, Entry]) -> None:
    write_atomically(os.path.join(folder, MANIFEST), "".join(json.dumps(asdict(e)) + "\n" for e in entries.values()))


def run_finished(run_dir: str) -> bool:
    """A summary in the run folder, or in every replica group's folder of a DiLoCo run."""
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        return True
    groups = [d for d in (os.listdir(run_dir) if os.path.isdir(run_dir) else []) if d.startswith("replica_")]
    return bool(groups) and all(os.path.exists(os.path.join(run_dir, d, "summary.json")) for d in groups)
