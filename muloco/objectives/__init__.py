"""Training objectives: next-token prediction (``ar``) and masked diffusion (``mdlm``).

``ObjectiveConfig`` is the choice between ``Autoregressive.Config`` and
``MaskedDiffusion.Config``; the command line picks it by name (``--objective mdlm``, or
``--objective.name mdlm``) and the chosen objective fixes the model's attention direction.

The names below are imported when first used, so a torch-free submodule (``sampling_options``,
what ``generate --help`` lists) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "Autoregressive": "muloco.objectives.autoregressive",
    "MaskedDiffusion": "muloco.objectives.diffusion",
    "NoiseKey": "muloco.objectives.objective",
    "Objective": "muloco.objectives.objective",
    "Prepared": "muloco.objectives.objective",
    "SpecialTokens": "muloco.objectives.objective",
}

__all__ = sorted([*_WHERE, "NAMES", "ObjectiveConfig", "named_by_attention"])

NAMES = ("ar", "mdlm")
"""The objectives ``--objective NAME`` picks, the default first; torch-free for command lines that
list them (compare's). ``tests/test_objectives.py`` holds it against ``ObjectiveConfig``."""

if TYPE_CHECKING:
    from muloco.objectives.autoregressive import Autoregressive  # noqa: F401 - for type checkers: the names load lazily (__getattr__)
    from muloco.objectives.diffusion import MaskedDiffusion  # noqa: F401 - for type checkers: the names load lazily (__getattr__)
    from muloco.objectives.objective import NoiseKey, Objective, Prepared, SpecialTokens  # noqa: F401 - for type checkers: the names load lazily (__getattr__)


def _objective_config():
    # lazy, as the package's names are (__getattr__): importing it loads no objective's torch code
    from typing import Annotated

    import tyro

    from muloco.objectives.autoregressive import Autoregressive
    from muloco.objectives.diffusion import MaskedDiffusion

    return (
        Annotated[Autoregressive.Config, tyro.conf.subcommand(Autoregressive.name)]
        | Annotated[MaskedDiffusion.Config, tyro.conf.subcommand(MaskedDiffusion.name)]
    )


def named_by_attention(causal: bool) -> str:
    """The objective whose model attends this way (a Hugging Face folder says only its attention)."""
    from muloco.objectives.autoregressive import Autoregressive
    from muloco.objectives.diffusion import MaskedDiffusion

    return next(cls.name for cls in (Autoregressive, MaskedDiffusion) if cls.causal == causal)


def __getattr__(name: str):
    if name == "ObjectiveConfig":
        value = _objective_config()
    elif name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:
        raise AttributeError(f"module 'muloco.objectives' has no attribute {name!r}")
    globals()[name] = value  # built once: every reader gets the same union
    return value
