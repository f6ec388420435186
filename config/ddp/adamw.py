"""Single replica group (DDP/FSDP inside it) with AdamW: the baseline DiLoCo is compared to."""

from muloco.config import load_config


def config():
    c = load_config("base")
    c.dump_folder = "./outputs/ddp-adamw"
    c.training.steps = 200
    c.lr_scheduler.warmup_steps = 20
    c.validator.freq = 100
    return c
