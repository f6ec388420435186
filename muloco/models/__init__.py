"""The models: the model map (``flavors.py``: every flavor's shape, parameter count, budget and tuned
settings, pure Python), Llama-3-family models built from torchtitan's blocks (``llama.py``), their
attention (``attention.py``), sandwich block (``block.py``) and LoRA adapters (``lora.py``).

The names below load on first use, so a reader of the model map (``muloco map``, a sweep file on a
login node) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    **dict.fromkeys(("HF_FLAVOR", "hf_folder", "parse_flavor"), "muloco.models.flavors"),
    **dict.fromkeys(
        (
            "Architecture",
            "ModelConfig",
            "RopeScaling",
            "architecture_config",
            "build",
            "build_model_config",
            "build_model_spec",
            "hf_adapter",
            "init_model",
        ),
        "muloco.models.llama",
    ),
}

__all__ = sorted(_WHERE)

if TYPE_CHECKING:
    from muloco.models.flavors import HF_FLAVOR, hf_folder, parse_flavor  # noqa: F401 - loaded lazily (__getattr__)
    from muloco.models.llama import (  # noqa: F401 - loaded lazily (__getattr__)
        Architecture,
        ModelConfig,
        RopeScaling,
        architecture_config,
        build,
        build_model_config,
        build_model_spec,
        hf_adapter,
        init_model,
    )


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'muloco.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
