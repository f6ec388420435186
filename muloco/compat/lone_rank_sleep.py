"""torchtitan 0.3.0's ``Trainer.train`` ends with rank 0 sleeping 2 s "for other ranks to
complete". A world of one rank (a single-GPU replica group, every CPU test run) has nobody to wait
for and pays the 2 s at every run's end. This gives torchtitan's trainer module a ``time`` whose
``sleep`` is skipped in a world of one and is :mod:`time` otherwise; the log line stays."""

from __future__ import annotations

import time as _time
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


def apply() -> None:
    """Idempotent; called where the trainer is built (after torchtitan was imported there)."""
    import torchtitan.trainer as trainer

    if not isinstance(trainer.time, _TimeSkippingLoneSleep):
        trainer.time = _TimeSkippingLoneSleep()
