"""Single replica group with Muon for the hidden matrices and AdamW for the rest."""

from muloco.config import load_config


def config():
    c = load_config("ddp/adamw")
    c.dump_folder = "./outputs/ddp-muon"
    c.optimizer.name = "Muon"
    c.optimizer.lr = 0.02  # Muon's lr; the AdamW groups use lr x their factor
    c.optimizer.embedding_lr_factor = 0.15
    c.optimizer.head_lr_factor = 0.15
    c.optimizer.scalar_lr_factor = 0.15
    c.optimizer.weight_decay = 0.0
    return c
