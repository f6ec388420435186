"""Masked diffusion, one replica group with Muon for the hidden matrices (AdamW for the rest)."""

from muloco.config import load_config


def config():
    c = load_config("diffusion/ddp_adamw")
    c.dump_folder = "./outputs/diffusion-ddp-muon"
    c.optimizer = load_config("ddp/muon").optimizer
    return c
