"""How a masked-diffusion model reads a noised row: the AR-to-diffusion conversion recipes.

A recipe is the attention pattern and output alignment the ``mdlm`` objective trains with,
picked by name like a codec (``--objective.recipe dream``):

- ``full`` (LLaDA, MDLM, the LMMs Engine recipe that switches Qwen3's causal mask to a full one):
  every position attends to every other (within its document), the output at position i
  predicts token i.
- ``dream`` (Dream 7B, DiffuLLaMA): the same attention, but the output at position i − 1
  predicts token i ("token shift"), so an AR model's head keeps the meaning it was trained
  with; a row's first token has no predictor and is never masked. Dream pairs it with CART
  weights (``--objective.weight cart``).
- ``block`` (BD3-LM, Fast-dLLM v2, Efficient-DLM): the row is cut into blocks of
  ``block_size``; the model reads the noised row followed by the clean row (2L tokens, each copy
  at positions 0..L−1), a noised block attends bidirectionally to itself and to the *clean*
  blocks before it, a clean block to itself and the clean blocks before it. Training thus sees
  what block-by-block sampling sees (earlier blocks finished), which is what lets a sampler keep
  the finished blocks' keys and values (an exact KV cache). The loss is on the noised copy.
  ``shift`` adds Dream's token shift (Fast-dLLM v2 trains with both), each block's first token
  read from the clean block before it.

``full`` and ``dream`` may anneal from causal to full attention over the first
``anneal_steps`` steps (DiffuLLaMA's attention-mask annealing, :func:`annealed_causal`).

Each recipe answers the objective's questions: which tokens may be masked, what the model reads
(tokens, positions, attention mask), and which output scores which token. An attention pattern
is one ``mask_mod(b, q, kv)`` function, evaluated densely for SDPA or as a FlexAttention
``BlockMask`` (the objective's ``mask_kernel``), as :mod:`.documents` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Callable

import torch
import tyro
from torchtitan.config import Configurable

from .documents import document_block_mask, document_ids, document_mask, evaluate_mask
from .noise import generator
from .sampling_options import Readout

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ANNEAL_STREAM = 15485863
"""Extra seed part of the annealing draw (apart from the noise's)."""


@dataclass(frozen=True)
class Reading:
    """What the model reads for a noised row: its tokens and keyword arguments (attention mask,
    positions); :meth:`Recipe.outputs` finds the row's outputs in what it returns."""

    inputs: torch.Tensor
    kwargs: dict[str, Any]


def annealed_causal(length: int, fraction: float, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """``(L, L)`` bool: the causal triangle plus each key after its query opened with probability
    ``fraction`` (0: causal, 1: full), one draw per query/key pair shared by the rows of a micro-batch
    (DiffuLLaMA's annealing: the share of the upper triangle opened grows linearly with the step)."""
    opened = torch.rand(length, length, generator=gen, device=device) < fraction
    return torch.ones(length, length, dtype=torch.bool, device=device).tril() | opened


class Recipe(Configurable):
    """``full``: bidirectional attention, each output predicts its own position's token."""

    name: str = "full"

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        anneal_steps: int = 0
        """Anneal from causal to full attention over this many steps (0: full from the start).
        At step s each key after its query is opened with probability s / anneal_steps."""

        def per_token(self) -> bool:
            """Whether each token draws its own mask probability (rows are then not complementary)."""
            return False

        def validate(self) -> None:
            if self.anneal_steps < 0:
                raise ValueError(
                    f"objective.recipe.anneal_steps is {self.anneal_steps}; it must be >= 0 (0: no annealing)"
                )

    def __init__(self, config: Config):
        config.validate()
        self.config = config

    @property
    def shift(self) -> bool:
        """The output at i − 1 predicts token i (Dream's token shift)."""
        return False

    @property
    def block_size(self) -> int | None:
        """Blocks of block-wise attention (None: no blocks)."""
        return None

    @property
    def readout(self) -> Readout:
        """What a sampler or scorer of the trained model must know of this recipe."""
        return Readout(shift=self.shift, block_size=self.block_size)

    def describe(self) -> str:
        anneal = f", causal->full over {self.config.anneal_steps} steps" if self.config.anneal_steps else ""
        return f"{self.name}{anneal}"

    def maskable(self, maskable: torch.Tensor) -> torch.Tensor:
        """The tokens that may be masked (and are scored): those with a predictor."""
        if not self.shift:
            return maskable
        out = maskable.clone()
        out[:, 0] = False  # no position before the first predicts it
        return out

    def cost(self) -> float:
        """Model FLOPs per loader token relative to reading the row once."""
        return 1.0

    def token_probability(self, p: torch.Tensor, t: torch.Tensor, length: int) -> torch.Tensor:
        """``(B, 1)`` or ``(B, L)``: each token's mask probability for rows masked with ``p`` at
        noise level ``t`` (the row's probability for every token here)."""
        return p[:, None]

    def reading(
        self, xt: torch.Tensor, x0: torch.Tensor, *, bos: int, documents: bool, flex: bool, step: int | None, seed: int
    ) -> Reading:
        """What the model reads for noised rows ``xt`` of clean rows ``x0`` at training step ``step``
        (None: evaluation, annealing over)."""
        fraction = self._opened(step)
        doc = document_ids(xt, bos) if documents else None
        if fraction >= 1.0:
            if doc is None:
                return Reading(xt, {})
            return Reading(
                xt, {"attention_masks": document_block_mask(doc, False) if flex else document_mask(doc, False)}
            )
        allowed = annealed_causal(xt.shape[1], fraction, generator(xt.device, seed, ANNEAL_STREAM, step), xt.device)

        def mask_mod(b, h, q, kv):
            out = allowed[q, kv]
            return out & (doc[b, q] == doc[b, kv]) if doc is not None else out

        return Reading(
            xt, {"attention_masks": evaluate_mask(mask_mod, xt.shape[0], xt.shape[1], xt.shape[1], xt.device, flex)}
        )

    def _opened(self, step: int | None) -> float:
        """The share of the causal mask's upper triangle open at ``step`` (1: full attention)."""
        steps = self.config.anneal_steps
        return 1.0 if not steps or step is None or step >= steps else max(step, 0) / steps

    def outputs(self, pred: torch.Tensor, length: int) -> torch.Tensor:
        """The model's outputs aligned with the row: ``[:, i]`` predicts token i."""
        return shifted(pred) if self.shift else pred


def shifted(pred: torch.Tensor, first: torch.Tensor | None = None) -> torch.Tensor:
    """A shifted model's outputs aligned with the canvas: ``[:, i]`` ← ``pred[:, i − 1]``, position 0
    ``first`` (the output before the window, where there is one) or its own (never scored)."""
    return torch.cat([pred[:, :1] if first is None else first, pred[:, :-1]], dim=1)


class Dream(Recipe):
    """``dream``: full attention, the output at i − 1 predicts token i."""

    name = "dream"

    @dataclass(kw_only=True, slots=True)
    class Config(Recipe.Config):
        pass

    @property
    def shift(self) -> bool:
        return True


class BlockWise(Recipe):
    """``block``: block-causal attention over the noised row and a clean copy (BD3-LM)."""

    name = "block"

    @dataclass(kw_only=True, slots=True)
    class Config(Recipe.Config):
        block_size: int = 32
        """Tokens per block (Fast-dLLM v2's 32): bidirectional inside, causal across. Must divide
        training.seq_len; the sampler's block length is this."""
        shift: bool = False
        """Also Dream's token shift (Fast-dLLM v2 trains with it)."""
        position_masking: float = 0.0
        """Efficient-DLM's position-dependent masking: 0 off, else λ = exp(−β·block_size) in (0, 1),
        about the ratio of a block's first token's masking weight to its last one's at t → 0 (the
        paper picks λ ≈ 0.1). Token j of a block gets weight w_j = exp(β·(1 − t)·j), so later
        tokens are masked more, as left-to-right sampling leaves them; see
        :meth:`BlockWise.token_probability`."""

        def per_token(self) -> bool:
            return self.position_masking > 0

        def validate(self) -> None:
            if not 0.0 <= self.position_masking < 1.0:
                raise ValueError(
                    f"objective.recipe.position_masking is {self.position_masking}; it must be 0 (off) "
                    "or in (0, 1), e.g. 0.1"
                )
            if self.anneal_steps:
                raise ValueError(
                    "objective.recipe.anneal_steps anneals full attention; the block recipe's "
                    "attention is block-causal from the start: use --objective.recipe full or dream"
                )
            if self.block_size < 1:
                raise ValueError(f"objective.recipe.block_size is {self.block_size}; it must be >= 1")

    @property
    def shift(self) -> bool:
        return self.config.shift

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def describe(self) -> str:
        extras = (
            [f"size {self.block_size}"]
            + (["shifted"] if self.shift else [])
            + ([f"position masking λ={self.config.position_masking:g}"] if self.config.position_masking else [])
        )
        return f"block ({', '.join(extras)})"

    def cost(self) -> float:
        return 2.0  # the noised row and its clean copy

    def token_probability(self, p: torch.Tensor, t: torch.Tensor, length: int) -> torch.Tensor:
        """With ``position_masking`` λ: p_j = min(1, p · B·w_j / Σ_k w_k) for token j of a block of B,
        w_j = exp(β·(1 − t)·j), β = −ln λ / B: the block's expected masked share stays p (but for
        the clipping), later tokens get more of it, the more so the cleaner the row (t → 0), and at
        t = 1 masking is uniform. Efficient-DLM (arXiv 2512.14067) gives w_j(t) = exp(β(1 − t)·j) and
        picks β by λ = exp(−β·B) ≈ 0.1; how it turns weights into probabilities and reweights the
        loss is not public: this normalisation, and the loss weight of each token scaled by p / p_j
        (the objective's), are muloco's."""
        lam = self.config.position_masking
        if not lam:
            return p[:, None]
        block = self.block_size
        beta = -math.log(lam) / block
        j = (torch.arange(length, device=p.device) % block).to(p.dtype)
        w = torch.exp(beta * (1.0 - t)[:, None] * j)
        whole = torch.exp(beta * (1.0 - t)[:, None] * torch.arange(block, device=p.device, dtype=p.dtype))
        return (p[:, None] * block * w / whole.sum(dim=1, keepdim=True)).clamp(max=1.0)

    def reading(self, xt, x0, *, bos, documents, flex, step, seed) -> Reading:
        rows, length = xt.shape
        mask_mod = block_diffusion_mask(
            length,
            self.block_size,
            document_ids(xt, bos) if documents else None,
            document_ids(x0, bos) if documents else None,
        )
        positions = torch.arange(length, device=xt.device).repeat(2)[None]
        mask = evaluate_mask(mask_mod, rows, 2 * length, 2 * length, xt.device, flex)
        return Reading(torch.cat([xt, x0], dim=1), {"attention_masks": mask, "positions": positions})

    def outputs(self, pred: torch.Tensor, length: int) -> torch.Tensor:
        """The noised copy's outputs; with ``shift``, token i is read from position i − 1, and a
        block's first token from the clean copy's last position of the block before (it predicts
        the next token from the finished blocks, as the sampler and its cache read it; Fast-dLLM
        v2's code reads it from the noised copy, which sampling never sees)."""
        noised = pred[:, :length]
        if not self.shift:
            return noised
        out = shifted(noised)
        starts = torch.arange(self.block_size, length, self.block_size, device=pred.device)
        return out.index_copy(1, starts, pred[:, length + starts - 1])


def block_diffusion_mask(
    length: int, block: int, noised_doc: torch.Tensor | None, clean_doc: torch.Tensor | None
) -> MaskMod:
    """BD3-LM's mask over ``[x_t ‖ x_0]`` (2L): a noised block sees itself and the clean blocks
    before it, a clean block itself and the clean blocks before it.

    With documents (ids of the noised and the clean row): inside a noised block, the noised row's
    documents (a masked BOS joins two, as for ``full``); among clean tokens, the clean row's; a
    noised block reads the clean context of the document open where the block starts, the same
    for all its tokens, so the pattern never shows where a masked boundary inside it is."""

    def mask_mod(b, h, q, kv):
        q_clean, kv_clean = q >= length, kv >= length
        q_pos, kv_pos = q - length * q_clean, kv - length * kv_clean
        q_block, kv_block = q_pos // block, kv_pos // block
        own = (q_block == kv_block) & (q_clean == kv_clean)
        context = (q_block > kv_block) & kv_clean & ~q_clean
        clean = (q_block > kv_block) & kv_clean & q_clean
        if noised_doc is None:
            return own | context | clean
        opened = clean_doc[b, (q_block * block - 1).clamp_min(0)]  # the document open at the block's start
        same_clean = clean_doc[b, q_pos] == clean_doc[b, kv_pos]
        own = own & torch.where(q_clean, same_clean, noised_doc[b, q_pos] == noised_doc[b, kv_pos])
        return own | (context & (opened == clean_doc[b, kv_pos])) | (clean & same_clean)

    return mask_mod


def readout_of(objective_config) -> Readout:
    """The readout of a run's objective config (a next-token objective has the default one)."""
    recipe = getattr(objective_config, "recipe", None)
    return recipe.build().readout if recipe is not None else Readout()


RecipeConfig = (
    Annotated[Recipe.Config, tyro.conf.subcommand(Recipe.name)]
    | Annotated[Dream.Config, tyro.conf.subcommand(Dream.name)]
    | Annotated[BlockWise.Config, tyro.conf.subcommand(BlockWise.name)]
)
"""One recipe's config; the command line picks it by name (``--objective.recipe block``)."""
