"""One GPU slice per replica group: which devices each group's processes see.

On a GPU node the launcher gives replica group i the i-th run of N visible devices in
``CUDA_VISIBLE_DEVICES`` and starts N ranks in it (FSDP inside the group, NCCL between
its ranks); ``LOCAL_RANK`` r then means the slice's r-th device. Without a slice every
group's rank 0 would open the node's device 0 and K groups would pile onto one GPU.

- ``--gpus-per-replica N`` (default: the visible GPUs split evenly over the K groups);
- too few GPUs for K·N is an error naming the counts and the ways out;
- ``--share-gpus`` lets groups share devices (group i starts at device (i·N) mod G), for
  tests and small models on one GPU.

Visible devices are ``CUDA_VISIBLE_DEVICES`` when set (so an allocation from SLURM or a
user's own restriction is respected, and ids may be UUIDs), else every device torch
counts. No device: CPU, nothing is set.
"""

from __future__ import annotations

import os

from muloco.utils.errors import BadInput


class GpuLayoutError(BadInput, ValueError):
    """The GPUs cannot be split as asked; the message says how to fix it."""


def visible_gpus(environ: dict[str, str] | None = None, ask_torch: bool = True) -> list[str]:
    """The device ids this launcher may hand out, in order: CUDA_VISIBLE_DEVICES, else (where
    ``ask_torch``) every device torch sees. A SLURM step sets the variable for the GPUs it holds,
    so its launcher need not import torch to count them."""
    env = os.environ if environ is None else environ
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is not None:
        return [d.strip() for d in spec.split(",") if d.strip() and d.strip() != "-1"]
    if not ask_torch:
        return []
    import torch  # here: only a launcher outside SLURM with no CUDA_VISIBLE_DEVICES pays for it

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def gpu_slices(
    visible: list[str], replicas: int, gpus_per_replica: int | None = None, share: bool = False
) -> list[list[str]] | None:
    """Per replica group, the devices it sees; None when there is no GPU (CPU run)."""
    if not visible:
        if gpus_per_replica:
            raise GpuLayoutError(
                f"--gpus-per-replica {gpus_per_replica} but no GPU is visible "
                "(CUDA_VISIBLE_DEVICES empty or no CUDA device); leave it out to run on CPU"
            )
        return None
    g = len(visible)
    if gpus_per_replica is not None and gpus_per_replica < 1:
        raise GpuLayoutError(f"--gpus-per-replica must be at least 1, got {gpus_per_replica}")
    n = gpus_per_replica or (g // replicas if g >= replicas else (1 if share else 0))
    if n == 0 or (not share and replicas * n > g):
        need = replicas * (n or 1)
        raise GpuLayoutError(
            f"{replicas} replica group(s) x {n or 1} GPU(s) each need {need} GPUs; {g} visible "
            f"({', '.join(visible)}). Use fewer --replicas, a smaller --gpus-per-replica, or "
            "--share-gpus to let groups share devices"
        )
    if n > g:
        raise GpuLayoutError(f"--gpus-per-replica {n} is more than the {g} visible GPUs ({', '.join(visible)})")
    return [[visible[(i * n + j) % g] for j in range(n)] for i in range(replicas)]
