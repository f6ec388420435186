#!/usr/bin/env bash
# DiLoCo (AdamW inside), K replica groups (--replicas) on one node, one GPU slice each.
# Usage: jobs/slurm/diloco.sh [--config C] [cluster and job options] [--dry-run] [-- trainer overrides]
# (python -m muloco.launch.slurm groups --help lists the options; later options override earlier ones)
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/submit.sh" groups --config gpu/diloco "$@"
