"""Where θ_g and the outer state live, and how tensors move between there and the model.

``outer.backup_device``:

- ``auto`` (default): ``device`` when training on an accelerator, else ``cpu``;
- ``device``: θ_g, outer momentum and error feedback on the training device. Moving
  tensors is free; costs 2× fp32 model memory per replica (θ_g + momentum).
- ``cpu``: θ_g and momentum in host memory, for models whose accelerator memory is
  short. On CUDA the host tensors are *pinned* so copies are asynchronous DMA: the
  copies to the device run on a side stream that the training stream then waits
  for; the copies back are issued on the side stream once the training stream is done
  with the averaged pseudo-gradient and awaited once per sync; every move is a single
  ``torch._foreach_copy_`` over the fragment (torch's multi-tensor path), never a
  Python loop of synchronous per-tensor copies.
"""

from __future__ import annotations

import contextlib

import torch

BACKUP_DEVICES = ("auto", "device", "cpu")


def resolve_backup_device(requested: str, device: torch.device) -> torch.device:
    """The device θ_g lives on for ``outer.backup_device`` = ``requested``."""
    if requested not in BACKUP_DEVICES:
        raise ValueError(f"outer.backup_device must be one of {', '.join(BACKUP_DEVICES)}; got {requested!r}")
    if requested == "cpu" or (requested == "auto" and device.type == "cpu"):
        return torch.device("cpu")
    return device


class Placement:
    """θ_g's home (``backup``) and the training ``device``, with the copies between them."""

    def __init__(self, backup: torch.device, device: torch.device):
        self.backup, self.device = backup, device
        self.pinned = backup.type == "cpu" and device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self.pinned else None

    def describe(self) -> str:
        if self.pinned:
            return "pinned CPU memory (side-stream copies)"
        return f"{self.backup}" + (" (the training device)" if self.backup == self.device else "")

    def home(self, t: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of ``t`` on the backup device (pinned host memory under CUDA)."""
        out = t.detach().to(self.backup, dtype=torch.float32, copy=True)
        return out.pin_memory() if self.pinned else out

    def zeros_like(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(t)
        return out.pin_memory() if self.pinned else out

    def to_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (on the backup device) on the training device; the same tensors if
        they are there already. The result is ready to use on the current stream."""
        if not tensors or tensors[0].device == self.device:
            return tensors
        out = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in tensors]  # current stream's memory
        self.copy_to_device(out, tensors)
        return out

    def subtract_into(self, out: list[torch.Tensor], globals_: list[torch.Tensor], locals_: list[torch.Tensor]) -> None:
        """``out`` ← θ_g − θ_local: one pass where θ_g lives on the training device (an
        asynchronous kernel per tensor, into the caller's buffers), else the copy over first."""
        if globals_ and globals_[0].device == self.device:
            for o, g, local in zip(out, globals_, locals_):
                torch.sub(g, local, out=o)
            return
        self.copy_to_device(out, globals_)
        torch._foreach_sub_(out, locals_)

    def copy_to_device(self, out: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
        """``out`` (on the training device) ← ``tensors`` (on the backup device), ready to use
        on the current stream when this returns."""
        if not tensors:
            return
        if tensors[0].device == self.device:
            torch._foreach_copy_(out, tensors)
            return
        with self._on_side_stream():
            torch._foreach_copy_(out, tensors, non_blocking=self.pinned)

    def to_backup(self, tensors: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """``tensors`` (on the training device) on the backup device in ``dtype``, complete
        when this returns (the host reads them next)."""
        if not tensors or (tensors[0].device == self.backup and tensors[0].dtype == dtype):
            return tensors
        out = [torch.empty(t.shape, dtype=dtype, pin_memory=self.pinned) for t in tensors]
        with self._on_side_stream():
            torch._foreach_copy_(out, tensors, non_blocking=self.pinned)
        if self._side is not None:
            self._side.synchronize()
        return out

    def pull(self, locals_: list[torch.Tensor], globals_: list[torch.Tensor], alpha: float) -> None:
        """θ_local ← θ_g + α·(θ_local − θ_g), θ_g read from its home."""
        if alpha == 0.0:
            torch._foreach_copy_(locals_, globals_, non_blocking=self.pinned)  # in stream order
            return
        on_device = self.to_device(globals_)
        if on_device and on_device[0].dtype != locals_[0].dtype:
            on_device = [g.to(locals_[0].dtype) for g in on_device]
        torch._foreach_lerp_(locals_, on_device, 1.0 - alpha)

    @contextlib.contextmanager
    def _on_side_stream(self):
        """Run copies on the side stream, ordered after the training stream's work so far;
        the training stream waits for them afterwards."""
        if self._side is None:
            yield
            return
        main = torch.cuda.current_stream(self.device)
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            yield
        main.wait_stream(self._side)
