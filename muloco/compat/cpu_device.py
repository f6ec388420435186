"""Let torchtitan run on a machine without an accelerator.

torchtitan 0.3.0 picks ``_get_available_device_type() or "cuda"`` at import time
(``tools/utils.py:55``), so on a CPU-only machine it asks CUDA for everything.
Reporting "cpu" instead makes ``init_distributed`` choose gloo on its own. The
device memory monitor (``components/metrics.py:38``) then calls CUDA-style memory
functions on ``torch.cpu``; we give ``torch.cpu`` equivalents backed by the
process's peak resident set size, so memory figures in the logs stay meaningful.
Two of torchtitan's warnings say nothing about a CPU run and are left out there: its lookup of
the GPU's peak FLOPS for MFU (``tools/utils.py``: "Error running lspci", "Peak flops undefined
... fallback to A100"; muloco reports no MFU on CPU), and its overwrite of torchrun's default
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` ("will be overridden to 3"; no NCCL runs on CPU).
When an accelerator is present nothing here changes anything.
"""

from __future__ import annotations

import resource
from collections import namedtuple
from typing import Any

import torch
import torch._utils

_CpuProperties = namedtuple("_CpuProperties", ["name", "total_memory"])


def has_accelerator() -> bool:
    return torch._utils._get_available_device_type() not in (None, "cpu")


def device_type() -> str:
    return torch._utils._get_available_device_type() or "cpu"


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _total_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def get_device_name(device: Any = None) -> str:
    return _cpu_name()


def get_device_properties(device: Any = None) -> _CpuProperties:
    return _CpuProperties(name=_cpu_name(), total_memory=_total_memory_bytes())


def memory_stats(device: Any = None) -> dict[str, int]:
    peak = _peak_rss_bytes()
    return {
        "active_bytes.all.peak": peak,
        "reserved_bytes.all.peak": peak,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }


def reset_peak_memory_stats(device: Any = None) -> None:
    """Peak RSS cannot be reset from inside a process; the figure stays cumulative."""


def empty_cache() -> None:
    """The CPU allocator keeps no cache to release."""


_CPU_MEMORY_API = {
    "get_device_name": get_device_name,
    "get_device_properties": get_device_properties,
    "memory_stats": memory_stats,
    "reset_peak_memory_stats": reset_peak_memory_stats,
    "empty_cache": empty_cache,
}


def _report_cpu_when_no_accelerator() -> None:
    original = torch._utils._get_available_device_type
    if getattr(original, "_muloco_patched", False):
        return

    def available_device_type() -> str | None:
        return original() or "cpu"

    available_device_type._muloco_patched = True  # type: ignore[attr-defined]
    torch._utils._get_available_device_type = available_device_type


def no_peak_flops(device_name: str) -> float:
    """MFU is not reported on CPU: there is no peak to look up (NaN)."""
    return float("nan")


def quiet_gpu_only_warnings() -> None:
    """Called by ``compat.apply`` after the adaptations that must precede torchtitan's import."""
    import os

    if has_accelerator():
        return
    import torchtitan.tools.utils as titan_utils  # after the device type is patched: it reads it at import

    titan_utils.get_peak_flops = no_peak_flops  # trainers call it through the module
    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)  # torchrun's default; NCCL does not run here


def apply() -> None:
    if has_accelerator():
        return
    _report_cpu_when_no_accelerator()
    for name, fn in _CPU_MEMORY_API.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
