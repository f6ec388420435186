"""Packed rows hold several documents; which tokens belong together.

The loader packs ``[bos] + tokens (+ [eos])`` documents end to end, so a document
starts at every BOS: numbering the BOS tokens along a row gives each token its
document (a row that starts inside a document numbers that tail 0). With
bidirectional attention, packing without a mask lets every token read the other
documents of its row; the mask keeps attention inside a document.
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """``(B, L)`` int: the document each token belongs to, counted from 0 per row."""
    return torch.cumsum(tokens == bos_id, dim=-1, dtype=torch.int32)


def document_mask(doc: torch.Tensor, causal: bool) -> torch.Tensor:
    """``(B, 1, L, L)`` bool for SDPA: query i may attend key j iff same document (and j <= i if causal)."""
    mask = doc[:, None, :, None] == doc[:, None, None, :]
    if causal:
        n = doc.shape[-1]
        mask &= torch.ones(n, n, dtype=torch.bool, device=doc.device).tril()
    return mask
