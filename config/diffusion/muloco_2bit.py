"""Masked diffusion trained with MuLoCo and 2-bit pseudo-gradients with error feedback, K=2.

The embedded diffusion job (``jobs/local/diffusion.sh``): the same steps, data and model as
``diffusion/ddp_adamw``, so the two compare side by side; validation on θ_g at every sync
boundary reports the negative ELBO per token and its perplexity bound.
"""

from muloco.config import load_config
from muloco.objectives import MaskedDiffusion


def config():
    c = load_config("diloco/muloco_2bit")
    c.dump_folder = "./outputs/diffusion-muloco-2bit"
    c.objective = MaskedDiffusion.Config()
    return c
