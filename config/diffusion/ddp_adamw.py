"""Masked diffusion (MDLM/LLaDA objective), one replica group with AdamW: the diffusion baseline.

``--objective mdlm`` makes attention bidirectional, masks each row's tokens at a stratified
noise level and trains on the 1/t-weighted cross-entropy of the masked tokens; validation
reports the negative ELBO per token (its exp is a perplexity bound) and the masked-token
accuracy. Sample from the result with ``python -m muloco.generate --checkpoint <dump folder>``.
Overrides: ``--objective.schedule cosine``, ``--objective.weight uniform|cart``,
``--objective.normaliser sequence|batch``, ``--objective.no-document-mask``,
``--objective.complementary-masks``, ``--objective.eval-samples``.
"""

from muloco.config import load_config
from muloco.objectives import MaskedDiffusion


def config():
    c = load_config("ddp/adamw")
    c.dump_folder = "./outputs/diffusion-ddp-adamw"
    c.objective = MaskedDiffusion.Config()
    c.training.steps = 300
    c.checkpoint.interval = 150
    c.validator.freq = 90
    return c
