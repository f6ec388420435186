#!/usr/bin/env bash
# Fault-tolerant MuLoCo 2-bit: each replica group its own array task (a dead node requeues only its group, which heals from a peer); the lighthouse is a small job of its own.
# Usage: jobs/slurm/muloco_ft_array.sh [--config C] [cluster and job options] [--dry-run] [-- trainer overrides]
# (python -m muloco.launch.slurm array --help lists the options; later options override earlier ones)
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/submit.sh" array --config gpu/muloco_2bit "$@"
