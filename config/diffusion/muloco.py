"""Masked diffusion trained with MuLoCo: K replica groups, Muon inside, Nesterov outer step."""

from muloco.config import load_config
from muloco.objectives import MaskedDiffusion


def config():
    c = load_config("diloco/muloco")
    c.dump_folder = "./outputs/diffusion-muloco"
    c.objective = MaskedDiffusion.Config()
    return c
