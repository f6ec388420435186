"""A 2-run sweep of the tiny CPU flavor (DDP AdamW, two inner LRs): what the tests submit to the
localhost SLURM, and a quick check that a cluster's set-up works end to end.

    python jobs/sweeps/tiny_cpu.py --partition debug --gpus-per-node 0 --cpus-per-node 1 --time 10
"""

from muloco.launch.sweeps.sweep import Sweep, grid, main

TINY = {
    "--model.flavor": "llama3-w64-d2-h2",
    "--training.seq_len": 64,
    "--training.local_batch_size": 4,
    "--lr_scheduler.warmup_steps": 2,
    "--validator.steps": 2,
    "--training.steps": 16,
    "--metrics.log_freq": 2,
    "--validator.freq": 8,
}

SWEEP = Sweep("tiny_cpu", grid("ddp", "ddp/adamw", nodes=1, fixed=TINY, vary={"--optimizer.lr": [0.001, 0.003]}))

if __name__ == "__main__":
    raise SystemExit(main(SWEEP))
