"""Single replica group (DDP/FSDP inside it) with AdamW: the baseline DiLoCo is compared to."""

from muloco.config import load_config


def config():
    c = load_config("base")
    c.dump_folder = "./outputs/ddp-adamw"
    c.training.steps = 450  # about 0.9M tokens: under 2 minutes on a quiet 2-core CPU
    c.lr_scheduler.warmup_steps = 30
    c.metrics.log_freq = 25
    c.checkpoint.interval = 200
    c.validator.freq = 100
    c.validator.steps = 16
    return c
