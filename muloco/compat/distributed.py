"""torch.distributed API drift that breaks torchtitan 0.3.0 after its first step.

* ``torch.distributed.set_timeout`` does not exist in torch 2.13.0 (only the private
  ``distributed_c10d._set_pg_timeout``), yet torchtitan's ``set_pg_timeouts``
  calls it after step 1. This breaks GPU runs too, so the alias is always added.
* The same function calls ``barrier(device_ids=[device_module.current_device()])``;
  on CPU ``torch.cpu.current_device()`` is the string "cpu", which ``BarrierOptions``
  rejects. On CPU we replace ``set_pg_timeouts`` with a version that uses a plain
  barrier; on CUDA torchtitan's own function is kept.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d

from muloco.compat import cpu_device


def _set_timeout(timeout: timedelta, group=None) -> None:
    distributed_c10d._set_pg_timeout(timeout, group)


def set_pg_timeouts_without_device_ids(timeout: timedelta, parallel_dims) -> None:
    """torchtitan's set_pg_timeouts with a barrier that gloo on CPU accepts."""
    dist.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
    for group in groups:
        dist.set_timeout(timeout, group)


def _patch_torchtitan_set_pg_timeouts() -> None:
    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_pg_timeouts = set_pg_timeouts_without_device_ids


def apply() -> None:
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_timeout  # type: ignore[attr-defined]
    if not cpu_device.has_accelerator():
        _patch_torchtitan_set_pg_timeouts()
