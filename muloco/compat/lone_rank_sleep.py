"""torchtitan 0.3.0's ``Trainer.train`` ends with rank 0 sleeping 2 s "for other ranks to
complete", and so does the ``train`` of its torchft experiment's ``FaultTolerantTrainer`` (the
DiLoCo trainer's base). A world of one rank (a single-GPU replica group, every CPU test run) has
nobody to wait for and pays the 2 s at every run's end. This gives each trainer module a ``time``
whose ``sleep`` is skipped in a world of one and is :mod:`time` otherwise; the log line stays."""

from __future__ import annotations

import time as _time
from types import ModuleType
from typing import Any

import torch.distributed as dist


class _TimeSkippingLoneSleep:
    """:mod:`time`, except that ``sleep`` does nothing when this process is the whole world."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
            return
        _time.sleep(seconds)


def apply(trainer_module: ModuleType) -> None:
    """Idempotent; called by the module that subclasses the trainer ``trainer_module`` defines
    (``torchtitan.trainer``, ``torchtitan.experiments.torchft.trainer``), after importing it."""
    if not isinstance(trainer_module.time, _TimeSkippingLoneSleep):
        trainer_module.time = _TimeSkippingLoneSleep()
