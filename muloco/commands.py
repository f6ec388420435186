"""``muloco COMMAND ...``: one command for every entry point (the console script).

Each command is the module a user could also run with ``python -m`` (both keep working); this
dispatcher imports only the module of the command asked for, so ``muloco --help`` and an
unknown command answer without loading torch. A sweep file is run as itself
(``muloco sweep jobs/sweeps/FILE.py ...`` is ``python jobs/sweeps/FILE.py ...``).
"""

from __future__ import annotations

import difflib
import importlib
import runpy
import sys

from muloco.utils.command_line import failed, reader_gone
from muloco.utils.errors import BAD_INPUT, MulocoError

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("muloco.train:command", "train one replica group, or a DDP run"),
    "local": ("muloco.launch.local", "K replica groups and a torchft lighthouse on this machine"),
    "slurm": ("muloco.launch.slurm.jobs", "write and submit SLURM jobs (kinds: ddp, groups, spanning, array)"),
    "sweep": ("", "run a sweep file (jobs/sweeps/*.py) on SLURM or here"),
    "compare": ("muloco.compare.__main__", "the paper's comparison suites and their table"),
    "report": ("muloco.report.__main__", "tables and plots of runs and sweeps"),
    "export": ("muloco.export.__main__", "a run as a Hugging Face folder (and to the Hub)"),
    "evaluate": ("muloco.evaluate.__main__", "lm-evaluation-harness scores of a run or a folder"),
    "generate": ("muloco.generate.__main__", "sample text from a run"),
    "map": ("muloco.sizing.cli", "the model map and the link planner"),
    "fetch": ("muloco.data.fetch", "fetch a public corpus (shakespeare)"),
    "lighthouse": ("muloco.launch.lighthouse", "a torchft lighthouse on this machine"),
}
"""Command → (module whose ``main(argv)`` it runs, or ``module:function``, one line of help)."""

PROG = "muloco"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        f"usage: {PROG} COMMAND [options]   ({PROG} COMMAND --help for a command's options)",
        "",
        "options:",
        "  -h, --help  this list",
        "",
        "commands:",
    ]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def _sweep(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(
            f"usage: {PROG} sweep FILE.py [sweep options] [-- overrides]   (a sweep file: jobs/sweeps/*.py)",
            file=sys.stderr if not argv or argv[0] not in ("-h", "--help") else sys.stdout,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except FileNotFoundError:
        return failed("sweep", f"no sweep file {argv[0]!r}", BAD_INPUT)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command; output cut short by its reader (``muloco map | head``) ends it quietly."""
    try:
        return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except BrokenPipeError:
        return reader_gone()


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=3, cutoff=0.5)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        print(f"{PROG}: error: unknown command {name!r}.{hint} Commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if name == "sweep":
        return _sweep(rest)
    module, _, function = COMMANDS[name][0].partition(":")
    try:
        return getattr(importlib.import_module(module), function or "main")(rest)
    except MulocoError as err:  # one a command's main let through: one line and its status
        return failed(name, err)
