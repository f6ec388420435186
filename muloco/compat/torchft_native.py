"""torchft 0.2.0's lighthouse without torch: the quorum server is Rust (``torchft._torchft``),
but importing it the usual way runs ``torchft/__init__.py``, which imports the manager, the
process groups and torch (2-3 s of CPU, several seconds of wall-clock on a busy node) in a
process that never touches a tensor. Every job starts one lighthouse, and it has to be up before
a group can form a quorum.

:func:`lighthouse_server` loads the extension module from torchft's installed folder under its
own name, ``torchft._torchft``, and registers it there: if the process imports ``torchft`` later,
its ``from torchft._torchft import ...`` finds the same module (a PyO3 extension cannot be
initialised twice). Where ``torchft`` is already imported, the usual class is returned."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

from muloco.compat import torchft_log_level

NAME = "torchft._torchft"


def lighthouse_server() -> type:
    """torchft's ``LighthouseServer`` class, without importing the ``torchft`` package when it
    is not imported yet. Sets torchft's Rust log level first (it is read when the module loads)."""
    torchft_log_level.apply()
    if NAME not in sys.modules and "torchft" not in sys.modules:
        sys.modules[NAME] = _load_extension()
    return sys.modules[NAME].LighthouseServer if NAME in sys.modules else _imported()


def _imported() -> type:
    from torchft.coordination import LighthouseServer

    return LighthouseServer


def _load_extension():
    spec = importlib.util.find_spec("torchft")  # a top-level package's spec runs none of its code
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torchft is not installed: pip install torchft (see the README's setup)")
    folder = Path(spec.submodule_search_locations[0])
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = folder / f"_torchft{suffix}"
        if path.is_file():
            ext_spec = importlib.util.spec_from_file_location(NAME, path)
            module = importlib.util.module_from_spec(ext_spec)
            ext_spec.loader.exec_module(module)
            return module
    raise ImportError(f"torchft's Rust extension _torchft is missing from {folder}: reinstall torchft")
