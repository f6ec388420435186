"""DiLoCo: K replica groups, AdamW inside each, Nesterov SGD on the pseudo-gradient every H steps.

Run it with ``jobs/local/diloco.sh`` (starts the lighthouse and the K groups), or
start ``./torchft_lighthouse`` and one ``python -m muloco.train --config diloco/diloco
--fault_tolerance.replica_id i`` per group yourself. Every knob is overridable:
``--outer.sync_every``, ``--outer.optimizer.lr``, ``--outer.optimizer.momentum``,
``--outer.num_fragments``, ``--outer.fragment_sync_delay``, ``--outer.fragment_update_alpha``,
``--outer.backup_device``, ``--outer.exchange.codec.dtype`` (bfloat16 halves the bytes),
``--fault_tolerance.*_timeout_seconds``.
"""

from muloco.config import derive, load_config
from muloco.diloco_trainer import DilocoTrainer
from muloco.outer.optimizer import Nesterov


def config() -> DilocoTrainer.Config:
    c = derive(load_config("base"), DilocoTrainer.Config)
    c.dump_folder = "./outputs/diloco"
    c.training.steps = 300  # per replica; under 2 minutes for K=2 on a quiet 2-core CPU
    c.lr_scheduler.warmup_steps = 30
    c.metrics.log_freq = 25
    c.checkpoint.interval = 150
    c.validator.freq = 90
    c.validator.steps = 16
    c.fault_tolerance.group_size = 2  # K replica groups
    c.outer.sync_every = 30  # H
    c.outer.optimizer = Nesterov.Config(lr=0.7, momentum=0.9)
    return c
