"""GPU preset: one replica group (FSDP over its GPUs) with AdamW, the paper's 416M flavor.

Sizing (seq 2048, global batch 512, Chinchilla steps, bf16 + compile): muloco/config/gpu_preset.py.
Bring a tokenizer and data: ``--tokenizer.path .../tokenizer.model --dataloader.source jsonl
--dataloader.source.dataset_path ...``
(with the embedded 2,048-token vocabulary the same shape has 158M parameters).
"""

from muloco.config import load_config
from muloco.config.gpu_preset import size_for_gpu


def config():
    c = load_config("ddp/adamw")
    c.dump_folder = "./outputs/gpu-ddp-adamw"
    return size_for_gpu(c, weight_decay_key="adamw")
