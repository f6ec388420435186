"""GPU preset: MuLoCo with 2-bit pseudo-gradients and error feedback, K=2, H=30, 416M flavor.

Inner lr: MuLoCo's tuned quantized-MuLoCo value for this shape (tuned at K=8).
Sizing: muloco/config/gpu_preset.py.
"""

from muloco.config import load_config
from muloco.config.gpu_preset import size_for_gpu


def config():
    c = load_config("diloco/muloco_2bit")
    c.dump_folder = "./outputs/gpu-muloco-2bit"
    return size_for_gpu(c, weight_decay_key="muon", lr_key="muloco_k8_quantized")
