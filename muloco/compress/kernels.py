"""Compiled codec kernels: ``torch.compile`` of the codecs' own eager functions.

Each codec writes its encode and decode as a few pure tensor functions (statistics,
codes and packing, table lookup). Eager mode calls them as they are; ``compiled=True``
calls them through ``torch.compile``, which on a GPU fuses each into one or two Triton
kernels (on a CPU, into C++ loops). Same functions, same inputs: the payloads are the
same bytes, provided nothing in them depends on the order of floating-point additions,
which is why the compiled quantizer takes its statistics as integer sums (see
``quantize.py``). Tests compare the two byte for byte.

The exchange runs the eager kernels unless asked (``outer.exchange.kernels``: auto | eager |
compiled; auto is eager): on an H200 the compiled 2-bit statistical quantizer (the default
codec) encoded 100M elements in 43.6 ms against the eager 8.2 (compiled absmax and top-k
encoding were faster, by 1.8x and 1.06x), every compiled decode was slower than the eager one,
and a K=2 2-bit sync at 158M took 225 ms with compiled kernels against 80 ms with eager ones,
timed by device work (docs/gpu.md). Compiling also costs seconds at the first sync of each
bucket shape.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torchtitan.tools.logging import logger

KERNELS = ("auto", "eager", "compiled")


def use_compiled(kernels: str, device: torch.device) -> bool:
    """Whether the codecs of an exchange on ``device`` run compiled kernels."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    return kernels == "compiled"  # auto: eager (the module docstring says why)


@functools.cache
def compiled_kernel(fn: Callable) -> Callable:
    """``fn`` through ``torch.compile``, once per function (shapes are dynamic: buckets,
    reduce-scatter ranges and the last partial bucket share one compiled kernel).

    If compiling or running the compiled kernel fails (a toolchain that cannot build
    kernels on this host, say), the eager function takes over for good, after one warning:
    its payloads are the same bytes, so replicas that compiled and replicas that did not
    still agree.
    """
    compiled = torch.compile(fn, dynamic=True, fullgraph=False)
    state = {"broken": None}

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if state["broken"] is None:
            try:
                return compiled(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - any compiler failure; the eager path is equivalent
                state["broken"] = err
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                logger.warning(
                    f"compiled codec kernel {fn.__name__} failed ({type(err).__name__}: {first}); "
                    "using the eager kernels (the same payloads) from now on"
                )
        return fn(*args, **kwargs)

    return run
