"""``muloco COMMAND`` (the console script, also ``python -m muloco``): the list of commands, a
command run through it, a typo answered with the closest command, every command's module real;
one help layout and closest-option suggestions for the commands that parse as the launchers do."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib

import pytest
from conftest import REPO, run_watched

from muloco.commands import COMMANDS, main


def _muloco(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return run_watched([sys.executable, "-m", "muloco", *args], cwd=REPO, env=env)


def test_muloco_runs_the_command_asked_for_and_suggests_for_a_typo():
    listed = _muloco("--help")
    assert listed.returncode == 0 and all(f"  {name}" in listed.stdout for name in COMMANDS)
    typo = _muloco("evalute")
    assert typo.returncode == 2 and "unknown command 'evalute'. Did you mean: evaluate" in typo.stderr
    assert _muloco().returncode == 2  # nothing asked: the list, on stderr
    table = _muloco("map")  # a real command through the dispatcher: the model map's table
    assert table.returncode == 0 and "llama3-w128-d4-h2" in table.stdout, table.stderr[-2000:]
    sweep = _muloco("sweep", "jobs/sweeps/tiny_cpu.py", "--help")
    assert sweep.returncode == 0 and "tiny_cpu" in sweep.stdout, sweep.stderr[-2000:]


def test_every_command_names_a_module_with_a_main_and_the_console_script_is_declared():
    for name, (target, _) in COMMANDS.items():
        if target:
            module, _, function = target.partition(":")
            spec = importlib.util.find_spec(module)
            assert spec is not None and f"def {function or 'main'}(" in open(spec.origin).read(), name
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"muloco": "muloco.commands:main"}


PARSED = {  # command: (a misspelt option, the closest valid one, what its --help lists)
    "report": ("--metrc", "--metric", ["RUN_OR_SWEEP_DIR...", "--out", "--metric {validation,train}"]),
    "export": (
        "--stpe",
        "--step",
        ["RUN_FOLDER", "--out", "--step", "--replica", "--force", "--push-to-hub OWNER/NAME", "--private", "--license"],
    ),
    "evaluate": (
        "--task",
        "--tasks",
        [
            "RUN_FOLDER|HF_DIR",
            "--tasks",
            "--limit",
            "--batch-size",
            "--num-fewshot",
            "--mc-samples",
            "--block-length",
            "--include-path",
            "--max-length",
            "--step",
            "--replica",
            "--device",
            "--log-samples",
            "--seed",
            "--out",
        ],
    ),
    "generate": (
        "--stpe",
        "--step",
        [
            "--checkpoint",
            "--prompt",
            "--length",
            "--steps",
            "--block-length",
            "--order {confidence,margin,entropy,random}",
            "--threshold",
            "--cache {none,prefix,dual,block}",
            "--batch-size",
            "--temperature",
            "--score",
            "--mc-samples",
            "--json",
        ],
    ),
    "map": (
        "--link-mbp",
        "--link-mbps",
        [
            "--flavor",
            "--global-batch",
            "--seq-len",
            "--vocab",
            "--replicas",
            "--json",
            "link-planner options",
            "--link-mbps",
            "--sync-every",
            "--max-share",
        ],
    ),
    "fetch": ("--archve", "--archive", ["{shakespeare}", "--out", "--archive"]),
}
"""The commands whose options are one dataclass parsed as the launchers' are (``muloco.utils.command_line``)."""


@pytest.mark.parametrize("name", list(PARSED))
def test_a_commands_help_lists_its_options_and_a_misspelt_option_names_the_closest(name, capsys):
    typo, closest, listed = PARSED[name]
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: python -m muloco."), out[:500]
    assert all(option in out for option in listed), out
    assert main([name, typo, "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error: " in err, err
    assert f"unknown option '{typo}'. Closest valid options: {closest}" in err, err


def test_the_commands_answer_help_and_a_usage_error_without_torch():
    """--help and a misspelt option are answered before torch, safetensors, torchtitan, lm-eval
    or transformers load (each would cost seconds)."""
    code = (
        "import contextlib, io, sys\nfrom muloco.commands import main\n"
        f"for name, (typo, _, _) in {dict(PARSED)!r}.items():\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        assert main([name, typo, '1']) == 2, name\n"
        "        try:\n            main([name, '--help'])\n        except SystemExit as done:\n"
        "            assert done.code == 0, name\n"
        "heavy = {'torch', 'safetensors', 'torchtitan', 'lm_eval', 'transformers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = run_watched([sys.executable, "-c", code], cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "args",
    [
        ["muloco", "map"],
        ["muloco.model_map"],
        ["muloco.report", "--help"],
        ["muloco.launch.lighthouse", "--help"],
        ["muloco.data.fetch", "--help"],
        ["muloco.train", "--help"],
    ],
    ids=lambda a: " ".join(a),
)
def test_output_cut_short_by_its_reader_ends_quietly(args):
    """``muloco map | head -1`` (and the ``python -m`` module paths): the reader closes the pipe,
    and the command stops with exit 1 and no traceback (a closed pipe is the reader's choice, not
    an error to report)."""
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first line is written
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", *args], cwd=REPO, stdout=write, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write)
    err = proc.communicate()[1]
    assert proc.returncode == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_ctrl_c_ends_a_command_with_one_line_and_status_130(capsys, monkeypatch):
    """Ctrl-C in a command run through ``run_main`` (every ``python -m`` path): one line naming the
    command, exit 130 as a shell reports an interrupted program, no traceback."""
    import types

    from muloco.utils.command_line import INTERRUPTED, run_main

    def interrupted() -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(
        sys.modules, "__main__", types.SimpleNamespace(__spec__=types.SimpleNamespace(name="muloco.compare.__main__"))
    )
    with pytest.raises(SystemExit) as stopped:
        run_main(interrupted)
    assert stopped.value.code == INTERRUPTED == 130
    assert capsys.readouterr().err == "python -m muloco.compare: interrupted (Ctrl-C)\n"
