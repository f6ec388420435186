"""torchtitan 0.3.0's validator module (``torchtitan.components.validate``, imported by its
trainer) imports its Hugging Face text dataloader, ``torchtitan.hf_datasets.text_datasets``,
whose first lines import the ``datasets`` package, and with it pandas, pyarrow and aiohttp. Every
process that imports torchtitan's trainer paid for it: each trainer rank, each launcher that checks
a config, ``compare``. A config check took 5.80 s of CPU and 489 MiB with it, 4.71 s and 370 MiB
without (median of 7 pairs, ``farm-bench``, 2026-11-27). muloco reads its corpora itself
(:mod:`muloco.data`); torchtitan's dataloader is built only when a user configures it.

This imports torchtitan's module once with the three names it takes from ``datasets``
(``Dataset``, ``load_dataset``, ``datasets.distributed.split_dataset_by_node``) bound to
stand-ins that import the real package on first use: the functions call through, and
``isinstance``/``issubclass`` against the ``Dataset`` stand-in ask the real class. The
``datasets`` package itself is left alone: the stand-in modules exist only while torchtitan's
module is imported, so any later ``import datasets`` gets the real one.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

TEXT_DATASETS = "torchtitan.hf_datasets.text_datasets"


def _real(name: str, module: str = "datasets") -> Any:
    return getattr(importlib.import_module(module), name)


class _AsksTheRealDataset(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _real("Dataset"))

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _real("Dataset"))


class Dataset(metaclass=_AsksTheRealDataset):
    """Stands for ``datasets.Dataset`` in torchtitan's module: type checks ask the real class."""


def load_dataset(*args: Any, **kwargs: Any) -> Any:
    """``datasets.load_dataset``, imported when first called."""
    return _real("load_dataset")(*args, **kwargs)


def split_dataset_by_node(*args: Any, **kwargs: Any) -> Any:
    """``datasets.distributed.split_dataset_by_node``, imported when first called."""
    return _real("split_dataset_by_node", "datasets.distributed")(*args, **kwargs)


def _stand_in_modules() -> dict[str, types.ModuleType]:
    package, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    package.Dataset, package.load_dataset, package.distributed = Dataset, load_dataset, distributed
    distributed.split_dataset_by_node = split_dataset_by_node
    return {"datasets": package, "datasets.distributed": distributed}


def apply() -> None:
    """Import torchtitan's text dataloader module with the stand-ins; idempotent, and nothing to
    do when it or ``datasets`` was imported already (then it holds the real names)."""
    if TEXT_DATASETS in sys.modules or "datasets" in sys.modules:
        return
    stand_ins = _stand_in_modules()
    sys.modules.update(stand_ins)
    try:
        importlib.import_module(TEXT_DATASETS)
    finally:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
