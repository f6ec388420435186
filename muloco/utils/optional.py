"""The optional extras of the package, and the one error a missing one gives.

The core install trains, launches and reports; the pieces below are extras
(``pyproject.toml``'s ``[project.optional-dependencies]``) imported only where used:
plots (matplotlib), wandb, hf (transformers: exporting a tiktoken tokenizer, loading
exports) and eval (lm-evaluation-harness). A command that needs a missing one says which
extra installs it instead of failing with a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib.util

from muloco.utils.errors import BadInput

EXTRAS = {"matplotlib": "plots", "wandb": "wandb", "transformers": "hf", "lm_eval": "eval"}
"""Importable module → the extra that installs it."""


class MissingExtra(BadInput, ImportError):
    """An optional extra that a command needs is not installed."""


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules as None: marked missing (how tests take an extra away)
        return False


def require(module: str, what: str) -> None:
    """Raise :class:`MissingExtra` naming the extra when ``module`` is not importable."""
    if not installed(module):
        extra = EXTRAS[module]
        raise MissingExtra(
            f"{what} needs the optional extra '{extra}' ({module} is not installed): "
            f"pip install 'muloco[{extra}]' (in a clone: .venv/bin/pip install -e '.[{extra}]')"
        )
