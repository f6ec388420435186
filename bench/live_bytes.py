"""Peak bytes of tensor storage allocated while a block runs (CPU or any device).

A ``TorchDispatchMode`` sees every aten op on this thread: each storage an op returns that
none of its inputs had (a view or an ``out=`` result is no allocation) is counted until it
is freed (a finalizer on the storage, which torch keeps alive exactly as long as the
memory). What it misses: temporaries inside a single op, and other threads' allocations
(run what you measure on this thread: ``exchange_worker_inline``). Used by ``bench/codecs.py`` and the exchange's
memory test; on CUDA ``torch.cuda.max_memory_allocated`` is the allocator's own figure.

    .venv/bin/python bench/live_bytes.py [--smoke] [--mb 4]

run as a script, it calibrates itself: known allocations (a new tensor, a view, an ``out=``
result, a freed temporary, a chain of ops) and the peak it counts for each, against the bytes
they must count; ``--smoke`` (what CI runs) uses 64 kB tensors. It exits 1 if a count is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
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
        inputs = {
            t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
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


def _cases(n: int) -> list[tuple[str, int, object]]:
    """(what, the peak it must count in bytes, the block) for float32 tensors of ``n`` elements."""
    x = torch.ones(n)
    out = torch.empty(n)
    size = 4 * n

    def freed_temporaries():
        for _ in range(3):
            y = x * 2  # each is freed before the next: the peak is one of them
            del y

    return [
        ("new tensor (x * 2)", size, lambda: x * 2),
        ("view (x.view(-1)[1:])", 0, lambda: x.view(-1)[1:]),
        ("out= result (torch.mul(x, 2, out=...))", 0, lambda: torch.mul(x, 2, out=out)),
        ("3 temporaries, each freed", size, freed_temporaries),
        ("(x + 1) * 2: temporary and result at once", 2 * size, lambda: (x + 1) * 2),
    ]


def calibrate(n: int) -> bool:
    """Print each case's expected and counted peak; True when every count is right."""
    print(f"{'case':<42}{'expected B':>12}{'counted B':>12}  ok")
    right = True
    for what, expected, block in _cases(n):
        with LiveBytes() as mode:
            kept = block()  # what the block returns stays alive until the count is read
        del kept
        ok = mode.peak == expected
        right &= ok
        print(f"{what:<42}{expected:>12,}{mode.peak:>12,}  {'yes' if ok else 'NO'}")
    return right


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Calibrate LiveBytes on known allocations.")
    p.add_argument("--mb", type=float, default=4.0, help="size of each tensor (MB)")
    p.add_argument("--smoke", action="store_true", help="64 kB tensors: the check in a second (CI)")
    args = p.parse_args(argv)
    n = 16_384 if args.smoke else int(args.mb * 1e6 / 4)
    return 0 if calibrate(n) else 1


if __name__ == "__main__":
    sys.exit(main())
