"""GPU preset: MuLoCo (Muon inside DiLoCo), K=2, H=30, dense fp32 exchange, 416M flavor.

Sizing: muloco/config/gpu_preset.py. For the compressed exchange see gpu/muloco_2bit.
"""

from muloco.config import load_config
from muloco.config.gpu_preset import size_for_gpu


def config():
    c = load_config("diloco/muloco")
    c.dump_folder = "./outputs/gpu-muloco"
    return size_for_gpu(c, weight_decay_key="muon")
