"""DiLoCo (AdamW inside the groups) with 2-bit pseudo-gradients and error feedback, to
compare with ``diloco/muloco_2bit`` under the same compression and outer step."""

from muloco.config import load_config


def config():
    c = load_config("diloco/diloco")
    c.dump_folder = "./outputs/diloco-2bit"
    compressed = load_config("diloco/muloco_2bit").outer
    c.outer.exchange = compressed.exchange
    c.outer.optimizer = compressed.optimizer  # plain SGD: the error feedback is the momentum
    return c
