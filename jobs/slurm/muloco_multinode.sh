#!/usr/bin/env bash
# MuLoCo 2-bit, K replica groups of --nodes-per-replica nodes each in one job; lighthouse on the first node.
# Usage: jobs/slurm/muloco_multinode.sh [--config C] [cluster and job options] [--dry-run] [-- trainer overrides]
# (python -m muloco.launch.slurm spanning --help lists the options; later options override earlier ones)
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/submit.sh" spanning --config gpu/muloco_2bit "$@"
