"""MuLoCo paper: DiLoCo (AdamW inside) vs MuLoCo (Muon inside), no compression, K=8 groups of
one GPU on one node, inner LR x outer LR around the model map's tuned inner LRs.

    python jobs/sweeps/diloco_vs_muloco.py --dry-run
"""

from muloco.launch.sweep import Sweep, grid, lr_grid, main
from muloco.models.model_map import parse_flavor

TUNED = parse_flavor("llama3-w1024-d12-h8").shape.tuned_lr
OUTER_LR = [0.7, 0.9]

SWEEP = Sweep("diloco_vs_muloco", [
    *grid("groups", "gpu/diloco", replicas=8,
          vary={"--optimizer.lr": lr_grid(TUNED["diloco_k8"]), "--outer.optimizer.lr": OUTER_LR}),
    *grid("groups", "gpu/muloco", replicas=8,
          vary={"--optimizer.lr": lr_grid(TUNED["muloco_k8_quantized"]), "--outer.optimizer.lr": OUTER_LR}),
])

if __name__ == "__main__":
    raise SystemExit(main(SWEEP))
