"""MuLoCo with 4-bit pseudo-gradients and error feedback (near lossless in MuLoCo's study)."""

from muloco.config import load_config


def config():
    c = load_config("diloco/muloco_2bit")
    c.dump_folder = "./outputs/muloco-4bit"
    c.outer.exchange.codec.bits = 4
    return c
