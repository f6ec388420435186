"""MuLoCo with 2-bit pseudo-gradients and error feedback: the embedded default job.

Each replica quantizes e ← β·e + Δ to 2 bits per element (statistical scheme: per-block
mean and σ-range bins, a centroid table per block; about 2.03 bits per parameter with
the block metadata), keeps e ← e − sent for the next sync, and the outer step is plain SGD
at lr 1 on the average of what was sent: the error-feedback accumulator (β = 0.95) is the
outer momentum, as in SparseLoCo, instead of Nesterov momentum stacked on top of it, which
measured worse (docs/compression.md). Norm weights go dense in fp32. Override with
``--outer.exchange.codec.bits 4``, ``--outer.exchange.strategy reduce_scatter`` (constant
bytes per replica as K grows), ``--outer.exchange.error_feedback.beta``,
``--outer.exchange.error_feedback.no-enabled``, ``--outer.optimizer nesterov``,
``--outer.exchange.skip_pattern``, ``--outer.exchange.bucket_mb``.
"""

from muloco.compress import Quantizer
from muloco.config import load_config
from muloco.outer.optimizer import SGD


def config():
    c = load_config("diloco/muloco")
    c.dump_folder = "./outputs/muloco-2bit"
    c.outer.exchange.codec = Quantizer.Config(bits=2, scheme="statistical")
    c.outer.exchange.error_feedback.enabled = True
    c.outer.exchange.error_feedback.beta = 0.95
    c.outer.exchange.skip_pattern = r"norm\.weight$"
    c.outer.optimizer = SGD.Config(lr=1.0, momentum=0.0)  # the error feedback is the momentum
    return c
