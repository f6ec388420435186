"""Start-up: how long each ``muloco`` command takes to answer, against ``import torch`` in the same run.

    .venv/bin/python bench/startup.py [--repeats 3] [--only train,map,...] [--smoke]

Each command runs as a user runs it (``python -m muloco COMMAND ...``, what the ``muloco``
console script calls), one process at a time, ``--repeats`` times; printed per command: the
median wall-clock seconds, its ratio to ``python -c "import torch"`` (measured in the same run,
interleaved with the commands so a change in the machine's load hits both), the target, and
whether it is met. Targets (issue 39): a command's ``--help``, ``compare --dry-run`` and a SLURM
dry run (answered by a stand-in ``sinfo`` that reports one 8-GPU node) within 2x; the planner,
the sizing table and ``report`` (commands that need no model) within 1x. The load average is
printed: on a loaded machine every figure grows, the ratios less.

The floor: a command that reads a trainer config (``train --help``, a SLURM dry run, ``compare
--dry-run``) must import torchtitan's ``trainer`` module, where every trainer config's class lives
(adapted by ``muloco.compat`` first, as every muloco process does: plain, it fails on a machine
without triton). That import alone is timed too, and those commands print their ratio to it
(``x floor``): what they cost above it is muloco's; the floor itself is torchtitan's.

``--smoke`` (what CI runs): one repeat of ``muloco --help``, the sizing table and ``report --help``.
Nothing here asserts on timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from machine import exit_on_sigterm, loadavg  # bench/ is on sys.path when a bench script runs

REPO = Path(__file__).resolve().parents[1]
PLANNER = [
    "--flavor",
    "llama3-w1024-d12-h8",
    "--replicas",
    "8",
    "--link-mbps",
    "1000",
    "--bits",
    "2",
    "--step-seconds",
    "1",
]


@dataclass(frozen=True)
class Command:
    name: str
    args: list[str]
    target: float
    """Largest ratio to ``import torch`` the issue accepts."""
    reads_config: bool = False
    """It loads a trainer config, so it cannot start faster than the floor."""


COMMANDS = [
    Command("muloco --help", ["--help"], 1.0),
    Command("train --help", ["train", "--help"], 2.0, True),
    Command("local --help", ["local", "--help"], 2.0),
    Command("slurm ddp --help", ["slurm", "ddp", "--help"], 2.0),
    Command("sweep --help", ["sweep", "--help"], 2.0),
    Command("compare --help", ["compare", "--help"], 2.0),
    Command("compare --dry-run", ["compare", "--dry-run"], 2.0, True),
    Command("export --help", ["export", "--help"], 2.0),
    Command("evaluate --help", ["evaluate", "--help"], 2.0),
    Command("generate --help", ["generate", "--help"], 2.0),
    Command("fetch --help", ["fetch", "--help"], 2.0),
    Command("lighthouse --help", ["lighthouse", "--help"], 2.0),
    Command(
        "slurm dry run", ["slurm", "groups", "--config", "diloco/muloco", "--replicas", "2", "--dry-run"], 2.0, True
    ),
    Command("report --help", ["report", "--help"], 1.0),
    Command("map (sizing table)", ["map"], 1.0),
    Command("map (link planner)", ["map", *PLANNER], 1.0),
]
SMOKE = ("muloco --help", "map (sizing table)", "report --help")
FLOOR = ["-c", "from muloco import compat; compat.apply(); import torchtitan.trainer"]
"""torchtitan's trainer module, adapted as every muloco process adapts it."""


def fake_sinfo(folder: Path) -> dict[str, str]:
    """An environment whose ``sinfo`` reports one idle 8-GPU node (no cluster is contacted)."""
    sinfo = folder / "sinfo"
    sinfo.write_text(
        '#!/bin/sh\ncase " $* " in *" -N "*) echo "gpu*|n1|96|gpu:h100:8|1000000|idle|infinite";; '
        '*) echo "gpu*";; esac\n'
    )
    sinfo.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}",
        "MULOCO_CLUSTER_FILE": str(folder / "none"),
    }


def seconds(argv: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    took = time.perf_counter() - began
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return took


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--only", default=None, help="comma-separated command names (the first word, e.g. train,map)")
    p.add_argument("--smoke", action="store_true", help="one repeat of three light commands (CI)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    chosen = COMMANDS
    if args.smoke:
        chosen, args.repeats = [c for c in COMMANDS if c.name in SMOKE], 1
    elif args.only:
        wanted = {w.strip() for w in args.only.split(",") if w.strip()}
        chosen = [c for c in COMMANDS if c.name.split()[0] in wanted or c.name in wanted]
        if not chosen:
            p.error(
                f"--only {args.only!r} names no command; first words: "
                f"{', '.join(sorted({c.name.split()[0] for c in COMMANDS}))}"
            )
    print(f"start-up, {args.repeats} repeat(s) each, median; load average before: {loadavg()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="muloco-startup-") as tmp:
        env = fake_sinfo(Path(tmp))
        floored = any(c.reads_config for c in chosen)
        torch_times, floor_times, times = [], [], {c.name: [] for c in chosen}
        for _ in range(args.repeats):
            if floored:
                floor_times.append(seconds([sys.executable, *FLOOR], env))
            for command in chosen:  # import torch between commands: both see the same load
                torch_times.append(seconds([sys.executable, "-c", "import torch"], env))
                times[command.name].append(seconds([sys.executable, "-m", "muloco", *command.args], env))
    base = statistics.median(torch_times)
    floor = statistics.median(floor_times) if floored else None
    print(f"\n{'command':<22}{'seconds':>9}{'x torch':>9}{'target':>8}  met  x floor")
    print(f"{'import torch':<22}{base:>9.2f}{1:>9.2f}{'':>8}")
    if floor is not None:
        print(f"{'floor (torchtitan)':<22}{floor:>9.2f}{floor / base:>9.2f}{'':>8}{'':>7}{1:>7.2f}")
    for command in chosen:
        took = statistics.median(times[command.name])
        ratio = took / base
        above = f"{took / floor:>7.2f}" if command.reads_config and floor else ""
        print(
            f"{command.name:<22}{took:>9.2f}{ratio:>9.2f}{command.target:>7.0f}x  "
            f"{'yes' if ratio <= command.target else 'no ':<5}{above}".rstrip()
        )
    if floor is not None:
        print(
            f"\nfloor: python {' '.join(FLOOR[:1])} '{FLOOR[1]}' (torchtitan's trainer module, where every "
            f"trainer config's class lives); at {floor / base:.2f}x torch, a command that reads a config "
            "cannot meet a target below it without changing torchtitan"
        )
    print(f"\nload average after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
