#!/usr/bin/env bash
# Create .venv in the repository and install muloco with the dependency versions CI tests
# (constraints.txt).
#
#   ./setup.sh            CPU build of torch 2.13.0 (laptops, CI, the embedded job)
#   ./setup.sh --test     also the test tools and every optional extra (what the test suite needs)
#   ./setup.sh --cuda     CUDA build of torch 2.13.0 for GPU clusters (adds triton)
#   TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu130 ./setup.sh --cuda
#   TORCH_CPU_INDEX=https://mirror.example/whl/cpu ./setup.sh   (default: PyTorch's CPU wheel index)
#
# The CPU build comes from TORCH_CPU_INDEX (or a CPU wheel your pip already finds); where that
# index cannot be reached, torch comes from your pip's own index (on PyPI the CUDA build, which
# runs on a CPU too: it is only larger), and setup says so.
#
# Idempotent: a second run only checks what is installed (a few seconds).
set -euo pipefail

TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="$here/.venv"
python_bin="${PYTHON:-python3.11}"
variant="cpu"
extras="plots"
for arg in "$@"; do
  case "$arg" in
    --cuda) variant="cuda" ;;
    --cpu) variant="cpu" ;;
    --test) extras="plots,test" ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (use --cpu, --cuda or --test)" >&2; exit 2 ;;
  esac
done

say() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3
"$python_bin" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 11) else 1)' \
  || die "Python 3.11 or newer is required ($python_bin is $("$python_bin" -V 2>&1)); set PYTHON=/path/to/python3.11"

if [ ! -x "$venv/bin/python" ]; then
  say "creating virtual environment $venv"
  "$python_bin" -m venv "$venv" || die "could not create $venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

stamp="$venv/.muloco-setup"
want="$variant $(cat "$here/pyproject.toml" "$here/constraints.txt" | sha256sum | cut -c1-16)"
have="$(head -n 1 "$stamp" 2>/dev/null || true)"  # line 2 says which torch build was installed
# a --test setup has everything a plain one installs
if { [ "$have" = "$want $extras" ] || [ "$have" = "$want plots,test" ]; } \
   && "$venv/bin/python" -c "import torch, torchtitan, torchft, muloco; assert torch.__version__.startswith('$TORCH_VERSION')" 2>/dev/null; then
  built="$(sed -n 2p "$stamp" 2>/dev/null || true)"  # a stamp from before it recorded the build has one line
  say "already set up ($variant requested, ${built:-torch $TORCH_VERSION}, extras ${have##* }); nothing to do"
  exit 0
fi

say "installing torch==$TORCH_VERSION ($variant build) first"
if [ "$variant" = "cuda" ]; then
  if [ -n "${TORCH_CUDA_INDEX:-}" ]; then
    "${pip[@]}" install "torch==$TORCH_VERSION" --index-url "$TORCH_CUDA_INDEX" || die "torch CUDA install failed"
  else
    "${pip[@]}" install "torch==$TORCH_VERSION" || die "torch CUDA install failed"
  fi
else
  pip_err="$(mktemp)"
  trap 'rm -f "$pip_err"' EXIT
  if ! "${pip[@]}" install "torch==$TORCH_VERSION" --index-url "$TORCH_CPU_INDEX" --timeout 20 --retries 1 2>"$pip_err"; then
    why="$( { grep -v '^\s*$' "$pip_err" || true; } | tail -n 2 | tr '\n' ' ')"
    say "PyTorch's CPU wheels ($TORCH_CPU_INDEX) cannot be reached (pip: ${why:-no reason given}); installing torch $TORCH_VERSION from your pip's index"
    "${pip[@]}" install "torch==$TORCH_VERSION" \
      || die "torch $TORCH_VERSION could not be installed from $TORCH_CPU_INDEX nor from your pip's index; set TORCH_CPU_INDEX to a reachable mirror of PyTorch's CPU wheels"
  fi
  rm -f "$pip_err"
  "$venv/bin/python" -W ignore -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" \
    || say "note: this is torch's CUDA build (what PyPI offers); it runs on this CPU and is only larger (about 3.8 GB more). For the CPU build: TORCH_CPU_INDEX=<a reachable mirror of $TORCH_CPU_INDEX> ./setup.sh"
fi

say "installing muloco (editable, extras: $extras) with the versions CI tests (constraints.txt)"
"${pip[@]}" install -c "$here/constraints.txt" -e "$here[$extras]" || die "installing muloco failed"

"$venv/bin/python" -c "import torch, torchtitan, torchft, muloco; print('[setup] torch', torch.__version__, '| cuda:', torch.version.cuda, '| torchtitan', torchtitan.__version__)"
build="$("$venv/bin/python" -W ignore -c "import torch; print(f'torch {torch.__version__}, ' + ('CUDA ' + torch.version.cuda + ' build' if torch.version.cuda else 'CPU build'))")"
printf '%s\n%s\n' "$want $extras" "$build" > "$stamp"
say "done"
