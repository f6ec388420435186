"""MuLoCo paper: compressed pseudo-gradients, 2-bit quantization and top-k (2%), each with and
without error feedback; K=8 groups of one GPU on one node, two inner LRs.

    python jobs/sweeps/muloco_compression.py --dry-run
"""

from muloco.launch.sweeps.sweep import Sweep, grid, lr_grid, main, paper_batch_and_decay
from muloco.models.flavors import parse_flavor

FLAVOR = "llama3-w1024-d12-h8"
TUNED = parse_flavor(FLAVOR).shape.tuned_lr
PAPER = paper_batch_and_decay(FLAVOR, "muon", 8)
LRS = lr_grid(TUNED["muloco_k8_quantized"], 2)
EF = ["--outer.exchange.error_feedback.enabled", "--outer.exchange.error_feedback.no-enabled"]


def with_ef(runs, flag):
    for r in runs:
        r.overrides.append(flag)
    return runs


SWEEP = Sweep(
    "muloco_compression",
    [
        run
        for flag in EF
        for run in with_ef(
            grid("groups", "gpu/muloco_2bit", replicas=8, fixed=PAPER, vary={"--optimizer.lr": LRS})
            + grid(
                "groups",
                "gpu/muloco",
                replicas=8,
                fixed={**PAPER, "--outer.exchange.codec": "topk", "--outer.exchange.codec.fraction": 0.02},
                vary={"--optimizer.lr": LRS},
            ),
            flag,
        )
    ],
)

if __name__ == "__main__":
    raise SystemExit(main(SWEEP))
