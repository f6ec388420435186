"""Shared helpers: run the real entry point in a child process, with a timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Small enough that a run of tens of steps takes seconds on a 2-core CPU.
TINY = [
    "--model.flavor", "llama3-w64-d2-h2",
    "--training.seq_len", "64",
    "--training.local_batch_size", "4",
    "--lr_scheduler.warmup_steps", "2",
    "--validator.steps", "2",
]


def run_train(args: list[str], timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m muloco.train` as users do; the child is killed on timeout."""
    cmd = [sys.executable, "-m", "muloco.train", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def read_metrics(folder: Path) -> list[dict]:
    with open(folder / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def train_losses(folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(folder) if "loss" in r}


@pytest.fixture
def repo() -> Path:
    return REPO
