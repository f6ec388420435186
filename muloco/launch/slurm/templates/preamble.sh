set -uo pipefail
cd "${MULOCO_WORKDIR:-$SLURM_SUBMIT_DIR}" || exit 2  # where sbatch was called: relative paths start here
PYTHON="${MULOCO_PYTHON:-.venv/bin/python}"
# srun no longer inherits --cpus-per-task from sbatch (SLURM 22.05): hand it on
export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"

# --- environment (one block; add or change values in the [env] table of ~/.config/muloco/cluster.toml) ---
# Secrets (WANDB_API_KEY, HF_TOKEN) are never written here: export them before sbatch.
@{exports}
