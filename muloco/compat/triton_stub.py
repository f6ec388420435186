"""Import torchtitan's trainer on machines without Triton.

``torchtitan/distributed/minimal_async_ep/kernels.py`` does ``import triton`` at
module level, and the trainer reaches it through ``token_dispatcher`` even for
dense models. The CPU build of torch brings no Triton (the CUDA build from PyPI,
which setup.sh falls back to, does: with it present everything runs as it is,
since muloco never asks torchft for its Triton-quantized all-reduce), so when
Triton is missing we put a stand-in for that single module into ``sys.modules``. Its kernels are only
used by expert-parallel MoE on CUDA; touching one raises a clear error.
"""

from __future__ import annotations

import importlib.util
import sys
import types

KERNELS_MODULE = "torchtitan.distributed.minimal_async_ep.kernels"


class _MissingTritonKernels(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(
                f"{KERNELS_MODULE}.{name} needs Triton, which is not installed. "
                "Expert-parallel MoE kernels run only on CUDA with triton installed "
                "(./setup.sh --cuda)."
            )

        return unavailable


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def apply() -> None:
    if triton_available() or KERNELS_MODULE in sys.modules:
        return
    sys.modules[KERNELS_MODULE] = _MissingTritonKernels(KERNELS_MODULE)
