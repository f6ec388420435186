"""MuLoCo paper: DDP baselines, AdamW and Muon, inner LR around the model map's tuned values.

python jobs/sweeps/ddp_baselines.py --dry-run
python jobs/sweeps/ddp_baselines.py --partition gpu --max-nodes 16
"""

from muloco.launch.sweeps.sweep import Sweep, grid, lr_grid, main
from muloco.models.flavors import parse_flavor

FLAVOR = "llama3-w1024-d12-h8"  # the GPU presets' shape (416M)
TUNED = parse_flavor(FLAVOR).shape.tuned_lr

SWEEP = Sweep(
    "ddp_baselines",
    [
        *grid("ddp", "gpu/ddp_adamw", nodes=1, vary={"--optimizer.lr": lr_grid(TUNED["diloco_k8"])}),
        *grid("ddp", "gpu/ddp_muon", nodes=1, vary={"--optimizer.lr": lr_grid(TUNED["muloco_k8_quantized"])}),
    ],
)

if __name__ == "__main__":
    raise SystemExit(main(SWEEP))
