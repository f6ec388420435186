"""``muloco COMMAND`` (the console script, also ``python -m muloco``): the list of commands, a
command run through it, a typo answered with the closest command, every command's module real."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib

from conftest import REPO

from muloco.commands import COMMANDS


def _muloco(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "muloco", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


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
    for name, (module, _) in COMMANDS.items():
        if module:
            spec = importlib.util.find_spec(module)
            assert spec is not None and "def main(" in open(spec.origin).read(), name
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"muloco": "muloco.commands:main"}
