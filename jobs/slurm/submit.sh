#!/usr/bin/env bash
# Generate and submit a SLURM job: jobs/slurm/submit.sh KIND --config C [options] [-- trainer overrides]
#   KIND: ddp | groups | spanning | array  (python -m muloco.launch.slurm KIND --help lists the options)
# The other scripts here are this one with a kind and a config filled in; --dry-run prints the
# sbatch script(s) and submits nothing. Cluster defaults: ~/.config/muloco/cluster.toml.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
exec "${MULOCO_PYTHON:-$REPO/.venv/bin/python}" -m muloco.launch.slurm "$@"
