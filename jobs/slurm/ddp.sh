#!/usr/bin/env bash
# DDP baseline (Muon inside) over --nodes nodes, torchrun on each.
# Usage: jobs/slurm/ddp.sh [--config C] [cluster and job options] [--dry-run] [-- trainer overrides]
# (python -m muloco.launch.slurm ddp --help lists the options; later options override earlier ones)
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/submit.sh" ddp --config gpu/ddp_muon "$@"
