"""GPU preset: one replica group with Muon (AdamW for embeddings, head and norms), 416M flavor.

Sizing: muloco/config/gpu_preset.py. Muon runs on the FSDP shards (gathered per matrix).
"""

from muloco.config import load_config
from muloco.config.gpu_preset import size_for_gpu


def config():
    c = load_config("ddp/muon")
    c.dump_folder = "./outputs/gpu-ddp-muon"
    return size_for_gpu(c, weight_decay_key="muon")
