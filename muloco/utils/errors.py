"""One base for the errors muloco's commands report, and the exit status each stands for.

A command that stops on a ``MulocoError`` prints one line, ``muloco COMMAND: error: <message>``,
and exits with the error's ``exit_status``: ``command_line.run_main`` does it for every command, so
a command's ``main`` handles only what it must say or do differently (the trainer leaves without
interpreter teardown, ``compare`` words the trainer's advice in its own flags). The statuses are
what job scripts and launchers act on:

- 2 ``BAD_INPUT``: a command line, config, data file, tokenizer or cluster setting the user can fix;
- 3 ``BAD_CHECKPOINT``: a checkpoint that cannot be loaded (resume from another, or start anew);
- 4 ``REPLICA_GROUP``: a replica group lost its lighthouse or quorum; 5 ``OUT_OF_DATE``: it ended
  behind its peers (``outer/manager.py``);
- 1 ``FAILED``: anything else that failed while running (a job, a download, a child process).

Preemption is not an error (``components.preemption.EXIT_PREEMPTED``: the job script requeues on it).
Each error class keeps its Python base (``ValueError``, ``RuntimeError``, ...) beside this one, so
code that caught it by that base still does.
"""

from __future__ import annotations

FAILED, BAD_INPUT, BAD_CHECKPOINT, REPLICA_GROUP, OUT_OF_DATE = 1, 2, 3, 4, 5


class MulocoError(Exception):
    """An error a command reports as one line and ``exit_status``."""

    exit_status: int = FAILED


class BadInput(MulocoError):
    """Input the user can fix: the message names the setting, the problem and the fix."""

    exit_status = BAD_INPUT


class BadCheckpoint(MulocoError):
    """A checkpoint that cannot be loaded: the message names it and the way out."""

    exit_status = BAD_CHECKPOINT


def exit_status(err: BaseException) -> int:
    """The exit status a command ends with on ``err`` (``FAILED`` for anything not muloco's own)."""
    return err.exit_status if isinstance(err, MulocoError) else FAILED
