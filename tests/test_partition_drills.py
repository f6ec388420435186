"""Partition drills: replica groups on hosts of their own (``muloco.launch.local --netns``), a
link cut while the run goes on, and the run ends in agreement with nothing committed twice.

A drill paces the run with ``tests/drill_train.py``'s ``hold`` (a group waits after an inner
step until the test releases it), so the cut lands where the drill says, not where a race puts it.
"""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import QUIET_S, REPO, TINY
from drill_train import release

from muloco.launch.local import LocalJob
from muloco.launch.netns import namespaces, unavailable

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=f"no network namespaces here: {unavailable()}")

H, STEPS = 5, 15


class _Console(io.StringIO):
    """The launcher's console, with the time of its last line (the drill's progress watchdog)."""

    def __init__(self) -> None:
        super().__init__()
        self.last = time.monotonic()

    def write(self, text: str) -> int:
        self.last = time.monotonic()
        return super().write(text)


def _wait_for(what: str, done, console: _Console, thread: threading.Thread) -> None:
    """Until ``done()``; fails if the job ends first or prints nothing for QUIET_S seconds."""
    while not done():
        assert thread.is_alive(), f"the job ended before {what}:\n{console.getvalue()[-4000:]}"
        assert time.monotonic() - console.last < QUIET_S, f"no progress for {QUIET_S} s waiting for {what}"
        time.sleep(0.05)


def _summary(run: Path, replica: int) -> dict:
    return json.loads((run / f"replica_{replica}" / "summary.json").read_text())


@pytest.mark.timeout(900)
def test_a_group_cut_off_for_15_s_mid_round_rejoins_and_the_groups_agree(tmp_path):
    """K=2, lockstep: group 1's link goes down mid-round for 15 s (it trains on to the sync and
    waits there cut off); when the link returns the sync commits and the run ends with both groups
    on one θ_g, every sync committed once, no step trained twice, nothing left behind."""
    run, drills = tmp_path / "run", tmp_path / "drills"
    drills.mkdir()
    console = _Console()
    job = LocalJob(config="diloco/diloco", replicas=2, netns=True, console=console,
                   entry=[sys.executable, str(REPO / "tests" / "drill_train.py")],
                   env={"MULOCO_TEST_DRILLS": f"hold:1:{H + 2}", "MULOCO_TEST_DRILL_DIR": str(drills)},
                   overrides=[*TINY, "--training.steps", str(STEPS), "--outer.sync_every", str(H),
                              "--validator.no-enable", "--checkpoint.no-enable", "--metrics.log_freq", "1",
                              "--dump_folder", str(run)])
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(job.run()), daemon=True)
    thread.start()
    try:
        _wait_for("group 1 holds mid-round", (drills / f"hold-r1-{H + 2}").exists, console, thread)
        tb = job.testbed
        prefix = tb.prefix
        tb.cut("r1")
        release(drills, 1, H + 2)
        time.sleep(15)  # the fault itself: how long the link stays down
        tb.restore("r1")
        restored = time.monotonic()
        _wait_for("the job's end", lambda: not thread.is_alive(), console, thread)
    finally:
        if thread.is_alive():
            job.stop()
            thread.join(120)
    out = console.getvalue()
    assert result == [0], out[-6000:]
    s0, s1 = _summary(run, 0), _summary(run, 1)
    for s in (s0, s1):
        assert s["steps"] == STEPS
        assert s["diloco"]["syncs_committed"] == s["diloco"]["syncs"] == STEPS // H, s["diloco"]
    assert s0["diloco"]["final_global_sha256"] == s1["diloco"]["final_global_sha256"]
    print(f"partition drill: cut r1 15 s mid-round; recovered {time.monotonic() - restored:.1f} s after the "
          "link returned (to the job's end)")
    assert not [n for n in namespaces() if n.startswith(prefix + "-")]  # the testbed is gone
