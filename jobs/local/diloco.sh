#!/usr/bin/env bash
# Interactive local DiLoCo run: K replica groups + a torchft lighthouse on this machine.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEFAULT_CONFIG="${MULOCO_DEFAULT_CONFIG:-diloco/diloco}"  # jobs/local/muloco.sh sets diloco/muloco_2bit

usage() {
    cat <<USAGE
Usage: jobs/local/${MULOCO_JOB_SCRIPT:-$(basename "$0")} [launcher options] [-- trainer overrides...]

Runs K DiLoCo replica groups and their torchft lighthouse on this machine, all bound to
127.0.0.1: each group is one torchrun with its ranks on its own slice of the GPUs
(CUDA_VISIBLE_DEVICES; --gpus-per-replica, --dry-run shows the layout). Each replica's output
is shown prefixed ([r0], [r1]) and kept raw in <dump_folder>/logs/replica_<i>.log. A quorum is a majority of the K groups (--min-replicas).
Ctrl-C stops everything (a second Ctrl-C skips the 10 s grace); if the launcher is killed,
its lighthouse and replicas die with it. Exit status: 0 only if every replica finished;
2 if nothing was started (a config without an outer loop, a bad override, or a dump folder
that a live run holds).

Defaults: --config $DEFAULT_CONFIG --replicas 2 (later options override these).

Examples:
  jobs/local/diloco.sh --replicas 2 -- --training.steps 50 --dump_folder outputs/diloco-try
  jobs/local/diloco.sh --replicas 3 --max-restarts 1 --threads 1 -- --training.steps 100
  jobs/local/diloco.sh --config ./my_config.py --procs-per-replica 2

Launcher options (python -m muloco.launch.local):
USAGE
    "${MULOCO_PYTHON:-$REPO/.venv/bin/python}" -m muloco.launch.local --help | sed -n '/─ options ─/,$p'
}

for arg in "$@"; do
    case "$arg" in
        -h|--help) usage; exit 0 ;;
        --) break ;;
    esac
done

exec "${MULOCO_PYTHON:-$REPO/.venv/bin/python}" -m muloco.launch.local --config "$DEFAULT_CONFIG" "$@"
