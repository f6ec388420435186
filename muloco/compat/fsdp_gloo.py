"""FSDP2 gradient reduce-scatter over gloo.

torchtitan asks FSDP2 to divide gradients by a factor other than the shard-group size,
which FSDP2 turns into ``ReduceOp.PREMUL_SUM``; gloo rejects that op ("Cannot use
ReduceOp.PREMUL_SUM with Gloo"), so any CPU run with more than one rank per replica
group fails in its first backward. FSDP2's own switch ``set_force_sum_reduction_for_comms``
makes it reduce with SUM and divide locally, which is the same result. We wrap the
model's parallelize function so every FSDP module gets that switch when the default
process group is gloo; NCCL runs keep PREMUL_SUM.
"""

from __future__ import annotations

import functools

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule


def uses_gloo() -> bool:
    """gloo carries the gradients: "gloo", or a CPU-only mixed backend string ("cpu:gloo")."""
    if not dist.is_initialized():
        return False
    backend = str(dist.get_backend())
    return "gloo" in backend and "nccl" not in backend


def force_sum_reduction_on_gloo(model) -> int:
    """Switch every FSDP module of ``model`` to SUM reductions under gloo; returns how many."""
    if not uses_gloo():
        return 0
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.set_force_sum_reduction_for_comms(True)
    return len(modules)


def gloo_safe_parallelize(parallelize_fn):
    """``parallelize_fn`` followed by :func:`force_sum_reduction_on_gloo`."""

    @functools.wraps(parallelize_fn)
    def parallelize(model, *args, **kwargs):
        model = parallelize_fn(model, *args, **kwargs)
        force_sum_reduction_on_gloo(model)
        return model

    return parallelize
