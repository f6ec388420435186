"""torchtitan 0.3.0 compiles two functions when its attention module is imported:
``FlexAttention._compiled_flex_attn = torch.compile(flex_attention, options=...)`` and
``_compiled_create_block_mask = torch.compile(create_block_mask)`` in
``torchtitan/models/common/attention.py``, which every trainer imports through its model. Calling
``torch.compile`` looks its backend up, and the inductor backend's lookup imports inductor's
``compile_fx`` and what hangs from it, though only a model with flex attention ever calls either
function. Importing ``muloco.train`` took 4.35 s of CPU and 359 MiB with it, 3.63 s and 333 MiB
without (median of 7 pairs, ``farm-bench``, 2026-11-28, beside other work): in every rank, every
launcher that checks a config and every test process.

On a machine without an accelerator, while that one module (and what it imports) executes,
``torch.compile(fn, **options)`` of a plain function returns a function that calls
``torch.compile(fn, **options)`` on its first call and the compiled function from then on:
``torch.compile`` itself compiles nothing before the first call either, so what runs is the same.
Modules, and every other caller of ``torch.compile``, get the real one. Nothing calls either
function there (muloco runs flex attention eagerly off CUDA: ``muloco.models.attention``). With an
accelerator nothing changes: a compiled model on CUDA traces into torchtitan's compiled flex
attention, and a first call inside that trace would put ``torch.compile`` itself into it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
from typing import Any, Callable

ATTENTION = "torchtitan.models.common.attention"


def compile_on_first_call(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``compile_fn`` (``torch.compile``), except that a plain function is compiled on its first call."""

    def deferred(model: Any = None, **options: Any) -> Any:
        if not inspect.isfunction(model):
            return compile_fn(**options) if model is None else compile_fn(model, **options)
        compiled = None

        @functools.wraps(model)
        def compiles_on_first_call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **options)
            return compiled(*args, **kwargs)

        return compiles_on_first_call

    return deferred


class _DeferringLoader(importlib.abc.Loader):
    """Executes the module with ``torch.compile`` deferred, then puts the real one back."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        import torch

        real = torch.compile
        torch.compile = compile_on_first_call(real)
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = real


class _AttentionFinder(importlib.abc.MetaPathFinder):
    """Finds torchtitan's attention module as Python would, and loads it with ``_DeferringLoader``."""

    def find_spec(self, name, path, target=None):
        if name != ATTENTION:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferringLoader(spec.loader)
        return spec


def apply() -> None:
    """Install the finder on a machine without an accelerator; nothing to do when the module was
    imported already."""
    from muloco.compat.cpu_device import has_accelerator  # imports torch: not at module level

    if ATTENTION in sys.modules or any(isinstance(f, _AttentionFinder) for f in sys.meta_path) or has_accelerator():
        return
    sys.meta_path.insert(0, _AttentionFinder())
