"""Conditional log-likelihood of a continuation, for multiple-choice evaluation.

Masked diffusion (LLaDA's estimator, count-stratified Monte Carlo): for a target of T
tokens after a prompt, each of ``samples`` rows masks exactly l target tokens (never the
prompt) with l = round(k + i·T/b) wrapped into [1, T] for a random offset k per batch of b
rows, and scores Σ_masked CE · T/l. Its mean estimates
Σ_l (1/l)·E_{|S|=l}[Σ_{i∈S} −log p(x_i | x_{¬S}, prompt)], the negative ELBO of the target:
an upper bound on −log p(target | prompt). The mask token's logit is −∞. A causal model
gets the exact chain rule instead. Lower is more likely: pick the choice with the smallest.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .noise import exact_count_masks
from .recipes import shifted
from .sampling_options import Readout


@torch.no_grad()
def diffusion_nll(
    model,
    prompt: list[int],
    target: list[int],
    mask_id: int,
    *,
    samples: int = 128,
    batch: int = 32,
    generator: torch.Generator,
    device: torch.device,
    readout: Readout = Readout(),
) -> float:
    """Estimated negative ELBO (nats) of ``target`` given ``prompt`` (a shifted model's output at
    i − 1 scoring token i)."""
    if readout.block_size:
        raise ValueError(
            "scoring continuations of a block-wise model (--objective.recipe block) is not supported "
            "yet: its bound conditions each block on the clean ones before it; sample it instead"
        )
    if readout.shift and not prompt:
        raise ValueError("a shifted (dream) model scores each token from the one before: give a non-empty prompt")
    T, P = len(target), len(prompt)
    if T == 0:
        return 0.0
    x = torch.tensor([prompt + target], device=device)
    total, done = 0.0, 0
    while done < samples:
        b = min(batch, samples - done)
        k = torch.randint(1, T + 1, (), generator=generator, device=device).item()
        counts = ((k + torch.arange(b, device=device, dtype=torch.float64) * T / b).round().long() - 1) % T + 1
        region = torch.zeros(b, P + T, dtype=torch.bool, device=device)
        region[:, P:] = True
        masked = exact_count_masks(region, counts, generator)
        rows = x.expand(b, -1).masked_fill(masked, mask_id)
        logits = model(rows).float()
        if readout.shift:
            logits = shifted(logits)
        logits[..., mask_id] = -math.inf
        ce = F.cross_entropy(logits[masked], x.expand(b, -1)[masked], reduction="none")
        scale = (T / counts.double())[:, None].expand(masked.shape)[masked]  # T/l of each token's row
        total += (ce.double() * scale).sum().item()
        done += b
    return total / samples


@torch.no_grad()
def autoregressive_nll(model, prompt: list[int], target: list[int], device: torch.device) -> float:
    """Exact −log p(target | prompt) (nats) by the chain rule."""
    if not target:
        return 0.0
    x = torch.tensor([prompt + target], device=device)
    logits = model(x[:, :-1]).float()[0, len(prompt) - 1 :]
    return F.cross_entropy(logits, x[0, len(prompt) :], reduction="sum").item()
