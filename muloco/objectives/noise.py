"""The forward (noising) process of masked diffusion: noise levels, schedules, masks.

A row at noise level t has each maskable token replaced by the mask token with
probability p(t) = 1 − α(t). ``linear``: α = 1 − t (p = t, ELBO weight 1/t);
``cosine``: α = 1 − cos(π/2·(1 − t)) (dllm's), weight (π/2)·tan(π/2·(1 − t)). The
ELBO weight is −α′(t)/(1 − α(t)): the continuous-time negative ELBO is
∫₀¹ w(t)·E[Σ_masked −log p(x₀ᵢ | x_t)] dt. t is drawn as ε + (1 − ε)·u with the floor
ε keeping w finite.

Noise levels are stratified: the n rows of one micro-batch, over all data-parallel
ranks of the replica group, get u = (u₀ + j)/n for their global index j and one shared
u₀, so each micro-batch covers [ε, 1) evenly (MDLM stratifies per device only). Every draw comes from a
generator seeded by the caller's key (seed, replica, step, micro-batch, rank), so a
resumed run draws the same noise.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("linear", "cosine")


def check_schedule(name: str, key: str) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"{key} must be one of {', '.join(SCHEDULES)}; got {name!r}")


def mask_probability(t: torch.Tensor, schedule: str) -> torch.Tensor:
    """p(t) = 1 − α(t)."""
    if schedule == "linear":
        return t
    return torch.cos(0.5 * math.pi * (1.0 - t))


def time_of(p: torch.Tensor, schedule: str) -> torch.Tensor:
    """The t whose mask probability is ``p`` (inverse of :func:`mask_probability`)."""
    if schedule == "linear":
        return p
    return 1.0 - torch.acos(p.clamp(0.0, 1.0)) * (2.0 / math.pi)


def elbo_weight(t: torch.Tensor, schedule: str) -> torch.Tensor:
    """−α′(t) / (1 − α(t)): 1/t for the linear schedule."""
    if schedule == "linear":
        return 1.0 / t
    return 0.5 * math.pi * torch.tan(0.5 * math.pi * (1.0 - t))


def generator(device: torch.device, *key: int) -> torch.Generator:
    """A generator on ``device`` seeded from the integers of ``key`` (order matters)."""
    seed = 0
    for part in key:
        seed = (seed * 1_000_003 + int(part) + 1) % (2**63 - 1)
    return torch.Generator(device=device).manual_seed(seed)


def noise_levels(
    first: int,
    count: int,
    total: int,
    eps: float,
    u0: float,
    own: torch.Generator,
    *,
    stratified: bool,
    device: torch.device,
) -> torch.Tensor:
    """t for rows ``first .. first+count-1`` of the ``total`` rows of one step, float32 in [ε, 1).

    ``u0`` is the step's shared offset (the same on every rank); unstratified rows draw
    their own levels from ``own``.
    """
    if stratified:
        u = (u0 + torch.arange(first, first + count, device=device, dtype=torch.float32)) / total
    else:
        u = torch.rand(count, generator=own, device=device)
    return eps + (1.0 - eps) * u


def bernoulli_masks(maskable: torch.Tensor, p: torch.Tensor, own: torch.Generator) -> torch.Tensor:
    """``(B, L)`` bool: each maskable token masked with its row's probability ``p`` (``(B,)``), or
    its own (``(B, L)``, or ``(B, 1)``)."""
    draw = torch.rand(maskable.shape, generator=own, device=maskable.device)
    return maskable & (draw < (p if p.dim() == 2 else p[:, None]))


def exact_count_masks(maskable: torch.Tensor, counts: torch.Tensor, own: torch.Generator) -> torch.Tensor:
    """``(B, L)`` bool: exactly ``counts[b]`` maskable tokens of row b, uniformly at random."""
    keys = torch.rand(maskable.shape, generator=own, device=maskable.device).masked_fill(~maskable, 2.0)
    rank = keys.argsort(dim=-1).argsort(dim=-1)
    return maskable & (rank < counts[:, None])


def cart_weights(masked: torch.Tensor, p: float, tol: float = 1e-6) -> torch.Tensor:
    """CART geometric weights, banded: masked i gets Σ_{j unmasked, j≠i} ½·p·(1−p)^{|i−j|−1}.

    dllm and Dream build a dense L×L matrix (O(L²) memory); the sum is a 1-D
    convolution of the unmasked indicator with a geometric kernel cut where its
    terms fall below ``tol`` (41 taps each side at p = 0.3), so O(L·band).
    """
    L = masked.shape[-1]
    band = min(L - 1, max(1, math.ceil(math.log(tol) / math.log(1.0 - p)))) if L > 1 else 0
    if band == 0:
        return torch.zeros(masked.shape, device=masked.device)
    d = torch.arange(1, band + 1, device=masked.device, dtype=torch.float32)
    side = 0.5 * p * (1.0 - p) ** (d - 1)
    kernel = torch.cat([side.flip(0), torch.zeros(1, device=masked.device), side])
    visible = (~masked).float()[:, None, :]
    out = torch.nn.functional.conv1d(visible, kernel.view(1, 1, -1), padding=band)[:, 0, :]
    return out * masked
