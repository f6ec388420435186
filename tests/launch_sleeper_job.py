"""A local job whose replicas only sleep, for the launcher's process-lifecycle tests.

    python tests/launch_sleeper_job.py PID_DIR [launcher options] [-- overrides]

Runs ``python -m muloco.launch.local`` (same options and output) with a child command instead
of the trainer: each replica starts a sleeping child of its own (in its process group, like a
data loader worker), records ``<PID_DIR>/<replica pid>-<child pid>`` and sleeps.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muloco.launch.local import job_from_args  # noqa: E402

REPLICA = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
open(os.path.join(sys.argv[1], f"{os.getpid()}-{child.pid}"), "w").close()
print("sleeping", flush=True)
time.sleep(3600)
"""


def main() -> int:
    pid_dir, argv = sys.argv[1], sys.argv[2:]
    job = job_from_args(argv)
    job.command = [sys.executable, "-c", REPLICA, pid_dir]
    return job.run()


if __name__ == "__main__":
    sys.exit(main())
