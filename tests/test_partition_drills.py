"""Partition drills: replica groups on hosts of their own (``muloco.launch.local --netns``), a
link cut while the run goes on, and the run ends in agreement with nothing committed twice.

A drill paces the run with ``tests/drill_train.py``'s ``hold`` (a group waits after an inner
step until the test releases it), so the cut lands where the drill says, not where a race puts it.
"""

from __future__ import annotations

import io
import json
import re
import sys
import threading
import time
from datetime import datetime
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


def _drill(tmp_path: Path, k: int, victim: int, fault: str, seconds: float, extra: list[str] = ()) -> dict:
    """Run K groups of STEPS steps (H per sync) on the testbed; group ``victim`` holds after inner
    step H + 2 (mid-round), the fault starts (``cut``: its link down; ``lighthouse``: it and the
    lighthouse cannot reach each other), the group goes on, and ``seconds`` later the fault ends.
    Returns the console, the summaries and the recovery: seconds from the fault's end to the
    victim's next committed sync or heal (from its log's timestamps)."""
    run, drills = tmp_path / "run", tmp_path / "drills"
    drills.mkdir()
    console = _Console()
    job = LocalJob(
        config="diloco/diloco",
        replicas=k,
        netns=True,
        console=console,
        entry=[sys.executable, str(REPO / "tests" / "drill_train.py")],
        env={"MULOCO_TEST_DRILLS": f"hold:{victim}:{H + 2}", "MULOCO_TEST_DRILL_DIR": str(drills)},
        overrides=[
            *TINY,
            "--training.steps",
            str(STEPS),
            "--outer.sync_every",
            str(H),
            "--validator.no-enable",
            "--checkpoint.no-enable",
            "--metrics.log_freq",
            "1",
            "--dump_folder",
            str(run),
            *extra,
        ],
    )
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(job.run()), daemon=True)
    thread.start()
    host = f"r{victim}"
    try:
        _wait_for(f"group {victim} holds mid-round", (drills / f"hold-r{victim}-{H + 2}").exists, console, thread)
        tb = job.testbed
        prefix = tb.prefix
        tb.cut(host) if fault == "cut" else tb.block("lighthouse", host)
        release(drills, victim, H + 2)
        time.sleep(seconds)  # the fault itself: how long it lasts
        tb.restore(host) if fault == "cut" else tb.unblock("lighthouse", host)
        ended = datetime.now()
        _wait_for("the job's end", lambda: not thread.is_alive(), console, thread)
    finally:
        if thread.is_alive():
            job.stop()
            thread.join(120)
    out = console.getvalue()
    assert result == [0], out[-6000:]
    assert not [n for n in namespaces() if n.startswith(prefix + "-")]  # the testbed is gone
    return {
        "out": out,
        "summaries": [_summary(run, i)["diloco"] for i in range(k)],
        "recovered_s": _recovery(out, victim, ended),
    }


_STAMP = re.compile(
    r"^\[r(\d+)\] \[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*(sync at step \d+ .*: committed|healed "
    r"from replica)"
)


def _recovery(out: str, victim: int, ended: datetime) -> float:
    """Seconds from the fault's end to the victim's first committed sync or heal after it."""
    for line in out.splitlines():
        m = _STAMP.match(line)
        if m and int(m.group(1)) == victim:
            at = datetime.strptime(m.group(2), "%Y-%m-%d %H:%M:%S,%f")
            if at >= ended:
                return (at - ended).total_seconds()
    raise AssertionError(f"replica {victim} neither committed nor healed after the fault ended")


@pytest.mark.timeout(900)
def test_at_k3_the_majority_commits_through_a_cut_and_the_cut_group_heals_back_counting_what_it_missed(tmp_path):
    """K=3, lockstep: group 2's link goes down mid-round for 10 s. It trains on to its sync and waits
    there cut off, saying so (after 5 s), its wait booked as cut off, not as waiting for the slowest;
    the other two commit every sync without it (a majority, after the 5 s heartbeat timeout) and
    finish; when the link returns group 2 heals from a peer (their final state, no exchange) and its
    summary counts the syncs it missed. All three end on one θ_g, no sync rolled back, nothing left
    behind. (bench/partition_drills.py runs the longer drills: K=2, 60 s, a blocked lighthouse,
    deadline rounds.)"""
    d = _drill(tmp_path, 3, 2, "cut", 10)
    s0, s1, s2 = d["summaries"]
    assert s0["syncs_committed"] == s1["syncs_committed"] == STEPS // H
    assert s0["final_global_sha256"] == s1["final_global_sha256"] == s2["final_global_sha256"]
    assert s2["heals"] == 1 and s2["syncs_failed"] == 0
    assert s2["syncs_committed"] + s2["syncs_missed"] == STEPS // H and s2["syncs_missed"] >= 1
    assert "sync(s) the others committed without it" in d["out"]
    assert (
        "this group may be cut off from it and its peers); it gives up after 30s "
        "(--fault_tolerance.lighthouse_lost_seconds)" in d["out"]
    )
    assert s2["cut_off_seconds"] > 5 > s2["sync_seconds_by_part"]["wait_slowest"], s2  # cut off, not waiting
    print(
        f"partition drill K=3 lockstep, r2 cut 10 s mid-round: recovered {d['recovered_s']:.1f} s after the "
        "link returned"
    )
