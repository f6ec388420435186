"""DiLoCo (AdamW inside the groups) with 2-bit pseudo-gradients and error feedback, to
compare with ``diloco/muloco_2bit`` under the same compression."""

from muloco.config import load_config


def config():
    c = load_config("diloco/diloco")
    c.dump_folder = "./outputs/diloco-2bit"
    c.outer.exchange = load_config("diloco/muloco_2bit").outer.exchange
    return c
