"""Masked diffusion (MDLM / LLaDA): bidirectional attention, 1/t-weighted loss on masked tokens.

Each row gets a noise level t (stratified over the replica group's rows of the
micro-batch, see :mod:`.noise`), each maskable token becomes ``<|mask|>`` with probability p(t), and
the model predicts the original tokens at the masked positions:

    loss = Σ_rows Σ_{i masked} w · CE_i  /  normaliser

with ``weight`` ``elbo`` (w = −α′/(1 − α) = 1/t for the linear schedule: the negative
ELBO), ``uniform`` (w = 1) or ``cart`` (geometric weights of the visible neighbours,
banded), and ``normaliser`` ``tokens`` (the maskable tokens of the step: LLaDA's B·L in
pre-training), ``sequence`` (each row by its own maskable count, then the rows: LLaDA's
SFT) or ``batch`` (the rows). What is maskable comes from the loader: every label that
is not ignored. In pre-training that is every token, BOS and EOS included (LLaDA and MDLM
mask them too), so a model learns where a document ends from its text: a visible BOS right
after a masked EOS would give the answer away. SFT prompts and row padding are ignored.

With ``document_mask`` each token attends only inside its document as the *noised* row
shows it: a visible BOS starts a document, a masked one does not, so two documents whose
boundary is masked see each other and the attention pattern does not reveal where a
document ends (a model that learned "EOS is the last position I can see" would never stop
before the end of a sampling canvas).

The head and the cross-entropy run only at the masked positions (``masked_only_head``):
the model returns hidden states and the loss applies ``lm_head`` to the selected rows,
about half the head's FLOPs and logit memory at mean t = 0.5. The mask token's logit is
−∞, so it is never predicted. On CUDA the positions are gathered into a fixed capacity drawn
from the noise levels (:mod:`.gather`), so a step never waits on the device to count them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import tyro
from torchtitan.components.loss import IGNORE_INDEX

from .gather import MaskedPositions, mask_capacity
from .masked_loss import MaskedCrossEntropyLoss
from .noise import (
    bernoulli_masks,
    cart_weights,
    check_schedule,
    elbo_weight,
    exact_count_masks,
    generator,
    mask_probability,
    noise_levels,
    time_of,
)
from .objective import NoiseKey, Objective, Prepared, SpecialTokens
from .recipes import Recipe, RecipeConfig

WEIGHTS = ("elbo", "uniform", "cart")
NORMALISERS = ("tokens", "sequence", "batch")
TRUNCATE_STREAM = 104729
"""Extra seed part of the truncation draw (one stream per micro-batch, apart from the noise's)."""
EVAL_SEED = 7919
"""Validation noise is seeded by this and the batch index only: the same on every replica and every time."""


class MaskedDiffusion(Objective):
    name = "mdlm"
    causal = False
    next_token = False
    elbo_validation = True
    mask_token = True
    title = "masked diffusion"
    pipeline_tag = "fill-mask"
    hub_tag = "masked-diffusion"

    @dataclass(kw_only=True, slots=True)
    class Config(Objective.Config):
        document_mask: bool = True
        """Packed documents attend only within themselves where the noised row shows their BOS
        (a masked BOS joins two documents, so the pattern never reveals a masked boundary)."""
        eps: float = 1e-3
        """Floor of the noise level: t = eps + (1 − eps)·u, in (0, 1)."""
        schedule: str = "linear"
        """Mask probability p(t): linear (p = t) or cosine (p = cos(π/2·(1 − t)))."""
        weight: str = "elbo"
        """Per-token loss weight: elbo (−α′/(1−α), 1/t for linear), uniform (1) or cart (geometric)."""
        cart_p: float = 0.3
        """CART's geometric parameter (weight: cart)."""
        normaliser: str = "tokens"
        """Divide by the step's maskable tokens (tokens), per row then by rows (sequence), or by rows (batch)."""
        stratified: bool = True
        """Noise levels spread evenly over [eps, 1) across a micro-batch's rows on all data-parallel ranks."""
        complementary_masks: bool = False
        """Also train every row with the complementary mask (m and 1 − m): twice the rows per step."""
        masked_only_head: bool = True
        """Apply the LM head and the cross-entropy only at masked positions."""
        truncate_probability: float = 0.01
        """Probability that a step's rows are cut to a random length (the same on every rank)."""
        eval_samples: int = 8
        """Noise levels per validation batch (stratified, fixed seeds) for the ELBO estimate."""
        seed: int = 0
        """Seed of the masks and noise levels (with replica, step, micro-batch and rank)."""
        recipe: tyro.conf.AvoidSubcommands[RecipeConfig] = field(default_factory=Recipe.Config)
        """full | dream | block: the attention and output alignment (AR-to-diffusion conversion,
        :mod:`muloco.objectives.recipes`); pick with ``--objective.recipe NAME``, then set its own
        settings as ``--objective.recipe.SETTING``."""

        def describe(self) -> str:
            return f"masked diffusion, recipe {self.recipe.build().describe()}"

        def validate(self) -> None:
            super(MaskedDiffusion.Config, self).validate()
            self.recipe.validate()
            if self.recipe.per_token() and self.complementary_masks:
                raise ValueError(
                    "objective.recipe.position_masking draws each token's own probability; "
                    "--objective.complementary-masks pairs rows masked with p and 1 − p: use one"
                )
            if not 0.0 < self.eps < 1.0:
                raise ValueError(f"objective.eps is {self.eps!r}; it must be in (0, 1), e.g. 1e-3.")
            check_schedule(self.schedule, "objective.schedule")
            if self.weight not in WEIGHTS:
                raise ValueError(f"objective.weight must be one of {', '.join(WEIGHTS)}; got {self.weight!r}")
            if self.normaliser not in NORMALISERS:
                raise ValueError(
                    f"objective.normaliser must be one of {', '.join(NORMALISERS)}; got {self.normaliser!r}"
                )
            if not 0.0 < self.cart_p < 1.0:
                raise ValueError(f"objective.cart_p is {self.cart_p!r}; it must be in (0, 1).")
            if not 0.0 <= self.truncate_probability <= 1.0:
                raise ValueError(
                    f"objective.truncate_probability is {self.truncate_probability!r}; it must be in [0, 1]."
                )
            if self.eval_samples < 1:
                raise ValueError(f"objective.eval_samples is {self.eval_samples}; it must be >= 1.")

    def __init__(self, config: Config, *, tokens: SpecialTokens, rows_per_step: int = 1):
        super().__init__(config, tokens=tokens, rows_per_step=rows_per_step)
        if tokens.mask is None or tokens.mask in (tokens.bos, tokens.eos):
            raise ValueError(
                "the tokenizer has no mask token distinct from bos/eos, which the mdlm objective "
                "needs; use a tokenizer with <|mask|> (muloco adds one to tokenizer.json files) "
                "or --objective ar."
            )
        self.recipe: Recipe = config.recipe.build()

    scoring: MaskedCrossEntropyLoss = MaskedCrossEntropyLoss.Config().build()
    """The weighted cross-entropy of the gathered logits (eager here); the trainer's compile
    setting compiles it as torchtitan compiles its own loss (:meth:`use_loss`)."""

    def use_loss(self, loss_fn, compile_config=None) -> None:
        self.scoring = MaskedCrossEntropyLoss.Config().build(compile_config=compile_config)

    @property
    def skip_lm_head(self) -> bool:
        return self.config.masked_only_head

    def expected_mask_fraction(self) -> float:
        """E[p(t)] over t = ε + (1 − ε)·u, u ~ U[0, 1): the share of maskable tokens masked."""
        u = (torch.arange(4096, dtype=torch.float64) + 0.5) / 4096
        return float(mask_probability(self.config.eps + (1 - self.config.eps) * u, self.config.schedule).mean())

    def flops_per_token(self, model_flops: float, head_params: int) -> float:
        """The head runs only at masked positions (about half of them for the linear schedule),
        and complementary masks run every row twice."""
        flops = model_flops * self.recipe.cost()
        if self.config.masked_only_head:
            flops -= 6 * head_params * (self.recipe.cost() - self.expected_mask_fraction())
        return flops * (2 if self.config.complementary_masks else 1)

    # ------------------------------------------------------------------ training

    def truncate(self, inputs: torch.Tensor, labels: torch.Tensor, key: NoiseKey):
        """With probability ``truncate_probability`` the micro-batch's rows cut to a random length
        (LLaDA's 1% of steps), drawn from (seed, replica, step, micro-batch): the same cut on every
        rank. The trainer cuts batches as they are fetched, before torchtitan counts the step's
        valid tokens, so a cut step is normalised by the tokens that remain."""
        c = self.config
        if not c.truncate_probability:
            return inputs, labels
        cut = generator(torch.device("cpu"), c.seed, key.replica, key.step, key.micro, TRUNCATE_STREAM)
        if torch.rand((), generator=cut).item() >= c.truncate_probability:
            return inputs, labels
        length = int(torch.randint(1, inputs.shape[1] + 1, (), generator=cut))
        return inputs[:, :length], labels[:, :length]

    def prepare(self, inputs: torch.Tensor, labels: torch.Tensor, key: NoiseKey) -> Prepared:
        c, device = self.config, inputs.device
        shared = generator(torch.device("cpu"), c.seed, key.replica, key.step, key.micro)
        own = generator(device, c.seed, key.replica, key.step, key.micro, key.rank + 1)
        x0, maskable = inputs, self.recipe.maskable(labels != IGNORE_INDEX)
        rows = x0.shape[0]
        u0 = torch.rand((), generator=shared).item()
        t = noise_levels(
            key.rank * rows, rows, rows * key.world, c.eps, u0, own, stratified=c.stratified, device=device
        )
        p = mask_probability(t, c.schedule)
        probs = self.recipe.token_probability(p, t, x0.shape[1])
        masked = bernoulli_masks(maskable, probs, own)
        if c.complementary_masks:
            x0, maskable = torch.cat([x0, x0]), torch.cat([maskable, maskable])
            masked = torch.cat([masked, maskable[rows:] & ~masked])
            p = torch.cat([p, 1.0 - p])
            t = torch.cat([t, time_of(p[rows:], c.schedule).clamp_min(c.eps)])
        weight = self._token_weights(masked, maskable, t)
        if probs.shape[1] > 1:  # each token's own probability: its weight scaled by p / p_j
            weight = weight * (p[:, None] / probs)
        xt = x0.masked_fill(masked, self.tokens.mask)
        positions = MaskedPositions.of(masked, self._capacity(key, rows, x0.shape[1], u0))
        reading = self._reading(xt, x0, key.step)
        return Prepared(
            reading.inputs, x0, reading.kwargs, {"masked": masked, "weight": weight, "t": t, "positions": positions}
        )

    def _reading(self, xt: torch.Tensor, x0: torch.Tensor, step: int | None):
        """What the model reads for noised rows ``xt`` (the recipe's tokens, positions and mask)."""
        return self.recipe.reading(
            xt,
            x0,
            bos=self.tokens.bos,
            documents=self.config.document_mask,
            flex=self._flex(xt.device),
            step=step,
            seed=self.config.seed,
        )

    def _capacity(self, key: NoiseKey, rows: int, length: int, u0: float) -> int:
        """How many masked positions the loss gathers (:mod:`.gather`), from host values only: the
        largest mask probabilities this rank's rows can get at any offset u₀ (the same every step),
        all rows with complementary masks (together they mask each maskable token once)."""
        c = self.config
        if c.complementary_masks or not c.stratified:
            return rows * length
        t = noise_levels(
            key.rank * rows + 1, rows, rows * key.world, c.eps, 0.0, None, stratified=True, device=torch.device("cpu")
        )
        return mask_capacity(mask_probability(t.double(), c.schedule), length)

    def _token_weights(self, masked: torch.Tensor, maskable: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``(B, L)`` float32: each masked token's weight with the row part of the normaliser folded in."""
        c = self.config
        if c.weight == "elbo":
            w = elbo_weight(t, c.schedule)[:, None].expand(masked.shape)
        elif c.weight == "cart":
            w = cart_weights(masked, c.cart_p)
        else:
            w = torch.ones(masked.shape, device=masked.device)
        if c.normaliser == "sequence":
            w = w / maskable.sum(dim=1, keepdim=True).clamp_min(1)
        if c.normaliser != "tokens":
            w = w / self.rows_per_step
        if c.complementary_masks:
            w = w * 0.5  # the two halves are two estimates of the same loss
        return w

    def loss_inputs(self, batch: Prepared) -> dict[str, torch.Tensor]:
        """The gather's positions and the weights: the noise is drawn in :meth:`prepare`."""
        at: MaskedPositions = batch.extra["positions"]
        out = {"index": at.index, "weight": batch.extra["weight"]}
        return out if at.valid is None else {**out, "valid": at.valid}

    def batch_from(self, inputs, labels, model_kwargs, loss_inputs) -> Prepared:
        positions = MaskedPositions(loss_inputs["index"], loss_inputs.get("valid"))
        return Prepared(inputs, labels, model_kwargs, {"positions": positions, "weight": loss_inputs["weight"]})

    def loss(self, pred: torch.Tensor, batch: Prepared, global_valid_tokens=None) -> torch.Tensor:
        at: MaskedPositions = batch.extra["positions"]
        picked = at.take(self.recipe.outputs(pred, batch.labels.shape[1]))
        normaliser = global_valid_tokens if self.config.normaliser == "tokens" else None
        return self.scoring(
            self.lm_head(picked) if self.skip_lm_head else picked,
            at.take(batch.labels),
            normaliser,
            weights=at.weights(batch.extra["weight"]),
            mask_id=self.tokens.mask,
        )[0]

    def logits_at(self, pred: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """float32 logits at the ``where`` positions (a boolean mask), the mask token's set to −∞."""
        return self._logits(pred[where])

    def _logits(self, picked: torch.Tensor) -> torch.Tensor:
        """float32 logits of gathered rows (hidden states where the objective applies the head)."""
        if self.skip_lm_head:
            picked = self.lm_head(picked)
        logits = picked.float()  # a new tensor or the head's output: neither is saved for backward
        logits[:, self.tokens.mask] = -math.inf
        return logits

    # ---------------------------------------------------------------- evaluation

    def _units(self, maskable: torch.Tensor) -> torch.Tensor:
        """``(U, W)``: the rows whose tokens a bound masks together (the rows, or a block-wise
        recipe's blocks, the last one padded with unmaskable positions)."""
        block = self.recipe.block_size
        if block is None:
            return maskable
        padded = F.pad(maskable, (0, -maskable.shape[1] % block), value=False)
        return padded.reshape(-1, block)

    @staticmethod
    def _rows(units: torch.Tensor, rows: int, length: int) -> torch.Tensor:
        """A ``(U, W)`` grid of :meth:`_units` back as ``(rows, length)``."""
        return units.reshape(rows, -1)[:, :length]

    @torch.no_grad()
    def elbo_terms(self, model, x0: torch.Tensor, labels: torch.Tensor, batch_index: int) -> torch.Tensor:
        """float64 ``[Σ nelbo, targets, correct, masked]`` of one batch, ``eval_samples`` masks per row.

        The negative ELBO of a row with n targets is Σ_{l=1..n} (1/l)·E_{|S|=l}[Σ_{i∈S} CE_i(x with
        S masked)]: the continuous-time ∫₀¹ w(t)·E[Σ_masked CE] dt for any schedule, the whole
        of [0, 1) (a t floored at ε leaves out about ε × a one-token loss per token and is no
        bound). Each row draws its mask counts l = ⌈u·n⌉ with stratified u = (u₀ + k)/S, masks
        exactly l targets uniformly (LLaDA's ``get_log_likelihood``) and scores (n/l)·Σ_masked CE:
        an unbiased estimate, so Σ nelbo / targets bounds the NLL per token (in nats) in expectation.
        A block-wise model's bound is the sum of its blocks' (each given the clean blocks before it,
        as it samples): each block draws its own count.
        """
        device = x0.device
        own = generator(device, EVAL_SEED, self.config.seed, batch_index)
        rows, length = x0.shape
        units = self._units(self.recipe.maskable(labels != IGNORE_INDEX))
        n = units.sum(dim=1)
        S = self.config.eval_samples
        u0 = torch.rand(units.shape[0], generator=own, device=device, dtype=torch.float64)
        out = torch.zeros(4, dtype=torch.float64, device=device)
        for k in range(S):
            counts = torch.minimum(torch.ceil((u0 + k) / S * n).long().clamp_min(1), n)
            masked = self._rows(exact_count_masks(units, counts, own), rows, length)
            xt = x0.masked_fill(masked, self.tokens.mask)
            reading = self._reading(xt, x0, None)
            logits = self.logits_at(self.recipe.outputs(model(reading.inputs, **reading.kwargs), length), masked)
            targets = x0[masked]
            ce = F.cross_entropy(logits, targets, reduction="none").double()
            scale = self._rows((n / counts.clamp_min(1)).double()[:, None].expand(units.shape), rows, length)[masked]
            out[0] += (ce * scale).sum() / S
            out[2] += (logits.argmax(dim=-1) == targets).sum()
            out[3] += targets.numel()
        out[1] = n.sum()
        return out
