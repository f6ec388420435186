"""SDPA inner attention: causal or bidirectional, with an optional per-document mask.

torchtitan's llama3 flavors use FlexAttention, whose backward does not run on CPU,
and its ``get_attention_config("sdpa")`` refuses SDPA for language models; its
``ScaledDotProductAttention`` takes ``is_causal`` per call (``GQAttention`` never
passes it) and refuses any mask. The attention direction is fixed when the model is
built (the objective decides: next-token prediction is causal, masked diffusion is
bidirectional). Packed rows may carry a document mask, which already includes the causal
triangle where the model is causal: a boolean ``(B, 1, L, L)`` from
:func:`muloco.objectives.documents.document_mask` (``True`` = may attend), applied by SDPA,
or a FlexAttention ``BlockMask`` from :func:`~muloco.objectives.documents.document_block_mask`,
applied by torchtitan's compiled :class:`FlexAttention` on CUDA (eager ``flex_attention``
elsewhere: forward only, for tests and evaluation).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
from torchtitan.distributed.compile import maybe_regional_inductor
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

# Flash attention takes no mask; the memory-efficient kernel does (and cuDNN on recent GPUs).
MASKED_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class PrefixKV:
    """Fast-dLLM's block caches for block-wise diffusion sampling, per attention layer: the keys
    and values of the canvas's first ``prefix`` positions (the prompt and the finished blocks) and,
    for the dual cache, of the positions from ``suffix`` on (the masked blocks still to come).

    While ``recording`` a forward over the whole canvas keeps them; afterwards a forward over the
    canvas from ``prefix`` on (up to ``suffix`` with the dual cache; with its ``positions``)
    attends to the kept parts and to itself, so they are not run again at every step of a block.
    The kept keys are those of the block's first step: later tokens of the block are not seen by
    them (the approximation Fast-dLLM makes)."""

    prefix: int = 0
    suffix: int | None = None
    """Where the kept suffix starts (the dual cache); None: no suffix kept (the prefix cache)."""
    recording: bool = False
    kept: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def keys_values(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values this layer attends to (``B, L, N, H``), in canvas order."""
        if self.recording:
            tail = k.shape[1] if self.suffix is None else self.suffix
            self.kept[layer] = (k[:, : self.prefix], v[:, : self.prefix], k[:, tail:], v[:, tail:])
            return k, v
        pk, pv, sk, sv = self.kept[layer]
        return torch.cat([pk, k, sk], dim=1), torch.cat([pv, v, sv], dim=1)


@dataclass
class BlockKV:
    """The exact key/value cache of a block-wise diffusion model: the keys and values of the
    finished (clean) blocks, per attention layer. A forward over the next positions attends to
    them and to itself; with ``append`` its own keys and values join the cache (a finished block's
    clean pass). Block-wise attention never lets a clean block see a later one, so what is kept is
    what a full forward would compute (unlike :class:`PrefixKV`'s approximation)."""

    append: bool = False
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def keys_values(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.kept:
            k, v = (torch.cat([old, new], dim=1) for old, new in zip(self.kept[layer], (k, v)))
        if self.append:
            self.kept[layer] = (k, v)
        return k, v


@contextlib.contextmanager
def kv_cache(model: torch.nn.Module, cache: PrefixKV | BlockKV | None = None) -> Iterator[PrefixKV | BlockKV]:
    """``cache`` (a new :class:`PrefixKV`, prefix or dual, by default; a :class:`BlockKV` for a
    block-wise model) installed in every attention layer of ``model`` for the ``with`` body."""
    layers = [m for m in model.modules() if isinstance(m, SwitchableSDPA)]
    if not layers or any(m.is_causal for m in layers):
        raise ValueError(
            "a sampling cache is for bidirectional (masked-diffusion) models built from muloco's "
            "attention layers (SwitchableSDPA)"
        )
    cache = PrefixKV() if cache is None else cache
    for m in layers:
        m.prefix_cache = cache
    try:
        yield cache
    finally:
        for m in layers:
            m.prefix_cache = None


class SwitchableSDPA(ScaledDotProductAttention):
    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        is_causal: bool = True
        """False gives bidirectional attention (set from the objective, not by hand)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.is_causal = config.is_causal

    prefix_cache: PrefixKV | BlockKV | None = None
    """Set by :func:`kv_cache` while a sampler uses it."""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        if self.prefix_cache is not None:
            k_BLNH, v_BLNH = self.prefix_cache.keys_values(id(self), k_BLNH, v_BLNH)
        if attention_masks is None:
            return super().forward(q_BLNH, k_BLNH, v_BLNH, scale=scale, enable_gqa=enable_gqa, is_causal=self.is_causal)
        if isinstance(attention_masks, BlockMask):
            return self._flex_forward(q_BLNH, k_BLNH, v_BLNH, attention_masks, scale, enable_gqa)
        q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        with sdpa_kernel(MASKED_BACKENDS, set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_masks, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    def _flex_forward(self, q_BLNH, k_BLNH, v_BLNH, block_mask: BlockMask, scale, enable_gqa):
        if self.prefix_cache is not None:
            raise ValueError("the prefix cache takes boolean masks, not a FlexAttention BlockMask")
        q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        if q.device.type == "cuda":
            # torchtitan's compiled flex_attention, called as its FlexAttention module calls it (not
            # held as a submodule: torchtitan would then take every model for a flex model and
            # refuse compile backends other than inductor, whichever mask kernel a run uses)
            with maybe_regional_inductor(FlexAttention.inductor_configs):
                out, _ = FlexAttention.compiled_flex_attn(
                    q,
                    k,
                    v,
                    score_mod=None,
                    block_mask=block_mask,
                    scale=scale,
                    enable_gqa=enable_gqa,
                    return_aux=AuxRequest(lse=False),
                    kernel_options={},
                )
            return out.transpose(1, 2)
        with warnings.catch_warnings():  # "use torch.compile": unfused is what CPU tests and evaluation want
            warnings.filterwarnings("ignore", message=".*flex_attention.*without torch.compile", category=UserWarning)
            out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)
