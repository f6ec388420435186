"""Newton–Schulz orthogonalisation for Muon: X ↦ ≈ U·Vᵀ of X = U·Σ·Vᵀ.

Quintic iteration on X with rows ≤ cols, started from X / ‖X‖_F:
A = X·Xᵀ;  X ← a·X + (b·A + c·A²)·X, with one (a, b, c) per iteration. Runs in
bfloat16 (on CPU too: about 2× faster than fp32 on AVX512-BF16) and batched over a
leading dimension, so matrices of one shape are orthogonalised together.
"""

from __future__ import annotations

import torch

COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    # Keller Jordan's fixed polynomial (torch.optim.Muon, KellerJordan/Muon, Moonlight).
    "keller": ((3.4445, -4.7750, 2.0315),),
    # @leloykun's per-iteration set, as in microsoft/dion and MuLoCo.
    "muloco": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    # Polar Express (Amsel et al.), minimax-optimal per iteration with a 1.02 safety factor.
    "polar_express": (
        (8.1566, -22.4833, 15.8788),
        (4.0429, -2.8089, 0.5000),
        (3.8917, -2.7725, 0.5061),
        (3.2858, -2.3681, 0.4645),
        (2.3465, -1.7098, 0.4232),
    ),
}


def coefficient_schedule(name: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) per iteration; a set shorter than ``steps`` repeats its last triple."""
    if name not in COEFFICIENTS:
        raise ValueError(f"unknown Newton–Schulz coefficient set {name!r}; choose one of {', '.join(COEFFICIENTS)}")
    if steps < 1:
        raise ValueError(f"Newton–Schulz steps must be >= 1, got {steps}")
    triples = COEFFICIENTS[name]
    return [triples[min(i, len(triples) - 1)] for i in range(steps)]


def orthogonalize(g: torch.Tensor, coefficients: str = "keller", steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Orthogonalise the last two dimensions of ``g`` (a matrix or a batch of them)."""
    schedule = coefficient_schedule(coefficients, steps)
    x = g.to(torch.bfloat16)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True)
    if coefficients == "polar_express":
        x = x / (norm * 1.02 + 1e-6)
    else:
        x = x / (norm + eps)
    for a, b, c in schedule:
        s = x @ x.mT
        poly = torch.baddbmm(s, s, s, beta=b, alpha=c) if s.dim() == 3 else torch.addmm(s, s, s, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a) if x.dim() == 3 else torch.addmm(x, poly, x, beta=a)
    if tall:
        x = x.mT
    return x.to(g.dtype)


def orthogonalize_many(mats: list[torch.Tensor], **kwargs) -> list[torch.Tensor]:
    """:func:`orthogonalize` each matrix, batching all of the same shape up to transposition.

    A tall matrix is orthogonalised as its (wide) transpose anyway, so FFN w1/w3
    (hidden × dim) and w2 (dim × hidden) share one batched call: fewer, larger
    multiplies, which is where Newton–Schulz gets its FLOP rate.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(mats):
        groups.setdefault((min(m.shape), max(m.shape)), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(mats)
    for members in groups.values():
        wide = [mats[i].mT if mats[i].size(0) > mats[i].size(1) else mats[i] for i in members]
        result = orthogonalize(torch.stack(wide), **kwargs)
        for i, r in zip(members, result.unbind(0)):
            out[i] = r.mT if mats[i].size(0) > mats[i].size(1) else r
    return out  # type: ignore[return-value]
