"""MuLoCo with top-k sparsified pseudo-gradients and error feedback.

A fixed 10% of each 4096-element chunk is kept (the same payload size on every
replica), with 16-bit chunk-local indices and bfloat16 values: 3.2 bits per parameter,
where MuLoCo's int64 indices and fp32 values cost 9.6. ``--outer.exchange.codec.fraction``,
``--outer.exchange.codec.value_bits 4`` (quantized values), ``--outer.exchange.codec.chunk_size``.
Error feedback as the outer momentum (β 0.95, plain SGD outer step at lr 1) and dense norms
as in ``diloco/muloco_2bit``.
"""

from muloco.compress import TopK
from muloco.config import load_config


def config():
    c = load_config("diloco/muloco_2bit")
    c.dump_folder = "./outputs/muloco-topk"
    c.outer.exchange.codec = TopK.Config(fraction=0.1, chunk_size=4096, value_dtype="bfloat16")
    return c
