#!/usr/bin/env bash
# The embedded default job: MuLoCo (Muon inside each replica group, 2-bit pseudo-gradients
# with error feedback as the momentum of a plain SGD outer step),
# K=2 replica groups and a torchft lighthouse on this machine. Same options as diloco.sh.
set -euo pipefail
MULOCO_DEFAULT_CONFIG=diloco/muloco_2bit MULOCO_JOB_SCRIPT=muloco.sh exec "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/diloco.sh" "$@"
