"""Masked diffusion trained with MuLoCo: K replica groups, Muon inside, Nesterov outer step.

The outer learning rate is 0.5, not MuLoCo's 0.7: tuned for ``mdlm`` at small scale
(``jobs/sweeps/diffusion_outer.py``: outer lr 0.3-1.0 x H 15/30/60, K=2, the tiny CPU shape,
300 steps per group). 0.5 at H=30 gave the lowest final θ_g NELBO, 6.122 against 6.246 at 0.7
(-2.0%), and 0.5 beat 0.7 at every H; 0.3 was worse again (6.129). Numbers and caveats:
RUNNING_JOBS.md, "Masked-diffusion models".
"""

from muloco.config import load_config
from muloco.objectives import MaskedDiffusion


def config():
    c = load_config("diloco/muloco")
    c.dump_folder = "./outputs/diffusion-muloco"
    c.objective = MaskedDiffusion.Config()
    c.outer.optimizer.lr = 0.5
    return c
