"""Streaming MuLoCo: Muon inner, 3 fragments synced in turn, τ=2, α=0.5."""

from muloco.config import load_config


def config():
    c = load_config("diloco/diloco_streaming")
    c.dump_folder = "./outputs/muloco-streaming"
    c.optimizer = load_config("diloco/muloco").optimizer
    return c
