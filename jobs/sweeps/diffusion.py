"""The paper's comparisons for the masked-diffusion objective: DDP AdamW/Muon baselines and
MuLoCo without and with 2-bit compression (K=8 groups of one GPU), inner LR around the tuned
values.

    python jobs/sweeps/diffusion.py --dry-run
"""

from muloco.launch.sweeps.sweep import Sweep, grid, lr_grid, main, paper_batch_and_decay
from muloco.models.flavors import parse_flavor

FLAVOR = "llama3-w1024-d12-h8"
TUNED = parse_flavor(FLAVOR).shape.tuned_lr
GPU = {"--model.flavor": "llama3-w1024-d12-h8_qk_torch-rmsnorm_pa_pf", "--training.mixed_precision_param": "auto"}

SWEEP = Sweep(
    "diffusion",
    [
        *grid("ddp", "diffusion/ddp_adamw", nodes=1, fixed=GPU, vary={"--optimizer.lr": lr_grid(TUNED["diloco_k8"])}),
        *grid(
            "ddp",
            "diffusion/ddp_muon",
            nodes=1,
            fixed=GPU,
            vary={"--optimizer.lr": lr_grid(TUNED["muloco_k8_quantized"])},
        ),
        *grid(
            "groups",
            "diffusion/muloco",
            replicas=8,
            fixed={**GPU, **paper_batch_and_decay(FLAVOR, "muon", 8)},
            vary={"--optimizer.lr": lr_grid(TUNED["muloco_k8_quantized"])},
        ),
        *grid(
            "groups",
            "diffusion/muloco_2bit",
            replicas=8,
            fixed={**GPU, **paper_batch_and_decay(FLAVOR, "muon", 8)},
            vary={"--optimizer.lr": lr_grid(TUNED["muloco_k8_quantized"])},
        ),
    ],
)

if __name__ == "__main__":
    raise SystemExit(main(SWEEP))
