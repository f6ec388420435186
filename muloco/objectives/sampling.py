"""Sampling: iterative unmasking for masked-diffusion models, token by token for causal ones.

Diffusion (LLaDA's procedure): the canvas is the prompt followed by ``length`` mask
tokens, cut into blocks of ``block_length`` filled left to right (semi-autoregressive;
one block = fully parallel). Each block gets ``steps / blocks`` steps; at each step the
model predicts every masked position, and the ``k`` most confident predictions inside
the current block are kept (``k``: the block's masked count split evenly over its steps,
the remainder to the first ones). Confidence is the predicted token's probability
(``confidence``), the gap between the two most likely tokens (``margin``), the negative
entropy (``entropy``) or a random order (``random``). With temperature > 0 the tokens are
drawn by Gumbel-max in float64 (float32 Gumbel noise biases samples towards likely
tokens, arXiv 2409.02908). The mask token is never predicted. Everything is drawn from
one seeded generator, so a seed gives the same text.

``threshold`` (Fast-dLLM's parallel decoding) replaces the fixed schedule: at each step every
masked position of the block whose predicted token has at least that probability is filled
(the most confident one at least), so a block takes as few steps as the model is sure enough
for. Several prompts of different lengths sample together (:func:`sample_diffusion_batch`):
each canvas is left-padded to the longest prompt, and the padding is masked out of attention
(keys) so a prompt's greedy text is the one it gets alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch

from muloco.models.attention import BlockKV, PrefixKV, kv_cache
from muloco.objectives.recipes import shifted
from muloco.objectives.sampling_options import CACHES, ORDERS, Readout  # the sampler's names, also without torch


@dataclass(frozen=True)
class DiffusionSampling:
    length: int = 64
    """Tokens to generate after the prompt."""
    steps: int = 64
    """Denoising steps in all (a multiple of the number of blocks)."""
    block_length: int = 64
    """Semi-autoregressive block size (``length`` must be a multiple of it)."""
    temperature: float = 0.0
    order: str = "confidence"
    threshold: float | None = None
    """Fill every masked position of the block with a confidence of at least this (at least one
    per step) instead of the fixed schedule; None: the schedule (LLaDA)."""
    cache: str = "none"
    """prefix: Fast-dLLM's block-wise prefix cache (the finished part of the canvas runs once per
    block, not at every step); dual: its dual cache (the masked blocks after the block too, so a
    step runs the block alone); block: the exact key/value cache of a block-wise model's finished
    blocks (:func:`sample_block_diffusion`); none: every step runs the whole canvas."""

    def check_block_model(self, block_size: int) -> None:
        """The settings for a block-wise model of ``block_size``: its blocks are the sampler's."""
        if self.block_length != block_size:
            raise ValueError(
                f"--block-length {self.block_length}: this model was trained with blocks of {block_size} "
                f"(--objective.recipe.block_size); sample with --block-length {block_size} or leave it out"
            )
        if self.cache not in ("none", "block"):
            raise ValueError(
                f"--cache {self.cache}: a block-wise model keeps its finished blocks exactly with --cache "
                "block (the default for it); none runs the whole canvas at every step"
            )
        # any length: the blocks are the model's, from position 0, the last one as long as the canvas
        whole = -(-self.length // block_size) * block_size
        DiffusionSampling.check(
            dataclasses.replace(self, cache="none", length=whole, steps=max(self.steps, whole // block_size))
        )

    def check(self) -> None:
        if self.length < 1 or self.block_length < 1 or self.length % self.block_length:
            raise ValueError(
                f"--length {self.length} must be a positive multiple of --block-length {self.block_length}"
            )
        blocks = self.length // self.block_length
        if self.steps < blocks or self.steps % blocks:
            raise ValueError(
                f"--steps {self.steps} must be a positive multiple of the number of blocks "
                f"({blocks} = length / block length)"
            )
        if self.order not in ORDERS:
            raise ValueError(f"--order must be one of {', '.join(ORDERS)}; got {self.order!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be a finite number >= 0; got {self.temperature}")
        if self.cache not in CACHES:
            raise ValueError(f"--cache must be one of {', '.join(CACHES)}; got {self.cache!r}")
        if self.cache == "block":
            raise ValueError(
                "--cache block keeps the finished blocks of a block-wise model (one trained with "
                "--objective.recipe block); this model attends over the whole canvas: use --cache "
                "none, prefix or dual"
            )
        if self.threshold is not None:
            if not 0.0 < self.threshold <= 1.0:
                raise ValueError(f"--threshold must be in (0, 1] (a probability); got {self.threshold}")
            if self.order != "confidence":
                raise ValueError(
                    f"--threshold compares the predicted token's probability: use it with "
                    f"--order confidence, not {self.order}"
                )


def transfer_counts(masked: int, steps: int) -> list[int]:
    """How many tokens to unmask at each of ``steps`` steps: even split, remainder first."""
    base, extra = divmod(masked, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1)
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64, device=logits.device)
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    return (logits.double() / temperature + gumbel).argmax(dim=-1)


def _confidence(logits: torch.Tensor, chosen: torch.Tensor, order: str, generator: torch.Generator):
    if order == "random":
        return torch.rand(chosen.shape, generator=generator, dtype=torch.float64, device=chosen.device)
    probs = torch.softmax(logits.double(), dim=-1)
    if order == "confidence":
        return probs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    if order == "margin":
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    return (probs * torch.log(probs.clamp_min(1e-300))).sum(-1)  # entropy: −H, higher is surer


@torch.no_grad()
def sample_diffusion(
    model, prompt: list[int], mask_id: int, how: DiffusionSampling, generator: torch.Generator, device: torch.device
) -> list[int]:
    """The generated tokens (no mask token left) after ``prompt``."""
    return sample_diffusion_batch(model, [prompt], mask_id, how, generator, device)[0]


def _left_padded(prompts: list[list[int]], mask_id: int, length: int, device: torch.device):
    """Canvases ``[pad …] prompt [mask × length]`` and, when some are padded, the SDPA mask that
    keeps the padding out of every token's attention (a pad token attends to itself only)."""
    width = max(len(p) for p in prompts)
    pad = torch.tensor([width - len(p) for p in prompts], device=device)
    rows = [[mask_id] * (width - len(p)) + p + [mask_id] * length for p in prompts]
    x = torch.tensor(rows, device=device)
    if not pad.any():
        return x, width, {}
    real = torch.arange(x.shape[1], device=device)[None, :] >= pad[:, None]
    attend = real[:, None, None, :] | torch.eye(x.shape[1], dtype=torch.bool, device=device)
    return x, width, {"attention_masks": attend}


def _chosen_positions(confidence: torch.Tensor, open_: torch.Tensor, k: int, threshold: float | None):
    """``(B, L)`` bool: the positions to fill this step, per row."""
    confidence = confidence.masked_fill(~open_, -math.inf)
    if threshold is None:
        k = min(k, int(open_.sum(dim=1).max()))
        top = confidence.topk(k, dim=-1).indices if k else confidence[:, :0].long()
        picked = torch.zeros_like(open_).scatter_(1, top, True)
    else:
        best = confidence.argmax(dim=-1, keepdim=True)
        picked = (confidence >= threshold) | torch.zeros_like(open_).scatter_(1, best, True)
    return picked & open_


@torch.no_grad()
def sample_diffusion_batch(
    model,
    prompts: list[list[int]],
    mask_id: int,
    how: DiffusionSampling,
    generator: torch.Generator,
    device: torch.device,
    *,
    shift: bool = False,
) -> list[list[int]]:
    """The generated tokens after each prompt, sampled together (see the module docstring).
    ``shift``: the model's output at i − 1 predicts token i (a ``dream`` model)."""
    how.check()
    if shift and not all(prompts):
        raise ValueError(
            "a shifted (dream) model predicts each token from the one before: give a non-empty prompt "
            "(muloco's generate adds BOS)"
        )
    x, start, kwargs = _left_padded(prompts, mask_id, how.length, device)
    with kv_cache(model) if how.cache != "none" else contextlib.nullcontext() as cache:
        for block_start in range(start, start + how.length, how.block_length):
            x = _fill_block(model, x, block_start, mask_id, how, generator, kwargs, cache, shift)
    return [row[start:].tolist() for row in x]


def _fill_block(
    model,
    x: torch.Tensor,
    block_start: int,
    mask_id: int,
    how: DiffusionSampling,
    generator: torch.Generator,
    kwargs: dict,
    cache: PrefixKV | None,
    shift: bool = False,
) -> torch.Tensor:
    """The canvas with the block at ``block_start`` filled: the schedule's steps (LLaDA's, zero-count
    steps included) or, with a threshold, as many as the block needs (at least one position per
    row each). With a prefix cache the block's first step runs the whole canvas and keeps the
    prefix's keys and values; its other steps run the canvas from the block on (the dual cache
    keeps the suffix's too, and the other steps run the block alone).

    Only the block's positions can be filled, so a greedy step (no random draw) applies the LM
    head and the softmax to the block alone; with random draws every logit of the canvas is
    drawn for, as LLaDA draws, so a seed gives LLaDA's trajectory. A shifted model's block is
    predicted by the outputs one position earlier, so with a cache the kept prefix ends one
    position before the block."""
    block = slice(block_start, block_start + how.block_length)
    counts = (
        transfer_counts(how.block_length, how.steps // (how.length // how.block_length))
        if how.threshold is None
        else [0] * how.block_length
    )
    greedy = how.temperature == 0 and how.order != "random"
    for step, k in enumerate(counts):
        open_ = x[:, block] == mask_id
        if how.threshold is not None and not open_.any():
            break
        kept = block_start - 1 if shift else block_start
        first = 0 if cache is None or step == 0 else kept
        last = block.stop if how.cache == "dual" and step > 0 else x.shape[1]
        if cache is not None:
            cache.prefix, cache.recording = kept, step == 0
            cache.suffix = block.stop if how.cache == "dual" else None
        within = slice(block_start - first, block.stop - first)
        read = slice(within.start - 1, within.stop - 1) if shift else within  # the outputs that predict the block
        logits = _logits(model, x, first, mask_id, kwargs, read if greedy else None, last)
        if shift and not greedy:
            logits = shifted(logits)
        chosen = _pick(logits, how.temperature, generator)
        confidence = _confidence(logits, chosen, how.order, generator)
        if not greedy:
            chosen, confidence = chosen[:, within], confidence[:, within]
        x[:, block] = torch.where(_chosen_positions(confidence, open_, k, how.threshold), chosen, x[:, block])
    return x


def _logits(
    model,
    x: torch.Tensor,
    first: int,
    mask_id: int,
    kwargs: dict,
    columns: slice | None = None,
    last: int | None = None,
) -> torch.Tensor:
    """float32 logits (the mask token's −∞) of the canvas from position ``first`` up to ``last``,
    run at their own positions (with a block cache, the kept parts stand in for the rest);
    ``columns`` of those only: the LM head runs on them alone."""
    last = x.shape[1] if last is None else last
    if first or last < x.shape[1]:
        positions = torch.arange(first, last, device=x.device).expand(x.shape[0], -1)
        kwargs = {**kwargs, "positions": positions}
        if "attention_masks" in kwargs:
            kwargs["attention_masks"] = kwargs["attention_masks"][:, :, first:last]
    head = getattr(model, "lm_head", None) if columns is not None else None
    if head is None:
        logits = model(x[:, first:last], **kwargs)[:, columns or slice(None)].float()
    else:
        skip, model._skip_lm_head = model._skip_lm_head, True
        try:
            logits = head(model(x[:, first:last], **kwargs)[:, columns]).float()
        finally:
            model._skip_lm_head = skip
    logits[..., mask_id] = -math.inf
    return logits


def sampling_for(how: DiffusionSampling, readout: Readout, block_length: int | None, cache: str | None):
    """``how`` with the block length and cache a model of ``readout`` samples with by default
    (a block-wise model: its block size and its exact cache), the user's where given."""
    default_block = readout.block_size or how.length
    return dataclasses.replace(
        how, block_length=block_length or default_block, cache=cache or ("block" if readout.block_size else "none")
    )


def sample_model(
    model,
    prompts: list[list[int]],
    mask_id: int,
    how: DiffusionSampling,
    generator: torch.Generator,
    device: torch.device,
    readout: Readout = Readout(),
) -> list[list[int]]:
    """The generated tokens after each prompt, by the sampler ``readout`` calls for."""
    if readout.block_size:
        return sample_block_diffusion(
            model, prompts, mask_id, how, generator, device, block_size=readout.block_size, shift=readout.shift
        )
    return sample_diffusion_batch(model, prompts, mask_id, how, generator, device, shift=readout.shift)


@torch.no_grad()
def sample_block_diffusion(
    model,
    prompts: list[list[int]],
    mask_id: int,
    how: DiffusionSampling,
    generator: torch.Generator,
    device: torch.device,
    *,
    block_size: int,
    shift: bool = False,
) -> list[list[int]]:
    """The generated tokens after each prompt from a block-wise model (``--objective.recipe block``),
    block by block as it was trained: blocks of ``block_size`` from position 0 (the prompt's last
    block is the first one sampled, its prompt tokens visible; any length, the last block cut at
    the canvas's end), each block denoised in ``steps`` / (blocks sampled) steps, at least one (or
    by ``threshold``), while it attends to itself and to the finished blocks before it, which are
    clean. With ``cache block`` the finished blocks' keys and
    values are computed once (a clean pass when a block is finished) and a step runs the block
    alone; with ``cache none`` every step runs the whole canvas under the block-causal mask, the
    same function (the test checks they give the same text). Prompts are sampled one by one."""
    how.check_block_model(block_size)
    return [_sample_blocks(model, prompt, mask_id, how, generator, device, block_size, shift) for prompt in prompts]


def _sample_blocks(
    model,
    prompt: list[int],
    mask_id: int,
    how: DiffusionSampling,
    generator: torch.Generator,
    device: torch.device,
    block: int,
    shift: bool,
) -> list[int]:
    if not prompt:
        raise ValueError(
            "block-wise sampling conditions each block on the ones before: give a non-empty prompt "
            "(muloco's generate adds BOS)"
        )
    x = torch.tensor([prompt + [mask_id] * how.length], device=device)
    total, first = x.shape[1], len(prompt) // block * block
    steps = max(1, how.steps // -(-(total - first) // block))  # the steps spread over the blocks sampled
    cache = BlockKV() if how.cache == "block" else None
    with kv_cache(model, cache) if cache is not None else contextlib.nullcontext():
        carry = _clean_pass(model, x, 0, first, cache, block) if cache is not None and first else None
        for start in range(first, total, block):
            stop = min(start + block, total)
            open_ = x[:, start:stop] == mask_id
            counts = transfer_counts(int(open_.sum()), steps) if how.threshold is None else [0] * (stop - start)
            for k in counts:
                open_ = x[:, start:stop] == mask_id
                if not open_.any():
                    break
                logits = _block_logits(model, x, start, stop, mask_id, cache, carry, block, shift)
                chosen = _pick(logits, how.temperature, generator)
                confidence = _confidence(logits, chosen, how.order, generator)
                picked = _chosen_positions(confidence, open_, k, how.threshold)
                x[:, start:stop] = torch.where(picked, chosen, x[:, start:stop])
            if cache is not None:
                carry = _clean_pass(model, x, start, stop, cache, block)
    return x[0, len(prompt) :].tolist()


def _block_causal(length: int, block: int, device: torch.device) -> torch.Tensor:
    """``(1, 1, L, L)`` bool: a query attends to its own block and the blocks before it."""
    blocks = torch.arange(length, device=device) // block
    return (blocks[:, None] >= blocks[None, :])[None, None]


def _clean_pass(model, x: torch.Tensor, start: int, stop: int, cache: BlockKV, block: int) -> torch.Tensor:
    """Run the finished positions ``[start, stop)`` (whole blocks, or the last one) over the cache,
    adding their keys and values to it; their last output (what predicts the next position of a
    shifted model)."""
    cache.append = True
    try:
        kwargs = {"positions": torch.arange(start, stop, device=x.device)[None]}
        if stop - start > block:  # several blocks at once (the prompt's): block-causal among them
            kwargs["attention_masks"] = _block_causal(stop - start, block, x.device)
        return model(x[:, start:stop], **kwargs)[:, -1:].float()
    finally:
        cache.append = False


def _block_logits(
    model,
    x: torch.Tensor,
    start: int,
    stop: int,
    mask_id: int,
    cache: BlockKV | None,
    carry: torch.Tensor | None,
    block: int,
    shift: bool,
) -> torch.Tensor:
    """float32 logits predicting positions ``[start, stop)`` (the mask token's −∞)."""
    if cache is None:
        out = model(x, attention_masks=_block_causal(x.shape[1], block, x.device)).float()
        if shift:  # position 0 (the prompt's) keeps its own output: it is never predicted
            out = shifted(out)
        out = out[:, start:stop]
    else:
        out = model(x[:, start:stop], positions=torch.arange(start, stop, device=x.device)[None]).float()
        if shift:  # position start is predicted by the finished block's last output
            out = shifted(out, carry)
    out[..., mask_id] = -math.inf
    return out


@torch.no_grad()
def sample_autoregressive(
    model,
    prompt: list[int],
    eos_id: int,
    length: int,
    temperature: float,
    generator: torch.Generator,
    device: torch.device,
) -> list[int]:
    """Up to ``length`` next tokens, stopping after EOS."""
    x = torch.tensor([prompt], device=device)
    out: list[int] = []
    for _ in range(length):
        logits = model(x)[0, -1].float()
        token = int(_pick(logits[None], temperature, generator)[0])
        out.append(token)
        if token == eos_id:
            break
        x = torch.cat([x, torch.tensor([[token]], device=device)], dim=1)
    return out


def until_eos(tokens: list[int], eos_id: int) -> list[int]:
    """The tokens before the first EOS (a diffusion sample pads its end with EOS)."""
    return tokens[: tokens.index(eos_id)] if eos_id in tokens else tokens
