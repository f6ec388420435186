"""The outer step for masked diffusion, tuned at small scale: outer learning rate × H for MuLoCo
and DiLoCo with the ``mdlm`` objective on the embedded corpus (K=2 groups, the diffusion configs'
tiny model and 300 steps per group: the shape of ``python -m muloco.compare --suite paper-mini``).
``diffusion/muloco``'s outer lr 0.5 comes from the best of it (the table: RUNNING_JOBS.md,
"Masked-diffusion models").

    python jobs/sweeps/diffusion_outer.py --dry-run
    python jobs/sweeps/diffusion_outer.py --local 1          # here, one run at a time (about an hour on 2 cores)
    python jobs/sweeps/diffusion_outer.py --partition debug --gpus-per-node 0 --cpus-per-node 2 --time 30
"""

from muloco.launch.sweeps.sweep import Sweep, grid, main

OUTER = {"--outer.optimizer.lr": [0.5, 0.7, 1.0], "--outer.sync_every": [15, 30, 60]}
FIXED = {"--checkpoint.interval": 60}
"""A multiple of every H: no exchange is in flight when a checkpoint is taken."""

SWEEP = Sweep(
    "diffusion_outer",
    [
        *grid("groups", "diffusion/muloco", replicas=2, fixed=FIXED, vary=OUTER),
        *grid("groups", "diloco/diloco", replicas=2, fixed={**FIXED, "--objective": "mdlm"}, vary=OUTER),
    ],
)

if __name__ == "__main__":
    raise SystemExit(main(SWEEP))
