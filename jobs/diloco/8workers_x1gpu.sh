#!/usr/bin/env bash
# 8 MuLoCo workers x 1 GPU each on one 8-GPU node (inside an allocation), lighthouse on loopback.
#   jobs/diloco/8workers_x1gpu.sh [--config C] [-- trainer overrides]
set -euo pipefail
exec "$(dirname "${BASH_SOURCE[0]}")/workers.sh" --workers 8 --gpus-per-worker 1 "$@"
