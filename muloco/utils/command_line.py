"""Launcher command lines, parsed by tyro as the trainer's are: ``[options] -- trainer overrides``.

Each launcher's options are one dataclass (its fields' docstrings are the ``--help``). The
command line is split once, at the first ``--``: what follows goes to the trainer unchanged.
An option the launcher does not have is refused the way the trainer refuses an unknown key,
one line naming the closest valid options; then tyro parses the rest (values checked by type,
``--flag`` / ``--no-flag`` for booleans, the same help layout as ``python -m muloco.train``).

A command whose module must import light (``muloco.report``, which ``compare`` imports too)
marks its options with this module's ``tyro`` (``from muloco.utils.command_line import tyro``): it stands
for the real one, imported when the options' annotations are first read, i.e. when a command
line is parsed.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import typing
from typing import TYPE_CHECKING, Any, Callable, NoReturn, TypeVar

from muloco.utils.errors import BadInput, MulocoError, exit_status

T = TypeVar("T")
OVERRIDES_EPILOG = "Everything after `--` goes to the trainer unchanged, e.g. `-- --training.steps 50`."


class UsageError(BadInput, ValueError):
    """A command line the launcher cannot take; printed as one ``error:`` line, exit 2."""


def error_line(command: str, err: object) -> str:
    """The one form every command reports an error in, however it was started (``muloco COMMAND``
    or ``python -m muloco....``): ``muloco COMMAND: error: ...``."""
    return f"muloco {command}: error: {err}"


def failed(command: str, err: object, status: int | None = None) -> int:
    """How a command ends on an error: one line on stderr and the exit status the error stands for
    (``utils/errors.py``; ``status`` for a library's exception, or a message, whose meaning the command knows)."""
    print(error_line(command, err), file=sys.stderr, flush=True)
    return exit_status(err) if status is None else status


class _Tyro:
    """Stands for ``tyro`` in the options' annotations (``tyro.conf.Positional[...]``): they are
    strings (``from __future__ import annotations``) read only by ``parse``, so this imports tyro
    then and not when the command's module is imported."""

    def __getattr__(self, name: str) -> Any:
        import tyro

        return getattr(tyro, name)


if TYPE_CHECKING:
    import tyro
else:
    tyro = _Tyro()


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's own arguments, the trainer overrides after the first ``--``)."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return list(argv), []


def _flag(name: str, underscores: bool) -> str:
    return "--" + (name if underscores else name.replace("_", "-"))


def _marked(hint: Any, marker: str) -> bool:
    """Whether ``hint`` carries ``tyro.conf.<marker>`` (tyro is imported only for an annotated hint)."""
    metadata = getattr(hint, "__metadata__", ())
    return bool(metadata) and any(m is getattr(tyro.conf, marker) for m in metadata)


def option_names(cls: type, underscores: bool = False, prefix: str = "") -> list[str]:
    """Every ``--option`` tyro makes of ``cls`` (``--no-X`` for booleans; nested dataclasses
    with their prefix unless marked ``OmitArgPrefixes``; none for a ``Positional`` field)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    names = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        inner = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Annotated else hint
        if _marked(hint, "Positional"):
            continue
        if dataclasses.is_dataclass(inner):
            sub = "" if _marked(hint, "OmitArgPrefixes") else f"{prefix}{f.name}."
            names += option_names(inner, underscores, sub)
            continue
        flag = _flag(prefix + f.name, underscores)
        names.append(flag)
        if inner is bool:
            names.append(_flag(prefix + ("no_" if underscores else "no-") + f.name, underscores))
    return names


def check_options(args: list[str], valid: list[str], prog: str, overrides: bool = True) -> None:
    """Refuse an option that is not in ``valid``, naming the closest valid ones."""
    for arg in args:
        if not arg.startswith("--") or arg == "--help":
            continue
        flag = arg.split("=", 1)[0]
        if flag in valid:
            continue
        close = difflib.get_close_matches(flag, valid, n=3, cutoff=0.5)
        hint = f" Closest valid options: {', '.join(close)}." if close else ""
        where = "; trainer overrides go after `--`" if overrides else ""
        raise UsageError(f"unknown option '{flag}'.{hint} See {prog} --help{where}.")


def parse(
    cls: type[T], argv: list[str], *, prog: str, description: str, underscores: bool = False, overrides: bool = True
) -> tuple[T, list[str]]:
    """``cls`` from the launcher's arguments, and the trainer overrides after ``--`` (a command
    that starts no trainer, ``overrides=False``, refuses them)."""
    ours, rest = split_overrides(argv)
    if rest and not overrides:
        raise UsageError(f"{prog} starts no trainer: drop the `--` and what follows it ({' '.join(rest)})")
    check_options(ours, option_names(cls, underscores), prog, overrides)
    import tyro  # here, not at import: the launchers' --help answers without it

    options = tyro.cli(
        cls,
        args=ours,
        prog=prog,
        use_underscores=underscores,
        description=f"{description} {OVERRIDES_EPILOG}" if overrides else description,
    )
    return options, rest


def reader_gone() -> int:
    """The exit status for output cut short by its reader (``muloco map | head -1``): not an
    error to report. Python's own advice: point stdout at /dev/null so the interpreter's final
    flush cannot raise again, and exit 1, as a shell reports a program that SIGPIPE stopped."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C, as a shell reports one that SIGINT ended."""


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """``sys.exit(main())`` for a module run as ``python -m``, quiet when its reader goes away,
    one line and its status for a ``MulocoError`` that reached it, and one line, not a traceback,
    when Ctrl-C stops it (what it started has been stopped on the
    way out: each command stops its own children in ``finally`` and ``except`` blocks)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    try:
        code = main()
    except BrokenPipeError:
        code = reader_gone()
    except KeyboardInterrupt:
        prog = f"python -m {spec.name.removesuffix('.__main__')}" if spec else "muloco"
        print(f"{prog}: interrupted (Ctrl-C)", file=sys.stderr)
        code = INTERRUPTED
    except MulocoError as err:  # one a command's main let through: still one line and its status
        name = spec.name.removesuffix(".__main__").rsplit(".", 1)[-1] if spec else "muloco"
        code = failed(name, err)
    sys.exit(code)
