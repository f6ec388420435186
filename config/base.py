"""Base config: one replica, the tiny model, AdamW, the embedded standard-library corpus.

Every other config module starts from this one. Sized for a 2-core CPU; on GPUs pick
a bigger flavor from the model map and raise batch and sequence length.
"""

from muloco.trainer import MulocoTrainer


def config() -> MulocoTrainer.Config:
    c = MulocoTrainer.Config()
    c.dump_folder = "./outputs/base"
    c.model.flavor = "llama3-w128-d4-h2"
    c.debug.seed = 0  # reproducible init and data order; resumes match uninterrupted runs
    c.training.seq_len = 256
    c.training.local_batch_size = 8
    c.training.steps = 100
    c.training.max_norm = 1.0
    c.lr_scheduler.warmup_steps = 10
    c.lr_scheduler.decay_type = "cosine"
    c.lr_scheduler.min_lr_factor = 0.1
    c.optimizer.lr = 3e-3
    c.optimizer.weight_decay = 0.1
    # Classic FSDP2 (DTensor Shard(0) parameters). torchtitan 0.3.0's default "spmd_types"
    # backend leaves parameters as plain tensors, which fully_shard rejects once a replica
    # group has more than one rank.
    c.parallelism.spmd_backend = "partial_dtensor"
    c.activation_checkpoint = None  # pure overhead for tiny models
    c.metrics.log_freq = 10
    c.metrics.enable_tensorboard = True
    c.checkpoint.enable = True
    c.checkpoint.interval = 100
    c.checkpoint.last_save_model_only = False  # a last checkpoint must be resumable
    c.checkpoint.keep_latest_k = 2
    c.validator.freq = 50
    c.validator.steps = 8
    return c
