"""Checksum manifests: the mark that a checkpoint step was written completely.

DCP writes a step folder file by file, ``.metadata`` included, so a process killed in
the middle of a save leaves a folder that looks like a checkpoint, and bytes changed on
disk later (a bad disk, a partial copy) load silently and surface as a non-finite loss
many steps on. After every save has finished on every rank, rank 0 writes
``step-N/.muloco-checksums.json``::

    {"format": 1, "files": {"<path relative to step-N>": {"size": <bytes>, "sha256": "<hex>"}, ...}}

atomically (a temporary file, then ``os.replace``). A step folder without it is
*incomplete*; one whose files differ from it is *corrupt*. Loading verifies it first.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from muloco.utils.atomic_file import write_atomically
from muloco.utils.errors import BadCheckpoint

MANIFEST = ".muloco-checksums.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TEMP_PREFIX = MANIFEST + ".tmp-"

# (step folder, manifest bytes) already verified by this process: preflight verifies
# before anything is built, and the checkpointer's load need not read every byte again.
_verified: set[tuple[str, bytes]] = set()


class CorruptCheckpoint(BadCheckpoint, ValueError):
    """A step folder whose files do not match its manifest; the message names the file."""


def manifest_path(step_dir: str) -> str:
    return os.path.join(step_dir, MANIFEST)


def is_complete(step_dir: str) -> bool:
    return os.path.isfile(manifest_path(step_dir))


def step_folders(folder: str) -> dict[int, str]:
    """Every ``step-N`` folder in ``folder``, complete or not, by step."""
    if not os.path.isdir(folder):
        return {}
    found = {}
    for name in os.listdir(folder):
        match = _STEP_DIR.match(name)
        path = os.path.join(folder, name)
        if match and os.path.isdir(path):
            found[int(match.group(1))] = path
    return found


def complete_steps(folder: str) -> list[int]:
    return sorted(step for step, path in step_folders(folder).items() if is_complete(path))


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _checkpoint_files(step_dir: str) -> list[str]:
    """Every file under the step folder except the manifest and its temporary files."""
    files = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            if name == MANIFEST or name.startswith(_TEMP_PREFIX):
                continue
            files.append(os.path.relpath(os.path.join(root, name), step_dir))
    return sorted(files)


def discard_manifest(step_dir: str) -> None:
    """Mark a folder incomplete before it is (re)written, so a save that dies half-way
    is seen as incomplete, not as corrupt."""
    try:
        os.unlink(manifest_path(step_dir))
    except FileNotFoundError:
        pass


def write_manifest(step_dir: str) -> None:
    """Seal a finished save: sizes and sha256 of every file, written atomically."""
    entries = {}
    for rel in _checkpoint_files(step_dir):
        path = os.path.join(step_dir, rel)
        entries[rel] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    data = json.dumps({"format": FORMAT, "files": entries}, indent=1, sort_keys=True).encode()
    write_atomically(manifest_path(step_dir), data, temp_prefix=_TEMP_PREFIX)
    _verified.add((os.path.realpath(step_dir), data))


def _read_manifest(step_dir: str) -> tuple[bytes, dict[str, dict]]:
    path = manifest_path(step_dir)
    with open(path, "rb") as f:
        data = f.read()
    try:
        manifest = json.loads(data)
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError
        for entry in files.values():
            int(entry["size"]), str(entry["sha256"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CorruptCheckpoint(f"its manifest {path} is unreadable") from None
    return data, files


def _file_problem(step_dir: str, rel: str, entry: dict) -> str | None:
    path = os.path.join(step_dir, rel)
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = os.path.getsize(path)
    if size != entry["size"]:
        return f"{path} has {size} bytes, {entry['size']} were written"
    if _sha256(path) != entry["sha256"]:
        return f"{path} does not match the sha256 recorded when it was saved"
    return None


def verify(step_dir: str) -> None:
    """Raise CorruptCheckpoint naming the first file that differs from the manifest.

    The caller has checked that the manifest exists (an incomplete folder is a
    different condition). Files the manifest does not list are ignored: DCP reads
    only what ``.metadata`` (itself listed) refers to.
    """
    data, files = _read_manifest(step_dir)
    key = (os.path.realpath(step_dir), data)
    if key in _verified:
        return
    for rel, entry in sorted(files.items()):
        problem = _file_problem(step_dir, rel, entry)
        if problem:
            raise CorruptCheckpoint(problem)
    _verified.add(key)
