"""GPU preset: DiLoCo, K=2 replica groups (AdamW inside), H=30, 416M flavor.

Start it with ``python -m muloco.launch.local --config gpu/diloco --replicas 2`` (one GPU
slice per group). Inner lr: MuLoCo's tuned DiLoCo value for this shape (tuned at K=8).
Sizing: muloco/config/gpu_preset.py.
"""

from muloco.config import load_config
from muloco.config.gpu_preset import size_for_gpu


def config():
    c = load_config("diloco/diloco")
    c.dump_folder = "./outputs/gpu-diloco"
    return size_for_gpu(c, weight_decay_key="adamw", lr_key="diloco_k8")
