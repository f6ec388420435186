"""One error base, one way to end on it: every error class muloco defines is a ``MulocoError`` whose
``exit_status`` says what kind of failure it is, and every command ends on one the same way."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import muloco
from muloco.utils.errors import BAD_CHECKPOINT, BAD_INPUT, FAILED, OUT_OF_DATE, REPLICA_GROUP, MulocoError, exit_status

NOT_ERRORS = {"muloco.components.preemption.RunPreempted"}
"""Exceptions that are not failures (a preempted run checkpoints and exits for its requeue)."""


def _muloco_exceptions() -> dict[str, type[BaseException]]:
    from muloco import compat

    compat.apply()
    found = {}
    for info in pkgutil.walk_packages(muloco.__path__, "muloco."):
        if "remote_code" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == info.name:
                found[f"{info.name}.{name}"] = value
    return found


def test_every_error_class_muloco_defines_is_a_muloco_error_with_its_status():
    found = _muloco_exceptions()
    assert len(found) >= 35
    strays = sorted(name for name, cls in found.items() if not issubclass(cls, MulocoError) and name not in NOT_ERRORS)
    assert not strays, f"error classes outside MulocoError (give each its base in muloco/utils/errors.py): {strays}"
    status = {name: cls.exit_status for name, cls in found.items() if issubclass(cls, MulocoError)}
    assert status["muloco.config.loader.ConfigError"] == BAD_INPUT
    assert status["muloco.components.checkpoint.CheckpointLoadError"] == BAD_CHECKPOINT
    assert status["muloco.runs.manifest.CorruptCheckpoint"] == BAD_CHECKPOINT  # a ValueError, yet not bad input
    assert status["muloco.compat.checkpoint_safety.UnsafeCheckpointError"] == BAD_CHECKPOINT
    assert status["muloco.outer.manager.ReplicaGroupError"] == REPLICA_GROUP
    assert status["muloco.outer.manager.ReplicaOutOfDate"] == OUT_OF_DATE
    assert status["muloco.launch.local.LaunchError"] == FAILED
    assert exit_status(RuntimeError("not ours")) == FAILED


def test_an_error_a_command_lets_through_is_one_line_and_its_status(monkeypatch, capsys):
    """The dispatcher (``muloco COMMAND``) and ``run_main`` (``python -m``) end the same way on a
    ``MulocoError`` no ``main`` caught: ``muloco COMMAND: error: ...`` and the error's status."""
    from muloco import commands
    from muloco.runs.manifest import CorruptCheckpoint
    from muloco.sizing import cli as sizing_cli
    from muloco.utils.command_line import run_main

    def broken(argv=None):
        raise CorruptCheckpoint("step-40 lost its manifest; resume from step-20")

    monkeypatch.setattr(sizing_cli, "main", broken)
    assert commands.main(["map"]) == BAD_CHECKPOINT
    assert capsys.readouterr().err.strip() == "muloco map: error: step-40 lost its manifest; resume from step-20"
    with pytest.raises(SystemExit) as done:
        run_main(broken)
    assert done.value.code == BAD_CHECKPOINT
    assert capsys.readouterr().err.count("error: step-40 lost its manifest") == 1
