"""setup.sh's choice of torch build, driven with a stand-in for the virtual environment's Python
(and so its pip): no downloads. The four situations a user meets:

| situation | what pip can do | what setup.sh must do |
|---|---|---|
| local CPU wheel | CPU index unreachable, a ``+cpu`` wheel in pip's find-links | install it from there (one try) |
| CPU index reachable | PyTorch's CPU index answers | install the CPU build from it (one try) |
| only the CUDA build | CPU index unreachable, pip's index (PyPI) has the CUDA build | fall back to it, say so, finish |
| ``--cuda`` | pip's index, or ``TORCH_CUDA_INDEX`` | install from there |

The stand-in answers ``-m pip install`` per situation, remembers which build it "installed",
and answers setup.sh's ``-c`` checks from that; every call is logged, so the test reads the
decisions setup.sh made. setup.sh itself runs for real (bash, the real Python version check).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_watched

CPU_INDEX = "https://download.pytorch.org/whl/cpu"

STAND_IN = r"""#!/usr/bin/env bash
# A stand-in for .venv/bin/python: logs its arguments and plays pip for $SITUATION.
echo "$*" >> "$STAND_IN_LOG"
state="$STAND_IN_STATE"
if [ "$1" = "-W" ]; then shift 2; fi  # setup.sh's checks run with -W ignore (no numpy warning)
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  args="$*"
  case "$args" in
    *"install -e "*) exit 0 ;;
    *"torch=="*)
      case "$SITUATION" in
        local-wheel|cpu-index)
          case "$args" in *"--index-url $CPU_INDEX"*) echo cpu > "$state"; exit 0 ;; esac ;;
        cuda-only)
          case "$args" in *"--index-url"*)
            echo "ERROR: Could not find a version that satisfies the requirement" >&2; exit 1 ;; esac
          echo cuda > "$state"; exit 0 ;;
        cuda-flag)
          echo cuda > "$state"; exit 0 ;;
      esac
      exit 1 ;;
  esac
  exit 0
fi
if [ "$1" = "-c" ]; then
  case "$2" in
    *"assert torch.__version__"*) exit 1 ;;  # not set up yet
    *"torch.version.cuda is None"*) [ "$(cat "$state" 2>/dev/null)" = cpu ] && exit 0; exit 1 ;;
    *"CPU build"*)
      [ "$(cat "$state")" = cpu ] && echo "torch 2.13.0, CPU build" || echo "torch 2.13.0, CUDA 13.0 build"; exit 0 ;;
    *) echo "[setup] torch 2.13.0 | cuda: $(cat "$state")"; exit 0 ;;
  esac
fi
exit 0
"""


def _setup(tmp_path: Path, situation: str, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("setup.sh", "pyproject.toml", "constraints.txt"):
        shutil.copy(REPO / name, repo / name)
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STAND_IN)
    python.chmod(0o755)
    log = tmp_path / "calls.log"
    run_env = {
        **os.environ,
        "SITUATION": situation,
        "STAND_IN_LOG": str(log),
        "STAND_IN_STATE": str(tmp_path / "built"),
        "CPU_INDEX": CPU_INDEX,
        "PYTHON": sys.executable,
        **env,
    }
    run_env.pop("TORCH_CPU_INDEX", None)
    run_env.update(env)
    done = run_watched(["bash", str(repo / "setup.sh"), *args], cwd=repo, env=run_env)
    installs = [line for line in log.read_text().splitlines() if "install" in line and "torch==" in line]
    return done, installs


@pytest.mark.parametrize("situation", ["local-wheel", "cpu-index"])
def test_the_cpu_build_comes_from_the_cpu_index_or_a_local_wheel_in_one_try(tmp_path, situation):
    done, installs = _setup(tmp_path, situation)
    assert done.returncode == 0, done.stderr
    assert len(installs) == 1 and f"--index-url {CPU_INDEX}" in installs[0]
    assert "CUDA build" not in done.stdout and "[setup] done" in done.stdout
    # the main job's setup installs muloco with the plots extra and the tested versions, no test tools
    (muloco,) = [line for line in (tmp_path / "calls.log").read_text().splitlines() if "install -c " in line]
    assert muloco.endswith("[plots]") and "constraints.txt -e " in muloco


def test_the_test_command_adds_the_test_tools(tmp_path):
    done, _ = _setup(tmp_path, "cpu-index", "--test")
    assert done.returncode == 0, done.stderr
    (muloco,) = [line for line in (tmp_path / "calls.log").read_text().splitlines() if "install -c " in line]
    assert muloco.endswith("[plots,test]")


def test_with_only_the_cuda_build_reachable_setup_falls_back_says_so_and_finishes(tmp_path):
    done, installs = _setup(tmp_path, "cuda-only")
    assert done.returncode == 0, done.stderr
    assert f"--index-url {CPU_INDEX}" in installs[0] and "--index-url" not in installs[1]
    assert "cannot be reached (pip: ERROR: Could not find a version that satisfies the requirement" in done.stdout
    assert "; installing torch 2.13.0 from your pip's index" in done.stdout
    assert "note: this is torch's CUDA build" in done.stdout and "TORCH_CPU_INDEX" in done.stdout
    assert "[setup] done" in done.stdout
    stamp = (tmp_path / "repo" / ".venv" / ".muloco-setup").read_text().splitlines()
    assert stamp[0].startswith("cpu ") and stamp[1] == "torch 2.13.0, CUDA 13.0 build"  # asked for, and what came


def test_a_cpu_index_of_ones_own_is_used(tmp_path):
    mirror = "https://mirror.example/whl/cpu"
    done, installs = _setup(tmp_path, "cpu-index", TORCH_CPU_INDEX=mirror, CPU_INDEX=mirror)
    assert done.returncode == 0, done.stderr
    assert installs == [line for line in installs if f"--index-url {mirror}" in line] and len(installs) == 1


@pytest.mark.parametrize("index", ["", "https://download.pytorch.org/whl/cu130"])
def test_cuda_installs_from_pips_index_or_torch_cuda_index(tmp_path, index):
    done, installs = _setup(tmp_path, "cuda-flag", "--cuda", **({"TORCH_CUDA_INDEX": index} if index else {}))
    assert done.returncode == 0, done.stderr
    assert len(installs) == 1 and (f"--index-url {index}" in installs[0] if index else "--index-url" not in installs[0])
    assert "CPU wheels" not in done.stdout


def test_when_no_index_has_torch_setup_stops_with_one_message_naming_the_fix(tmp_path):
    done, installs = _setup(tmp_path, "nothing")
    assert done.returncode == 1 and len(installs) == 2
    assert "could not be installed from" in done.stderr and "set TORCH_CPU_INDEX" in done.stderr
