"""Training objectives: next-token prediction (``ar``) and masked diffusion (``mdlm``).

``ObjectiveConfig`` is the choice between ``Autoregressive.Config`` and
``MaskedDiffusion.Config``; the command line picks it by name (``--objective mdlm``, or
``--objective.name mdlm``) and the chosen objective fixes the model's attention direction.
"""

from typing import Annotated

import tyro

from .autoregressive import Autoregressive
from .diffusion import MaskedDiffusion
from .objective import NoiseKey, Objective, Prepared, SpecialTokens

ObjectiveConfig = (
    Annotated[Autoregressive.Config, tyro.conf.subcommand(Autoregressive.name)]
    | Annotated[MaskedDiffusion.Config, tyro.conf.subcommand(MaskedDiffusion.name)]
)

__all__ = ["Autoregressive", "MaskedDiffusion", "NoiseKey", "Objective", "ObjectiveConfig", "Prepared",
           "SpecialTokens"]
