#!/usr/bin/env bash
# K DiLoCo/MuLoCo workers x N GPUs each, plus the torchft lighthouse, on this node: for a user
# inside an allocation (salloc, srun --pty bash) or on a workstation. The lighthouse binds
# 127.0.0.1; each worker is one torchrun on its own GPU slice (CUDA_VISIBLE_DEVICES).
# (MuLoCo's debug_8workers_x1gpu.sh, without hard-coded paths or CUDA_LAUNCH_BLOCKING.)
#
#   jobs/diloco/workers.sh [--workers K] [--gpus-per-worker N] [--config C] [launcher options] [-- overrides]
#   jobs/diloco/workers.sh --workers 8 --gpus-per-worker 1                 # 8 x 1 GPU, gpu/muloco_2bit
#   jobs/diloco/workers.sh --workers 2 --config diloco/muloco_2bit -- --model.flavor llama3-w64-d2-h2  # CPU
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${MULOCO_PYTHON:-$REPO/.venv/bin/python}"
args=(--config gpu/muloco_2bit --replicas 2)
while [ $# -gt 0 ]; do
    case "$1" in
        --workers) args+=(--replicas "$2"); shift 2 ;;
        --gpus-per-worker) args+=(--gpus-per-replica "$2"); shift 2 ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) args+=("$1"); shift ;;
    esac
done
exec "$PYTHON" -m muloco.launch.local "${args[@]}"
