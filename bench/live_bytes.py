"""Peak bytes of tensor storage allocated while a block runs (CPU or any device).

A ``TorchDispatchMode`` sees every aten op on this thread: each storage an op returns that
none of its inputs had (a view or an ``out=`` result is no allocation) is counted until it
is freed (a finalizer on the storage, which torch keeps alive exactly as long as the
memory). What it misses: temporaries inside a single op, and other threads' allocations
(run what you measure on this thread: ``exchange_worker_inline``). Used by ``bench/codecs.py`` and the exchange's
memory test; on CUDA ``torch.cuda.max_memory_allocated`` is the allocator's own figure.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self._seen and key not in inputs:
                self._seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


class _Inline:
    """A stand-in for ``threading.Thread`` that runs its target on ``start()``."""

    def __init__(self, target, **kwargs):
        self.target = target

    def start(self):
        self.target()

    def join(self):
        pass


@contextlib.contextmanager
def exchange_worker_inline():
    """While active, the exchange's worker (``muloco/outer/exchange/pipeline.py``) runs on
    the thread that starts a sync: the same schedule, where a dispatch mode can see it."""
    import muloco.outer.exchange.pipeline as pipeline

    real = pipeline.threading
    pipeline.threading = types.SimpleNamespace(Thread=_Inline, Lock=threading.Lock)
    try:
        yield
    finally:
        pipeline.threading = real
