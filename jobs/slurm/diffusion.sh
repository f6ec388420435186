#!/usr/bin/env bash
# Masked-diffusion MuLoCo 2-bit, K replica groups on one node.
# Usage: jobs/slurm/diffusion.sh [--config C] [cluster and job options] [--dry-run] [-- trainer overrides]
# (python -m muloco.launch.slurm groups --help lists the options; later options override earlier ones)
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/submit.sh" groups --config diffusion/muloco_2bit "$@"
