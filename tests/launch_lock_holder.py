"""Hold a dump folder's lock, like a running job would, until killed.

    python tests/launch_lock_holder.py FOLDER

Takes ``DumpFolderLock(FOLDER)``, starts a sleeping child (as a job starts workers), prints
``<own pid> <child pid>`` and sleeps. Tests SIGKILL it to leave a stale lock behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muloco.runs.lock import DumpFolderLock  # noqa: E402


def main() -> None:
    DumpFolderLock(sys.argv[1]).acquire()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(os.getpid(), child.pid, flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
