"""SparseLoCo as its authors run it: AdamW inside, 64×64 tiles, H=15 (arXiv 2508.15706; Templar).

What the public code does (tplr-ai/SparseLoCo, Templar ``src/tplr/compress.py``) and this config
reproduces: each replica keeps e ← 0.95·e + Δ; each matrix is cut into 64×64 tiles (a dimension
64 does not divide gets the largest divisor below it) and the 64 largest |e| of each tile are sent
(1.56%, Templar's and Covenant-72B's density) with 12-bit tile-local indices and 2-bit values
quantized as their code does: centred on the mean, σ over N − 1, bins of 6σ/4 with the mean at a
bin's centre (code = round((v − μ)/s + 2), clamped to [0, 3]), each bin decoded to the mean of its
values, one table per parameter tensor (``value_block_chunks=0``; with FSDP, per rank's shard of it,
as each rank compresses its own part); e ← 0.95·e + η·Δ (their residual holds the outer lr, which the outer step
applies again:
``error_feedback.fold_outer_lr``; at their η = 1 nothing differs); 1-D tensors (the norms) are
sent whole; each coordinate is averaged over the replicas that selected it; θ_g ← θ_g − η ·
average with η = 1 (plain SGD: the error feedback is the only momentum); H = 15, the smallest H
the paper sweeps. AdamW is the inner optimizer (``diloco/diloco``'s). For one tensor's kept
values the decoded values equal their formula's, tensor by tensor (tests/test_compress.py).

Where it still differs: the norms go in fp32 (Templar quantizes them too, one table per tensor;
the paper's repository keeps k = 2 of each 64-element chunk).
``diloco/sparseloco`` is the MuLoCo variant (Muon inside, flat 4,096-element chunks, the
near-Lloyd–Max ±1.97σ grid).
"""

from muloco.compress import TopK
from muloco.config import load_config


def config():
    c = load_config("diloco/diloco")
    c.dump_folder = "./outputs/sparseloco-published"
    compressed = load_config("diloco/muloco_2bit").outer
    c.outer.optimizer = compressed.optimizer  # plain SGD at lr 1: the error feedback is the momentum
    c.outer.exchange.error_feedback = compressed.exchange.error_feedback  # β 0.95
    c.outer.exchange.codec = TopK.Config(
        fraction=64 / 4096,
        chunk_size=4096,
        value_bits=2,
        value_scheme="statistical",
        value_block_chunks=0,
        value_range_sigmas=6.0,
        value_mean_at="centre",
        value_sample_sigma=True,
        index_bits=12,
        mean_over_selectors=True,
    )
    c.outer.exchange.error_feedback.fold_outer_lr = True  # e ← β·e + η·Δ, as their code
    c.outer.exchange.tiles = 64
    c.outer.exchange.skip_pattern = r"norm\.weight$"  # 1-D tensors whole, as Templar sends them
    c.outer.sync_every = 15
    return c
