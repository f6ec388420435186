"""A test for ``tests/test_suite_signals.py`` to run and terminate, not part of the suite (its
name does not start with ``test_``): it starts a sleeping process, records its PID in the file
``$SIGTERM_TARGET_PIDS``/<worker>, and waits; its ``finally`` stops the process by PID, as the
suite's tests do."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest


@pytest.mark.parametrize("n", [0, 1])
def test_sleeps_with_a_child(n):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    try:
        (Path(os.environ["SIGTERM_TARGET_PIDS"]) / f"{n}-{child.pid}").write_text("up")
        while True:
            time.sleep(0.1)
    finally:
        child.kill()
        child.wait()
