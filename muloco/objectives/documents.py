"""Packed rows hold several documents; which tokens belong together.

The loader packs ``[bos] + tokens (+ [eos])`` documents end to end, so a document
starts at every BOS: numbering the BOS tokens along a row gives each token its
document (a row that starts inside a document numbers that tail 0). With
bidirectional attention, packing without a mask lets every token read the other
documents of its row; the mask keeps attention inside a document.

The same mask comes in two forms: a dense ``(B, 1, L, L)`` boolean for SDPA, and a
FlexAttention :class:`BlockMask`, which records per 128×128 tile whether it is empty, full or
partial, so the kernel skips the tiles no query may attend (most of them when a row packs
many short documents) and reads no L×L mask from memory.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from torchtitan.models.common.attention import create_attention_mask


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


def document_block_mask(doc: torch.Tensor, causal: bool) -> BlockMask:
    """The mask of :func:`document_mask` as a FlexAttention ``BlockMask`` (heads broadcast)."""

    def same_document(b, h, q, kv):
        same = doc[b, q] == doc[b, kv]
        return same & (kv <= q) if causal else same

    rows, length = doc.shape
    return evaluate_mask(same_document, rows, length, length, doc.device, flex=True)


def evaluate_mask(mask_mod, rows: int, queries: int, keys: int, device: torch.device, flex: bool):
    """``mask_mod(b, h, q, kv)`` as SDPA's dense ``(B, 1, Lq, Lk)`` boolean (``flex`` False) or as a
    FlexAttention ``BlockMask``: on CUDA built by torchtitan's compiled ``create_block_mask`` (what
    its trainer uses per batch), elsewhere eagerly."""
    if flex:
        build = create_attention_mask if device.type == "cuda" else create_block_mask
        return build(mask_mod, rows, None, queries, keys, device=device)
    b = torch.arange(rows, device=device)[:, None, None]
    q = torch.arange(queries, device=device)[None, :, None]
    kv = torch.arange(keys, device=device)[None, None, :]
    return mask_mod(b, None, q, kv)[:, None]
