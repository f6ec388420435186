"""SparseLoCo on MuLoCo: top-k 1.56% with 2-bit values and 12-bit indices (0.22 bits per
parameter), error feedback as the outer momentum, plain SGD outer step at lr 1.

Each replica keeps e ← 0.95·e + Δ, sends the 64 largest |e| of every 4096-element chunk
(12-bit chunk-local indices; the kept values quantized to 2 bits, mean-shifted σ-range bins
decoded to their per-bin means, one table per 8 chunks) and keeps e ← e − sent. Each
coordinate of the average is the mean over the replicas that selected it, and
θ_g ← θ_g − 1.0 · average: no Nesterov momentum on top of the error feedback, whose
accumulator already is the momentum (Templar's SparseLoCo). Wire cost per 4096 parameters:
64·(12 + 2) bits, and a 16-byte table per 8 chunks: 0.2227 bits per parameter.

Where it differs from tplr-ai's reference code: chunks are 4096 consecutive elements of the
fragment's flat stream, not 64×64 tiles of each matrix; the value grid is ±1.97σ (near
Lloyd–Max) instead of ±3σ; inner optimizer Muon (``--optimizer.name AdamW`` for theirs).
``docs/compression.md`` has the measurements behind the design.
"""

from muloco.compress import sparseloco_codec
from muloco.config import load_config


def config():
    c = load_config("diloco/muloco_2bit")  # error feedback as the outer momentum, plain SGD at lr 1
    c.dump_folder = "./outputs/sparseloco"
    c.outer.exchange.skip_pattern = ""  # nothing goes dense, as in the reference
    c.outer.exchange.codec = sparseloco_codec()  # muloco/compress/topk.py: the values the docstring gives
    return c
