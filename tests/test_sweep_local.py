"""``--local N``: a sweep on this machine without SLURM, through submitit's LocalExecutor (a DDP
run and a K=2 run of the tiny flavor), its manifest, a second invocation that reuses both runs,
and --status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import QUIET_S, REPO, TINY
from slurm_cluster import pid_alive

from muloco.launch.sweeps.sweep import Sweep, grid, main

pytestmark = pytest.mark.timeout(900)
SHORT = [*TINY, "--training.steps", "4", "--validator.freq", "4", "--checkpoint.interval", "4"]
SWEEP = Sweep(
    "tiny_local",
    [
        *grid("ddp", "ddp/adamw", fixed={}, vary={"--optimizer.lr": [0.003]}),
        *grid("groups", "diloco/muloco", replicas=2, fixed={"--outer.sync_every": 2}, vary={"--optimizer.lr": [0.02]}),
    ],
)


def test_a_sweep_runs_here_with_local_and_reuses_its_finished_runs(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(SWEEP, ["--local", "1", "--out", str(out), "--", *SHORT]) == 0, capsys.readouterr().err
    said = capsys.readouterr().out
    assert "2 run(s) here, 1 at a time (0 finished before)" in said and said.count("\nfinished ") == 2
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [m["state"] for m in manifest] == ["COMPLETED", "COMPLETED"]
    assert all(m["jobs"][0].startswith("local:") for m in manifest)
    ddp, k2 = (out / m["name"] for m in manifest)
    assert json.loads((ddp / "summary.json").read_text())["steps"] == 4
    a, b = (json.loads((k2 / f"replica_{r}" / "summary.json").read_text()) for r in (0, 1))
    assert a["diloco"]["final_global_sha256"] == b["diloco"]["final_global_sha256"]
    assert (out / "logs" / f"{manifest[0]['name']}.log").read_text()  # each run's own output
    assert list((out / "submitit").glob("*_log.out")), "submitit kept each local job's own log"
    assert main(SWEEP, ["--local", "1", "--out", str(out), "--", *SHORT]) == 0
    assert "0 run(s) here, 1 at a time (2 finished before)" in capsys.readouterr().out
    assert main(SWEEP, ["--status", "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("COMPLETED") == 2


def test_a_sweep_folder_another_launcher_holds_is_one_error(tmp_path, capsys):
    """Two launchers on one sweep folder would lose each other's job ids: the second is refused
    with one line (exit 2) and starts nothing."""
    from muloco.runs.lock import DumpFolderLock

    out = tmp_path / "sweep"
    with DumpFolderLock(str(out)):
        assert main(SWEEP, ["--local", "1", "--out", str(out), "--", *SHORT]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"muloco sweep: error: tiny_local: the folder {out} is in use by ") and err.count("\n") == 1
    ), err
    assert err.rstrip().endswith("or pass another --out"), err
    assert not (out / "logs").exists() and not (out / "manifest.jsonl").exists()


def test_a_local_sweep_lets_groups_share_the_gpus_only_where_a_run_has_more_groups_than_gpus(
    capsys, monkeypatch, tmp_path
):
    """Two visible GPUs: a K=4 run's groups share them (as compare's runs do), a K=2 run's get one
    each, and the sweep says so; a dry run shows the commands."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    sweep = Sweep(
        "gpu_share",
        [
            *grid("groups", "diloco/muloco", replicas=4, fixed={"--outer.sync_every": 2}),
            *grid("groups", "diloco/muloco", replicas=2, fixed={"--outer.sync_every": 2}),
        ],
    )
    assert main(sweep, ["--local", "1", "--dry-run", "--out", str(tmp_path / "s"), "--", *SHORT]) == 0
    out, err = capsys.readouterr()
    k4, k2 = (line for line in out.splitlines() if line.startswith("run "))
    assert "--replicas 4" in k4 and "--share-gpus" in k4
    assert "--replicas 2" in k2 and "--share-gpus" not in k2
    assert "note: 2 GPU(s) for up to 4 replica groups: the groups of 1 run(s) share GPUs" in err


RUNNER = """
import sys
from muloco.compare.runner import stop_on_sigterm
from muloco.launch.sweeps.local_runs import LocalRuns
stop_on_sigterm()
from muloco.runs.sweep_manifest import Entry
runs = LocalRuns(sys.argv[1], 1, {}, record=lambda event: print(event.state, flush=True), say=lambda _: None)
runs.run([(Entry("sleeper", "ddp", "c", [], {}, sys.argv[1] + "/sleeper"),
           [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(600)"])])
"""


def test_sigterm_stops_the_running_run_of_a_runner_started_with_sigint_ignored(tmp_path):
    """A runner a script starts in the background (``cmd &``) inherits SIGINT ignored, and SIGINT
    is how submitit cancels a local job: SIGTERM to the runner must still stop the running run
    (``sweep --local`` and ``compare`` run their runs so), not leave it orphaned."""
    log = tmp_path / "logs" / "sleeper.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    sleeper = None
    try:
        last = time.monotonic()
        while not (log.is_file() and log.read_text().strip()):  # the run's process is up
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() - last < QUIET_S, "the run did not start"
            time.sleep(0.2)
        sleeper = int(log.read_text().split()[0])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=QUIET_S) != 0
        assert proc.stdout.read().split() == ["RUNNING", "CANCELLED"]
        stopping = time.monotonic()
        while pid_alive(sleeper) and time.monotonic() - stopping < QUIET_S:
            time.sleep(0.1)
        assert not pid_alive(sleeper), "the run outlived the runner"
    finally:
        for pid in (proc.pid, sleeper):
            if pid is not None and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_cancel_while_a_runs_launcher_starts_is_held_until_it_has_started(tmp_path, monkeypatch):
    """submitit cancels with SIGINT; one that arrives inside ``Popen`` would leave the launcher
    running (its own session) with no handle to stop it. ``run_command`` holds it until the
    launcher has started, then stops the launcher's session and re-raises."""
    from muloco.launch.sweeps import local_runs

    marker = str(tmp_path / "launcher")  # names the stand-in launcher on its command line, for pgrep
    real_popen = subprocess.Popen

    def popen_interrupted(*args, **kwargs):  # the cancel lands while the child is being started
        proc = real_popen(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return proc

    cmd = [sys.executable, "-c", f"import time; time.sleep(600)  # {marker}"]
    before = signal.getsignal(signal.SIGINT)  # an xdist worker ignores SIGINT; a plain pytest raises
    with monkeypatch.context() as patched:
        patched.setattr(subprocess, "Popen", popen_interrupted)
        with pytest.raises(KeyboardInterrupt):
            local_runs.run_command(cmd, str(tmp_path / "log"))
    assert signal.getsignal(signal.SIGINT) is before  # put back
    leftovers = [
        int(pid) for pid in subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    ]
    for pid in leftovers:  # by PID, so a failure here leaves nothing running either
        os.kill(pid, signal.SIGKILL)
    assert not leftovers, f"the launcher was left running: {leftovers}"
