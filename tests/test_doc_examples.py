"""Every command example in the docs runs, in the cheapest mode that still goes through the real
command: launchers, SLURM jobs, sweeps and ``compare`` with ``--dry-run`` (SLURM told the node
shape, since no cluster is reachable here; GPU layouts shown with ``CUDA_VISIBLE_DEVICES`` naming
eight devices), a trainer command line parsed and pre-flight checked as ``muloco.train`` does
before it builds anything, the model map for real (its output shown in the docs must be what it
prints), ``report``/``generate`` on the docs' run folders, which do not exist here (the command
line must parse; the one error must be about the folder). What cannot run here is listed in
``NOT_RUN`` with the reason, and a new example that fits no rule fails the test.

An example the docs themselves show as a dry run runs exactly as typed, as a real process, and so
do the ``--help`` examples; the others run their command's ``main`` in the test's process
(``in_process.py``; a job script runs with a recorder as its Python, and the command it would
have run, runs here): each would otherwise spend ~5 s of CPU importing torch and torchtitan to
print a plan."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, watch
from in_process import recorded_python, run_in_process

DOCS = ["README.md", "RUNNING_JOBS.md", "docs/using.md", "docs/compression.md", "docs/gpu.md", "bench/README.md"]
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
STARTS = re.compile(r"^(\$ )?([A-Z_]+=\S+ )*(\./|jobs/|python |\.venv/bin/|muloco )")
NODE_SHAPE = ["--gpus-per-node", "8", "--cpus-per-node", "96"]
EIGHT_GPUS = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}

NOT_RUN = {
    "./setup.sh": "installs; tests/test_setup_script.py drives its decisions",
    "-m pytest": "the suite itself",
    "wandb sync": "needs a W&B account",
    "./torchft_lighthouse": "a service that runs until stopped; tests/test_launch.py starts it",
    "bench/link_planner.py": "trains; tests/test_bench_smoke.py runs it",
    "<tiny>": "the SLURM test matrix, written with placeholders; tests/test_slurm_jobs.py runs it",
    "[--section.key": "a usage line with placeholders",
    "path/to/": "a usage line with placeholders",
    "--status": "reads a submitted sweep's jobs from SLURM; tests/test_sweep.py covers it",
    "--resubmit-failed": "needs SLURM's record of failed jobs; tests/test_slurm_cluster.py covers it",
    "--max-nodes": "waits on SLURM's queue; tests/test_slurm_cluster.py covers it",
    "--smoke-steps": "gates on a submitted smoke job; tests/test_slurm_jobs.py covers it",
}
"""Examples not run here (a substring of the command → why, and where it is tested)."""


@dataclass
class Example:
    doc: str
    line: int
    text: str
    """The command as a user would paste it (continuations joined, comment dropped)."""
    output: list[str]
    """The lines the docs show it printing (``$ command`` blocks)."""


def _commands(block: str, prompted: bool) -> list[tuple[int, str, list[str]]]:
    """(line offset, command, shown output) of each command in a fenced block."""
    out, lines, i = [], block.splitlines(), 0
    while i < len(lines):
        first = lines[i]
        if not STARTS.match(first.strip()) or (prompted and not first.startswith("$ ")):
            i += 1
            continue
        start, text = i, first
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        shown = []
        while prompted and i < len(lines) and not lines[i].startswith("$ "):
            shown.append(lines[i])
            i += 1
        out.append((start, text.removeprefix("$ ").strip(), shown))
    return out


def _drop_comment(text: str) -> str:
    words = shlex.split(text, comments=True)
    return shlex.join(words)


def examples() -> list[Example]:
    found = []
    for doc in DOCS:
        text = (REPO / doc).read_text()
        for m in FENCE.finditer(text):
            if m.group(1) not in ("bash", "sh", ""):
                continue
            at = text[: m.start()].count("\n") + 2
            for offset, command, shown in _commands(m.group(2), prompted=m.group(1) == ""):
                found.append(Example(doc, at + offset, _drop_comment(command), shown))
    return found


EXAMPLES = examples()


def _env_and_words(text: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(text)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def _with_options(words: list[str], options: list[str]) -> list[str]:
    """``options`` before the trainer overrides (``--``), where a launcher reads its own; the node
    shape only where the example gives none."""
    cut = words.index("--") if "--" in words else len(words)
    if "--gpus-per-node" in words[:cut] and options[1:] == NODE_SHAPE:
        options = options[:1]
    options = [o for o in options if o != "--dry-run" or "--dry-run" not in words[:cut]]
    return [*words[:cut], *options, *words[cut:]]


def _module_and_args(words: list[str]) -> tuple[str, list[str]] | None:
    """``python -m M ARGS`` (any interpreter, or torchrun) → (M, ARGS)."""
    if "-m" in words:
        i = words.index("-m")
        return words[i + 1], words[i + 2 :]
    return None


PREFLIGHT_PASSED = "pre-flight passed"


def _preflight() -> None:
    """What ``muloco.train`` checks before it builds anything: a trainer example runs only that."""
    from muloco.config.checks import check_config
    from muloco.config.cli import parse_args

    check_config(parse_args(sys.argv[1:])[1])
    print(PREFLIGHT_PASSED)


def _here(argv: list[str]):
    """The function that runs ``argv`` (``python -m M``, ``python FILE.py``; the trainer's pre-flight
    for ``python -m muloco.train``) here."""
    if argv[1:3] == ["-m", "muloco.train"]:
        return "muloco.train", argv[3:], _preflight
    if argv[1] == "-m":
        module = importlib.import_module(argv[2])
        if not hasattr(module, "main"):  # a package: python -m runs its __main__
            module = importlib.import_module(f"{argv[2]}.__main__")
        from muloco.utils.command_line import run_main

        return argv[2], argv[3:], lambda: run_main(module.main)
    return argv[1], argv[2:], lambda: runpy.run_path(argv[1], run_name="__main__")


def _run(argv: list[str], env: dict[str, str], capfd, tmp_path: Path, real: bool) -> subprocess.CompletedProcess:
    """``argv`` as on a machine that sees no cluster (the suite's own local SLURM, whose
    SLURM_CONF the session exports, would answer with its CPU-only partition): as a real process,
    or here (a job script with a recorder as its Python, then what it would have run, here)."""
    env = {"PYTHONPATH": str(REPO), "MULOCO_PYTHON": sys.executable, "SLURM_CONF": os.devnull, **env}
    if real:
        return watch([argv], [{**os.environ, **env}])[0]
    if not argv[0].endswith(("python", "python3")) and argv[0] != sys.executable:
        script, recorded = recorded_python(argv, {**os.environ, **env}, tmp_path)
        if recorded is None:
            return script
        argv = [sys.executable, *recorded]
    name, args, main = _here(argv)
    return run_in_process(main, capfd, argv0=name, args=args, env=env)


def _command(ex: Example) -> tuple[list[str], dict[str, str], str]:
    """How ``ex`` runs the cheap way: (command line, environment, what a success must show)."""
    env, words = _env_and_words(ex.text)
    if words[-1] in ("--help", "-h") and not (_module_and_args(words) or ("",))[0] == "muloco.train":
        argv = [sys.executable, *words[1:]] if words[0].endswith("python") else words
        return argv, env, "usage"
    if words[0] in ("python", ".venv/bin/python") and words[1].startswith("jobs/sweeps/"):
        local = "--local" in words
        argv = [sys.executable, *words[1:]]
        return _with_options(argv, ["--dry-run", *([] if local else NODE_SHAPE)]), env, "dry run"
    if words[0].startswith("jobs/slurm/"):
        return _with_options(words, ["--dry-run", *NODE_SHAPE]), env, "dry run"
    if words[0].startswith(("jobs/local/", "jobs/diloco/")):  # a GPU layout is shown on eight named devices
        gpus = EIGHT_GPUS if "gpu" in ex.text else {}
        return _with_options(words, ["--dry-run"]), {**gpus, **env}, "dry run"
    if words[0] == "jobs/ddp/run.sh" or (_module_and_args(words) or ("",))[0] == "muloco.train":
        config, overrides = _train_args(words)
        return [sys.executable, "-m", "muloco.train", "--config", config, *overrides], env, PREFLIGHT_PASSED
    module, args = _module_and_args(words)
    argv = [sys.executable, "-m", module, *args]
    if module == "muloco.launch.slurm":
        return _with_options(argv, ["--dry-run", *NODE_SHAPE]), env, "dry run"
    if module in ("muloco.launch.local", "muloco.compare"):
        return _with_options(argv, ["--dry-run"]), env, "nothing started" if module == "muloco.compare" else "dry run"
    if module == "muloco.model_map":
        return argv, env, ""
    if module in ("muloco.report", "muloco.generate"):
        return argv, env, "MISSING FOLDER"
    raise AssertionError(f"{ex.doc}:{ex.line}: no rule runs `{ex.text}`; add one, or list it in NOT_RUN")


def _run_example(ex: Example, capfd, tmp_path: Path) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``ex`` the cheap way; (what happened, what a success must show). A dry run the docs
    show, and a ``--help``, run as typed in a real process; the rest here."""
    argv, env, must_show = _command(ex)
    real = must_show == "usage" or ("--dry-run" in _env_and_words(ex.text)[1] and must_show != PREFLIGHT_PASSED)
    if must_show == "MISSING FOLDER":  # the docs' run folders, relative to an empty folder: never the user's own
        with contextlib.chdir(tmp_path):
            return _run(argv, env, capfd, tmp_path, real), must_show
    return _run(argv, env, capfd, tmp_path, real), must_show


def _train_args(words: list[str]) -> tuple[str, list[str]]:
    """A trainer command's --config and overrides (jobs/ddp/run.sh takes them around a ``--``)."""
    args = _module_and_args(words)[1] if "-m" in words else [w for w in words[1:] if w != "--"]
    config = args[args.index("--config") + 1] if "--config" in args else "base"
    rest = [w for i, w in enumerate(args) if w != "--config" and (i == 0 or args[i - 1] != "--config")]
    return config, [w for w in rest if w != "--help"]


def test_the_docs_have_examples_and_each_skip_still_matches_one():
    assert len(EXAMPLES) >= 30, [e.text for e in EXAMPLES]
    unused = [key for key in NOT_RUN if not any(key in e.text for e in EXAMPLES)]
    assert not unused, f"NOT_RUN entries no example needs any more: {unused}"


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda e: f"{e.doc}:{e.line}")
def test_doc_example_runs(ex, capfd, tmp_path):
    skipped = [why for key, why in NOT_RUN.items() if key in ex.text]
    if skipped:
        pytest.skip(skipped[0])
    proc, must_show = _run_example(ex, capfd, tmp_path)
    said = proc.stdout + proc.stderr
    if must_show == "MISSING FOLDER":  # the docs' run folders: the only complaint is that they are not here
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1 and re.search(r"no such file|is not a folder", lines[0]), said
        return
    assert proc.returncode == 0, f"{ex.doc}:{ex.line}: `{ex.text}` exited {proc.returncode}\n{said[-3000:]}"
    assert must_show.lower() in said.lower(), said[-3000:]
    if must_show:
        return
    shown = [line.rstrip() for line in ex.output if line.strip() and line.strip() != "..."]
    missing = [line for line in shown if line not in proc.stdout.splitlines()]
    assert not missing, f"{ex.doc}:{ex.line} shows lines the command does not print:\n" + "\n".join(missing)
