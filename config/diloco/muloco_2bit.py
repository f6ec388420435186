"""MuLoCo with 2-bit pseudo-gradients and error feedback: the embedded default job.

Each replica quantizes e ← β·e + Δ to 2 bits per element (statistical scheme: per-block
mean and σ-range bins, a centroid table per block; about 2.03 bits per parameter with
the block metadata) and keeps what quantization dropped for the next sync. Norm weights
go dense in fp32. Override with ``--outer.exchange.codec.bits 4``, ``--outer.exchange.strategy
reduce_scatter`` (constant bytes per replica as K grows), ``--outer.exchange.error_feedback.beta``,
``--outer.exchange.error_feedback.no-enabled``, ``--outer.exchange.skip_pattern``,
``--outer.exchange.bucket_mb``.
"""

from muloco.compress import Quantizer
from muloco.config import load_config


def config():
    c = load_config("diloco/muloco")
    c.dump_folder = "./outputs/muloco-2bit"
    c.outer.exchange.codec = Quantizer.Config(bits=2, scheme="statistical")
    c.outer.exchange.error_feedback.enabled = True
    c.outer.exchange.error_feedback.beta = 0.9
    c.outer.exchange.skip_pattern = r"norm\.weight$"
    return c
