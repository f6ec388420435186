"""MuLoCo: DiLoCo with Muon as the inner optimizer (AdamW for embeddings, head and norms)."""

from muloco.config import load_config


def config():
    c = load_config("diloco/diloco")
    c.dump_folder = "./outputs/muloco"
    muon = load_config("ddp/muon").optimizer
    c.optimizer = muon
    c.outer.optimizer.lr = 0.7
    c.outer.optimizer.momentum = 0.9
    return c
