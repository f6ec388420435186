"""MuLoCo paper: DiLoCo (AdamW inside) vs MuLoCo (Muon inside), no compression, K=8 groups of
one GPU on one node, global batch 512, inner LR x outer LR around the model map's tuned inner
LRs, weight decay rescaled by the model map's rule (divided by K).

    python jobs/sweeps/diloco_vs_muloco.py --dry-run
"""

from muloco.launch.sweeps.sweep import Sweep, grid, lr_grid, main, paper_batch_and_decay
from muloco.models.flavors import parse_flavor

FLAVOR = "llama3-w1024-d12-h8"  # the GPU presets' shape (416M)
TUNED = parse_flavor(FLAVOR).shape.tuned_lr
K = 8
OUTER_LR = [0.7, 0.9]

SWEEP = Sweep(
    "diloco_vs_muloco",
    [
        *grid(
            "groups",
            "gpu/diloco",
            replicas=K,
            fixed=paper_batch_and_decay(FLAVOR, "adamw", K),
            vary={"--optimizer.lr": lr_grid(TUNED["diloco_k8"]), "--outer.optimizer.lr": OUTER_LR},
        ),
        *grid(
            "groups",
            "gpu/muloco",
            replicas=K,
            fixed=paper_batch_and_decay(FLAVOR, "muon", K),
            vary={"--optimizer.lr": lr_grid(TUNED["muloco_k8_quantized"]), "--outer.optimizer.lr": OUTER_LR},
        ),
    ],
)

if __name__ == "__main__":
    raise SystemExit(main(SWEEP))
