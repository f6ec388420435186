#!/usr/bin/env bash
# DDP/FSDP on this node's GPUs, inside an allocation (salloc, or srun --pty bash) or on a
# workstation: one torchrun, one rank per GPU (NGPU, default: every visible GPU; 1 rank on CPU).
#
#   jobs/ddp/run.sh [--config ddp/muon] [-- trainer overrides]
#   NGPU=4 jobs/ddp/run.sh --config gpu/ddp_adamw -- --training.steps 100
#   jobs/ddp/run.sh --config ddp/adamw -- --model.flavor llama3-w64-d2-h2 --training.steps 20   # CPU
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${MULOCO_PYTHON:-$REPO/.venv/bin/python}"
CONFIG=gpu/ddp_muon
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --config) CONFIG="$2"; shift 2 ;;
        --) shift; args+=("$@"); break ;;
        -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
        *) args+=("$1"); shift ;;
    esac
done
if [ -z "${NGPU:-}" ]; then
    NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
    [ "$NGPU" -gt 0 ] || NGPU=1
fi
echo "jobs/ddp/run.sh: $NGPU rank(s), config $CONFIG"
exec "$PYTHON" -m torch.distributed.run --nnodes 1 --nproc-per-node "$NGPU" --rdzv-backend c10d \
    --rdzv-endpoint 127.0.0.1:0 --local-addr 127.0.0.1 -m muloco.train --config "$CONFIG" "${args[@]}"
