#!/usr/bin/env bash
# The embedded diffusion job: a masked-diffusion LM trained with MuLoCo (Muon inside each
# replica group, 2-bit pseudo-gradients with error feedback), K=2 replica groups and a torchft
# lighthouse on this machine, then two samples from θ_g. Same options as diloco.sh; the
# samples come from the run's --dump_folder (default ./outputs/diffusion-muloco-2bit).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
dump="./outputs/diffusion-muloco-2bit"
prev=""
for arg in "$@"; do
    case "$arg" in
        -h|--help|--dry-run) exec env MULOCO_DEFAULT_CONFIG=diffusion/muloco_2bit MULOCO_JOB_SCRIPT=diffusion.sh "$HERE/diloco.sh" "$@" ;;
        --dump_folder=*|--dump-folder=*) dump="${arg#*=}" ;;
    esac
    if [ "$prev" = "--dump_folder" ] || [ "$prev" = "--dump-folder" ]; then dump="$arg"; fi
    prev="$arg"
done
MULOCO_DEFAULT_CONFIG=diffusion/muloco_2bit MULOCO_JOB_SCRIPT=diffusion.sh "$HERE/diloco.sh" "$@"
echo "samples from θ_g of $dump:"
"${MULOCO_PYTHON:-$REPO/.venv/bin/python}" -m muloco.generate --checkpoint "$dump" --prompt "def " --prompt "import " \
    --length 48 --block-length 16 --steps 48 --temperature 1.0 --seed 1
