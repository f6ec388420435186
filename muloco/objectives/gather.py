"""The masked positions of a micro-batch, gathered without waiting on the device.

``x[masked]`` with a boolean mask must know how many positions are True before it can size
its output: on CUDA that is a device-to-host copy and a wait, once per indexed tensor and
micro-batch, which stalls the queue of kernels the host has run ahead with. The
masked-diffusion loss gathers hidden states, labels and weights at the masked positions.
With a capacity known on the host, :func:`torch.nonzero_static` sizes the gather without a
sync: the first ``capacity`` masked positions, then padding (index 0, ``valid`` False, weight 0).

The capacity comes from the noise levels, which are known on the host before the masks are
drawn (:func:`mask_capacity`): the number of masked tokens is a sum of independent Bernoulli
draws, at most L per row with the row's probability p, so its mean is at most
μ = L·Σp and its variance at most σ² = L·Σp(1−p). Bernstein's inequality puts the chance of
more than μ + 8σ + 48 masked tokens below e^−32 ≈ 1e−14 per micro-batch; a device-side
assert (no sync) stops the run if it ever happens, rather than silently dropping a token.
On CPU there is no queue to stall, and the exact gather (:meth:`MaskedPositions.exact`) is used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROUND_TO = 64
"""Capacities are rounded up to a multiple of this (fewer distinct shapes for kernels and the allocator)."""


def mask_capacity(p: torch.Tensor, length: int) -> int:
    """Rows to gather for ``p.numel()`` rows of ``length`` tokens masked with probabilities ``p``
    (host values): never fewer than the masked tokens except with probability < 1e−14."""
    p = p.detach().to("cpu", torch.float64).clamp(0.0, 1.0)
    mean = length * float(p.sum())
    sigma = math.sqrt(length * float((p * (1.0 - p)).sum()))
    bound = math.ceil(mean + 8.0 * sigma + 48.0)
    return min(p.numel() * length, ROUND_TO * math.ceil(bound / ROUND_TO))


@dataclass
class MaskedPositions:
    """Flat indices into a ``(B, L)`` grid: where the loss is computed."""

    index: torch.Tensor
    """``(C,)`` int64 into the flattened grid; padding entries point at 0."""
    valid: torch.Tensor | None = None
    """``(C,)`` bool, False at padding; None when every entry is a masked position."""

    @classmethod
    def exact(cls, masked: torch.Tensor) -> MaskedPositions:
        """Every masked position, in row-major order (sizes itself from the data: a sync on CUDA)."""
        return cls(masked.flatten().nonzero().squeeze(1))

    @classmethod
    def padded(cls, masked: torch.Tensor, capacity: int) -> MaskedPositions:
        """The masked positions in row-major order, padded to ``capacity`` entries, with no sync."""
        flat = masked.flatten()
        torch._assert_async(flat.sum() <= capacity, "more masked tokens than the gather's capacity")
        index = torch.nonzero_static(flat, size=capacity, fill_value=-1).squeeze(1)
        valid = index >= 0
        return cls(index.clamp_min(0), valid)

    @classmethod
    def of(cls, masked: torch.Tensor, capacity: int | None) -> MaskedPositions:
        """Padded to ``capacity`` on CUDA, exact elsewhere or without a capacity."""
        if capacity is None or masked.device.type != "cuda":
            return cls.exact(masked)
        return cls.padded(masked, capacity)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``(B, L, ...)``) at the positions: ``(C, ...)``."""
        return x.flatten(0, 1).index_select(0, self.index)

    def weights(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` (``(B, L)``) at the positions, 0 at padding."""
        picked = self.take(w)
        return picked if self.valid is None else picked * self.valid
