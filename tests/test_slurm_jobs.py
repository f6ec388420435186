"""Generated SLURM jobs on a real single-node SLURM on localhost (the ``slurm`` fixture).

Every job trains the tiny flavor on CPU through the same commands users run:
``python -m muloco.launch.slurm KIND ...`` and ``python jobs/sweeps/tiny_cpu.py ...``. Jobs are
submitted early and waited for late, so their start-up overlaps.
"""

from __future__ import annotations

import json
import math
import os
import re
import runpy
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, read_metrics, watch
from drill_train import open_gate, release
from progress import JOB_QUIET_S, FolderProgress, until
from replicas import syncs

pytestmark = pytest.mark.timeout(1800)  # hang timeouts only: the suite may share the machine with others

CPU = ["--gpus-per-node", "0", "--time", "15"]


def generate(*args: str, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m muloco.launch.slurm ARGS`` as a user runs it, from ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "muloco.launch.slurm", *args],
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def submitted(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """{script file name: job id} from the generator's output."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = {}
    for line in proc.stdout.splitlines():
        if line.startswith("submitted "):
            path, job = line[len("submitted ") :].split(" as job ")
            ids[Path(path).name] = job
    return ids


def final(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def wait_done(slurm, job: str, run: Path) -> str:
    """Wait for a job whose run writes under ``run``; a job that stops writing there is hung."""
    states = slurm.wait_jobs_done([job], progress=FolderProgress(JOB_QUIET_S, run))
    state = states[job] if job in states else next(iter(states.values()))
    if state != "COMPLETED":
        logs = "\n".join(
            f"== {p}\n{p.read_text()[-3000:]}" for p in sorted(run.rglob("*.out")) + sorted(run.rglob("*.log"))
        )
        pytest.fail(f"job {job} ended {state}\n{logs}\n{slurm.logs()}")
    return state


@pytest.fixture(autouse=True)
def _cancel_jobs_the_test_left(slurm):
    """A failed test's jobs would hold the node (and change the queue) for the tests after it:
    whatever a test submitted and left queued or running is cancelled when it ends. The module's
    ``jobs`` fixture submits first (module fixtures are set up before function ones): they stay."""
    before = slurm.job_ids(ended_too=True)
    yield
    slurm.cancel(slurm.job_ids() - before)


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):
    """Submit the DDP (diffusion, Muon) job and the K=2 MuLoCo 2-bit job at once; tests wait for
    the ones they need. The DDP job is also the uninterrupted twin of the requeue test's run."""
    root = tmp_path_factory.mktemp("jobs")
    out = {"root": root}
    out["ddp"] = root / "ddp"
    out["ddp_ids"] = submitted(
        generate(
            "ddp",
            "--config",
            REQUEUE_CONFIG,
            *CPU,
            "--cpus-per-node",
            "1",
            "--",
            *REQUEUE_RUN,
            "--dump_folder",
            str(out["ddp"]),
            cwd=root,
        )
    )
    out["k2"] = root / UNSAFE_FOLDER  # spaces, quotes, % and $(...) in the job name and run folder
    out["k2_ids"] = submitted(
        generate(
            "groups",
            "--config",
            "diloco/muloco_2bit",
            "--replicas",
            "2",
            *CPU,
            "--job-name",
            UNSAFE_NAME,
            "--cpus-per-node",
            "2",
            "--",
            *TINY,
            "--training.steps",
            "10",
            "--outer.sync_every",
            "5",
            "--dump_folder",
            str(out["k2"]),
            cwd=root,
        )
    )
    return out


UNSAFE_NAME = 'k2 it\'s "2-bit" #1 $(touch name-ran)'
UNSAFE_FOLDER = 'k2 run\'s "50%" $(touch ran)'
ARRAY_STEPS = 60
ARRAY_HOLD = 30
REQUEUE_CONFIG = "diffusion/ddp_muon"
REQUEUE_RUN = [
    *TINY,
    "--training.steps",
    "60",
    "--checkpoint.interval",
    "10",
    "--metrics.log_freq",
    "10",
    "--validator.freq",
    "1000",
]


def test_ddp_diffusion_job_runs_to_completion_under_slurm(slurm, jobs):
    run, job = jobs["ddp"], jobs["ddp_ids"]["job.sh"]
    wait_done(slurm, job, run)
    summary = final(run)
    assert summary["objective"] == "mdlm" and summary["steps"] == 60
    assert math.isfinite(summary["final_validation_loss"]) and math.isfinite(summary["final_train_loss"])
    assert (run / "slurm" / "job.sh").is_file()
    assert list((run / "slurm").glob(f"*-{job}.out")), "the job's own log is in <run>/slurm/"


def test_k2_muloco_2bit_job_runs_to_completion_under_slurm(slurm, jobs):
    run, job = jobs["k2"], jobs["k2_ids"]["job.sh"]
    wait_done(slurm, job, run)
    a, b = final(run / "replica_0"), final(run / "replica_1")
    assert a["steps"] == b["steps"] == 10
    assert a["diloco"]["final_global_sha256"] == b["diloco"]["final_global_sha256"]
    assert a["final_validation_loss"] == b["final_validation_loss"]
    assert a["diloco"]["payload_bits_per_parameter"] < 2.5  # 2-bit codec with its block metadata
    assert (run / "logs" / "replica_0.log").is_file() and (run / "logs" / "replica_1.log").is_file()
    # the name and folder reached SLURM and the shell as text (the log is named %x-%j.out: the name
    # came back whole, the folder's % stayed a %), and nothing in them was executed
    assert (run / "slurm" / f"{UNSAFE_NAME}-{job}.out").is_file(), sorted(p.name for p in (run / "slurm").iterdir())
    assert not [p for p in jobs["root"].rglob("*") if p.name in ("ran", "name-ran")]
    assert not (REPO / "ran").exists() and not (REPO / "name-ran").exists()


def _complete_checkpoints(run: Path) -> list[int]:
    folder = run / "checkpoint"
    if not folder.is_dir():
        return []
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("step-*") if (p / ".muloco-checksums.json").exists())


def test_requeued_job_resumes_from_its_checkpoint_with_the_uninterrupted_final_loss(slurm, jobs):
    """``scancel --signal=USR1 --batch`` is what SLURM sends before the time limit: the script asks
    the run to stop, the run writes a checkpoint at the step it stands at (15, where the periodic
    ones are every 10) and exits, the script requeues the job, which resumes from that checkpoint:
    no more than the step in progress is lost. A diffusion run: its noise stream must resume
    exactly too."""
    run = jobs["root"] / "requeued"
    drills = jobs["root"] / "requeued-drills"  # the run holds after step 15 until requeued: it cannot end first
    job = submitted(
        generate(
            "ddp",
            "--config",
            REQUEUE_CONFIG,
            *CPU,
            "--cpus-per-node",
            "1",
            "--",
            *REQUEUE_RUN,
            "--dump_folder",
            str(run),
            cwd=jobs["root"],
            env=_drill_env(drills, "hold:0:15"),
        )
    )["job.sh"]
    progress = FolderProgress(JOB_QUIET_S, run, drills)
    while not ((drills / "hold-r0-15").exists() and _complete_checkpoints(run)):
        assert not progress.expired(), f"the run did not reach step 15 in {run} ({progress})\n{slurm.logs()}"
        assert slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), slurm.job_state(job)
        time.sleep(0.2)
    assert _complete_checkpoints(run) == [10]  # held at 15: the step-10 checkpoint is the newest
    slurm.run(["scancel", "--signal=USR1", "--batch", job])
    _wait_for("the script to ask the run to stop", lambda: (run / "slurm" / f"stop-{job}").exists(), progress, slurm)
    release(drills, 0, 15)  # the held step ends; the run sees the request before step 16
    wait_done(slurm, job, run)
    out = next((run / "slurm").glob(f"*-{job}.out")).read_text()
    requeued = out.index("requeueing job")
    assert "the run checkpoints and stops" in out[:requeued] and "(stopped with a checkpoint (exit" in out
    assert "stopped on request at step 15 with a checkpoint" in out[:requeued]
    assert f"Loading the checkpoint from {run / 'checkpoint' / 'step-15'}" in out[requeued:], out[requeued:][-3000:]
    assert "Restarts=1" in slurm.run(["scontrol", "show", "job", job]).stdout
    twin = jobs["ddp"]  # the same run, never interrupted
    wait_done(slurm, jobs["ddp_ids"]["job.sh"], twin)
    assert final(run)["final_validation_loss"] == pytest.approx(final(twin)["final_validation_loss"], rel=1e-6)
    assert final(run)["final_train_loss"] == pytest.approx(final(twin)["final_train_loss"], rel=1e-6)
    last = {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}  # the resumed leg's, last per step
    want = {r["step"]: r["loss"] for r in read_metrics(twin) if "loss" in r}
    assert last.keys() == want.keys() and all(last[s] == pytest.approx(want[s], abs=1e-6) for s in want)


def _drill_env(folder: Path, drills: str) -> dict:
    """Environment for a job whose ranks run test drills (tests/drill_train.py) through
    tests/drill_site's sitecustomize: the job inherits it from the generator's sbatch."""
    folder.mkdir(parents=True, exist_ok=True)
    path = [str(REPO / "tests" / "drill_site"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), "MULOCO_TEST_DRILLS": drills, "MULOCO_TEST_DRILL_DIR": str(folder)}


def _wait_for(what: str, done, progress: FolderProgress, slurm, poll: float = 0.2) -> None:
    """Wait for an event of a job's run; fail naming it once the run stops making ``progress``."""
    until(what, done, poll=poll, detail=slurm.logs, progress=progress)


def test_array_layout_a_requeued_group_heals_while_the_other_keeps_training(slurm, jobs):
    """Each replica group its own array task: requeueing group 1's task stops only group 1;
    group 0 trains on (a quorum of 1 lets it commit alone), and group 1 heals from it mid-run.

    The test sets the order instead of assuming speeds: group 1's requeued task waits before it
    builds its trainer (a gate drill) until group 0, having committed syncs alone, holds after
    step ARRAY_HOLD (heartbeating, in no quorum); group 1 then starts behind, and group 0 is let
    go once group 1 says so: group 1 heals at group 0's next sync whatever the speed of training,
    of SLURM's requeue, or of the moment the requeue lands (before or after a sync commits).
    Group 1's first leg holds after step 5 until the requeue ends it: under load SLURM's requeue
    took longer than both groups' 25 steps to group 0's hold, and no sync was alone."""
    run = jobs["root"] / "array"
    drills = jobs["root"] / "array-drills"
    ids = submitted(
        generate(
            "array",
            "--config",
            "diloco/muloco_2bit",
            "--replicas",
            "2",
            *CPU,
            "--cpus-per-node",
            "1",
            "--",
            *TINY,
            "--training.steps",
            str(ARRAY_STEPS),
            "--outer.sync_every",
            "5",
            "--fault_tolerance.min_replica_size",
            "1",
            "--checkpoint.interval",
            "1000",
            "--metrics.log_freq",
            "5",
            "--validator.freq",
            "1000",
            "--dump_folder",
            str(run),
            cwd=jobs["root"],
            env=_drill_env(drills, f"hold:0:{ARRAY_HOLD},hold:1:5,gate:1:1"),
        )
    )
    array, lighthouse = ids["groups.sh"], ids["lighthouse.sh"]
    progress = FolderProgress(JOB_QUIET_S, run, drills)
    log1 = run / "logs" / "replica_1.log"

    def steps(replica: int) -> int:
        try:
            return max((r["step"] for r in read_metrics(run / f"replica_{replica}") if "loss" in r), default=0)
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    try:
        # group 1's first leg holds after step 5 until the requeue ends it (one-shot: its requeued
        # leg does not hold), so group 0's next syncs come after it is gone, however slowly it goes
        _wait_for("group 1 did not hold after step 5", lambda: (drills / "hold-r1-5").exists(), progress, slurm)
        slurm.run(["scontrol", "requeue", f"{array}_1"])
        _wait_for(
            "group 1's task was not requeued",
            lambda: slurm.job_state(f"{array}_1") not in ("RUNNING", "COMPLETING"),
            progress,
            slurm,
            0.1,
        )
        first_leg = len(log1.read_text())
        _wait_for(
            f"group 0 did not reach its hold at step {ARRAY_HOLD}",
            lambda: (drills / f"hold-r0-{ARRAY_HOLD}").exists(),
            progress,
            slurm,
        )
        _wait_for(
            "group 1's requeued task did not reach its gate", lambda: (drills / "gate-r1-1").exists(), progress, slurm
        )
        open_gate(drills, 1, 1)
        _wait_for(
            "group 1's requeued task did not come back behind its peer",
            lambda: "this replica group is behind" in log1.read_text()[first_leg:],
            progress,
            slurm,
        )
    except BaseException:
        slurm.run(["scancel", array, lighthouse], check=False)  # group 0 would hold until the job's time limit
        raise
    release(drills, 0, ARRAY_HOLD)
    for task in ("0", "1"):
        wait_done(slurm, f"{array}_{task}", run)
    slurm.wait_jobs_done([lighthouse], timeout=60)
    a, b = final(run / "replica_0"), final(run / "replica_1")
    assert a["diloco"]["final_global_sha256"] == b["diloco"]["final_global_sha256"]
    assert a["steps"] == b["steps"] == ARRAY_STEPS
    alone = [r for r in syncs(run, 0) if r["committed"] and r["participants"] == 1]
    assert alone, "group 0 committed no sync alone while group 1 was requeued"
    assert b["diloco"]["healed_from"] == [0] and a["diloco"]["healed_from"] == []
    healed = re.search(r"healed from replica 0 in quorum \d+: step \d+ -> (\d+)", log1.read_text()[first_leg:])
    assert healed and ARRAY_HOLD < int(healed.group(1)) < ARRAY_STEPS, "group 1 healed mid-run and trained on"
    assert "healed from replica" not in (run / "logs" / "replica_0.log").read_text()
    assert (run / "slurm" / f"lighthouse-{array}.url").read_text().startswith("http://")


MOVE_STEPS = 30
MOVE_HOLD = 12


def _stamp(path: Path) -> tuple[int, int]:
    """Which file ``path`` is: its inode alone is not enough, since the requeued lighthouse deletes
    the old file as it starts and its new one may get the freed inode number."""
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def test_array_layout_groups_follow_a_requeued_lighthouse_to_its_new_address_and_lose_nothing(slurm, tmp_path):
    """The lighthouse job is requeued mid-run and comes back on a new port (a new URL in its
    file); both groups, held between syncs meanwhile (test drills, so the order does not depend
    on speed), reach it through their relays at their next sync: every sync commits with both
    groups, nobody restarts or heals, and the run ends with both replicas bitwise equal."""
    run = tmp_path / "moved"
    drills = tmp_path / "moved-drills"
    ids = submitted(
        generate(
            "array",
            "--config",
            "diloco/muloco",
            "--replicas",
            "2",
            *CPU,
            "--cpus-per-node",
            "1",
            "--",
            *TINY,
            "--training.steps",
            str(MOVE_STEPS),
            "--outer.sync_every",
            "5",
            "--checkpoint.interval",
            "1000",
            "--metrics.log_freq",
            "5",
            "--validator.freq",
            "1000",
            "--dump_folder",
            str(run),
            cwd=tmp_path,
            env=_drill_env(drills, f"hold:0:{MOVE_HOLD},hold:1:{MOVE_HOLD}"),
        )
    )
    array, lighthouse = ids["groups.sh"], ids["lighthouse.sh"]
    url_file = run / "slurm" / f"lighthouse-{array}.url"
    progress = FolderProgress(JOB_QUIET_S, run, drills)
    try:
        for r in (0, 1):
            _wait_for(
                f"group {r} did not reach its hold at step {MOVE_HOLD}",
                lambda r=r: (drills / f"hold-r{r}-{MOVE_HOLD}").exists(),
                progress,
                slurm,
            )
        first, first_file = url_file.read_text().strip(), _stamp(url_file)
        slurm.run(["scontrol", "requeue", lighthouse])

        def moved() -> bool:  # a new file (the lighthouse writes it by rename), whatever port it got
            try:
                return _stamp(url_file) != first_file and url_file.read_text().strip() != ""
            except FileNotFoundError:
                return False

        _wait_for("the requeued lighthouse did not come back with a new URL", moved, progress, slurm)
    except BaseException:
        slurm.run(["scancel", array, lighthouse], check=False)  # the groups would hold until their time limit
        raise
    for r in (0, 1):
        release(drills, r, MOVE_HOLD)
    for task in ("0", "1"):
        wait_done(slurm, f"{array}_{task}", run)
    slurm.wait_jobs_done([lighthouse], timeout=60)
    a, b = final(run / "replica_0"), final(run / "replica_1")
    assert a["diloco"]["final_global_sha256"] == b["diloco"]["final_global_sha256"]
    assert a["steps"] == b["steps"] == MOVE_STEPS
    assert a["diloco"]["healed_from"] == b["diloco"]["healed_from"] == []
    for r in (0, 1):
        records = syncs(run, r)
        assert len(records) >= MOVE_STEPS // 5 and all(x["committed"] and x["participants"] == 2 for x in records)
        log = (run / "logs" / f"replica_{r}.log").read_text()
        assert "[muloco] rank" not in log, log[-3000:]  # no rank failed (and none was restarted)
        reached = re.findall(r"relay: connected to the lighthouse at (\S+)", log)
        assert reached, log[-3000:]  # then the syncs after the move committed through the new one
    assert url_file.read_text().strip().startswith("http://") and first.startswith("http://")


def sweep(*args: str, cwd: Path, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "jobs" / "sweeps" / "tiny_cpu.py"), *args],
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def manifest(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "manifest.jsonl").read_text().splitlines()]


def test_two_run_sweep_runs_as_an_array_resubmits_its_failure_within_max_nodes_and_is_reported(slurm, tmp_path):
    folder, drills = tmp_path / "sweep", tmp_path / "drills"
    # each array task holds after step 4 in its own drill folder; task 0's hold is released in advance,
    # task 1 holds until it is cancelled: the cancel lands while run 1 trains, however fast it trains
    (drills / "task-0").mkdir(parents=True)
    release(drills / "task-0", 0, 4)
    env = _drill_env(drills, "hold:0:4") | {"MULOCO_TEST_DRILL_DIR": f"{drills}/task-$SLURM_ARRAY_TASK_ID"}
    proc = sweep(
        "--out", str(folder), *CPU, "--cpus-per-node", "1", "--parallel", "2", "--retries", "0", cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "as job array" in proc.stdout
    entries = manifest(folder)
    assert len(entries) == 2 and len({e["jobs"][0].split("_")[0] for e in entries}) == 1
    progress = FolderProgress(JOB_QUIET_S, folder, drills)
    _wait_for("run 1 did not hold after step 4", (drills / "task-1" / "hold-r0-4").exists, progress, slurm)
    slurm.run(["scancel", entries[1]["jobs"][0]])  # one run fails (cancelled)
    release(drills / "task-1", 0, 4)
    slurm.wait_jobs_done([e["jobs"][0] for e in entries], progress=progress)
    status = sweep("--out", str(folder), "--status", cwd=tmp_path)
    assert "COMPLETED" in status.stdout and "CANCELLED" in status.stdout, status.stdout
    again = sweep("--out", str(folder), *CPU, "--cpus-per-node", "1", cwd=tmp_path)  # resume: nothing to do
    assert again.returncode == 0 and "every run already has a job" in again.stdout
    # --max-nodes 1 while another job of ours holds the node: the resubmission waits for it
    # (the blocker runs until the sweep says it waits for it: no assumption on how fast the sweep starts)
    blocker = slurm.sbatch("--time=5", "--cpus-per-task=1", f"--output={tmp_path}/blocker.out", "--wrap", "sleep 3600")
    slurm.wait_state(blocker, ["RUNNING"], timeout=120)
    retry = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "jobs" / "sweeps" / "tiny_cpu.py"),
            "--out",
            str(folder),
            *CPU,
            "--cpus-per-node",
            "1",
            "--resubmit-failed",
            "--max-nodes",
            "1",
            "--poll-s",
            "0.5",
        ],
        cwd=tmp_path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        seen = []
        for line in retry.stdout:  # ends when the sweep exits: a sweep that never waits fails below
            seen.append(line)
            if "waiting: 1 node(s) in use" in line:
                slurm.run(["scancel", blocker])
        retry.wait(timeout=600)
    finally:
        if retry.poll() is None:
            retry.kill()
            retry.wait(timeout=60)
    out = "".join(seen)
    assert retry.returncode == 0 and out.count("submitted ") == 1, out
    assert "waiting: 1 node(s) in use" in out
    entries = manifest(folder)
    assert len(entries[0]["jobs"]) == 1 and len(entries[1]["jobs"]) == 2, "the failed run got a second job"
    info = {j: slurm.run(["scontrol", "show", "job", j]).stdout for j in (blocker, entries[1]["jobs"][1])}
    assert _field(info[entries[1]["jobs"][1]], "SubmitTime") >= _field(info[blocker], "EndTime"), (
        "--max-nodes held the submission back until the running job ended"
    )
    for e in entries:
        wait_done(slurm, e["jobs"][-1], folder)
    report = subprocess.run(
        [sys.executable, "-m", "muloco.report", str(folder)], cwd=tmp_path, text=True, capture_output=True, timeout=600
    )
    assert report.returncode == 0, report.stdout + report.stderr
    for e in entries:
        assert e["name"] in report.stdout
        assert f"{final(Path(e['run_dir']))['final_validation_loss']:.4f}" in report.stdout
    assert report.stdout.count("*") == 1, "the best run of the sweep is marked"
    pngs = sorted((folder / "report").glob("*.png"))
    assert pngs and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def _field(text: str, key: str) -> str:
    return next(t.split("=", 1)[1] for t in text.split() if t.startswith(key + "="))


def test_dry_run_submits_and_writes_nothing_and_the_scripts_hold_no_secrets(slurm, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    secret = "wandb-secret-value-123"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("HF_TOKEN", secret)
    before = slurm.job_ids(ended_too=True)
    for kind in (["groups", "--replicas", "2"], ["array", "--replicas", "2"], ["spanning", "--replicas", "1"], ["ddp"]):
        config = "ddp/adamw" if kind[0] == "ddp" else "diloco/muloco_2bit"
        status, text, err = generate_here(
            capsys, *kind, "--config", config, "--dry-run", *CPU, "--", "--training.steps", "30"
        )
        assert status == 0, err
        assert '#SBATCH --partition="debug"' in text and "dry run" in text
        assert secret not in text and "WANDB_API_KEY=" not in text
        for path in (str(REPO), str(tmp_path), str(Path.home()), sys.executable):
            assert path not in text, f"{path} is baked into the generated script"
    tiny = runpy.run_path(str(REPO / "jobs" / "sweeps" / "tiny_cpu.py"))
    assert tiny["main"](tiny["SWEEP"], ["--out", "s", "--dry-run", *CPU]) == 0
    out = capsys.readouterr().out
    assert "nothing submitted" in out and "#SBATCH --array=0-1%2" in out
    assert not list(tmp_path.iterdir()), "a dry run wrote files"
    assert not slurm.job_ids(ended_too=True) - before, "a dry run submitted a job"


def generate_here(capsys, *args: str) -> tuple[int, str, str]:
    """The generator in this process (no second torchtitan import): status, stdout, stderr."""
    from muloco.launch.slurm.jobs import main

    status = main(list(args))
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize(
    "args, message",
    [
        (["groups", "--partition", "nosuch"], "unknown partition 'nosuch': this cluster has"),
        (["groups", "--gpus-per-node", "4"], "more than the 0 GPU(s) a node of partition 'debug' has"),
        (["groups", "--replicas", "3", "--gpus-per-node", "8"], "K=3 replica groups do not divide the 8 GPUs"),
        (["groups", "--cpus-per-node", "512"], "more than the 8 CPUs"),
        (["spanning", "--replicas", "2"], "needs 2 node(s) but partition 'debug' has 1"),
        (["groups", "--time", "soon"], "time 'soon' is not a SLURM time"),
        (
            ["groups", "--partition", "short", "--time", "45"],
            "--time 45 is more than partition 'short''s MaxTime of 30",
        ),
        (["groups", "--mem", "4096G"], "--mem 4096G is more than the"),
    ],
)
def test_bad_cluster_settings_are_one_clear_error_before_anything_is_submitted(
    slurm, tmp_path, capsys, monkeypatch, args, message
):
    monkeypatch.chdir(tmp_path)
    before = slurm.job_ids(ended_too=True)
    status, _, err = generate_here(
        capsys,
        *args,
        "--config",
        "diloco/muloco_2bit",
        "--",
        "--training.steps",
        "30",
        "--dump_folder",
        str(tmp_path / "run"),
    )
    assert status == 2
    assert message in err and err.count("error:") == 1, err
    assert not (tmp_path / "run").exists()
    assert not slurm.job_ids(ended_too=True) - before, "a refused submission submitted a job"


def test_a_refused_submission_leaves_nothing_behind(slurm, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, _, err = generate_here(
        capsys,
        "array",
        "--config",
        "diloco/muloco_2bit",
        *CPU,
        "--constraint",
        "nosuchfeature",
        "--",
        "--training.steps",
        "30",
        "--dump_folder",
        str(tmp_path / "run"),
    )
    assert status == 2 and "sbatch refused" in err and err.count("error:") == 1, err
    assert not (tmp_path / "run").exists(), "the folders and scripts of a refused submission are removed"


def test_cluster_file_sets_defaults_a_flag_beats_it_and_an_unknown_key_is_refused(slurm, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cluster = tmp_path / "cluster.toml"
    monkeypatch.setenv("MULOCO_CLUSTER_FILE", str(cluster))
    cluster.write_text('partition = "long"\ntime = "00:20:00"\n[env]\nNCCL_IB_DISABLE = "1"\n')
    args = ["groups", "--config", "diloco/muloco_2bit", "--dry-run", "--gpus-per-node", "0"]
    status, out, err = generate_here(capsys, *args, "--", "--training.steps", "30")
    assert status == 0, err
    assert '#SBATCH --partition="long"' in out and '#SBATCH --time="00:20:00"' in out
    assert "export NCCL_IB_DISABLE=1" in out
    monkeypatch.setenv("MULOCO_SLURM_TIME", "00:30:00")
    status, out, err = generate_here(capsys, *args, "--partition", "debug", "--", "--training.steps", "30")
    assert '#SBATCH --partition="debug"' in out and '#SBATCH --time="00:30:00"' in out, "flag > env > file"
    cluster.write_text('partiton = "long"\n')
    status, _, err = generate_here(capsys, *args)
    assert status == 2 and "unknown cluster setting 'partiton'" in err
    cluster.write_text('[env]\nWANDB_API_KEY = "abc"\n')
    status, _, err = generate_here(capsys, *args)
    assert status == 2 and "secrets are never written into job files" in err and "abc" not in err


def test_interactive_node_scripts_run_inside_an_allocation(slurm, tmp_path):
    """jobs/ddp/run.sh and jobs/diloco/workers.sh as a user runs them in ``srun --pty``."""
    srun = ["srun", "--ntasks=1", "--time=10", "--cpus-per-task=1"]
    commands = {
        "ddp": [
            *srun,
            str(REPO / "jobs" / "ddp" / "run.sh"),
            "--config",
            "ddp/adamw",
            "--",
            *TINY,
            "--training.steps",
            "4",
            "--dump_folder",
            str(tmp_path / "ddp"),
        ],
        "k2": [
            *srun,
            str(REPO / "jobs" / "diloco" / "workers.sh"),
            "--workers",
            "2",
            "--config",
            "diloco/muloco_2bit",
            "--",
            *TINY,
            "--training.steps",
            "5",
            "--outer.sync_every",
            "5",
            "--dump_folder",
            str(tmp_path / "k2"),
        ],
    }
    env = {**os.environ, **slurm.env}
    ran = dict(zip(commands, watch(list(commands.values()), [env, env])))  # hung: silent for QUIET_S
    out = {k: r.stdout + r.stderr for k, r in ran.items()}
    assert ran["ddp"].returncode == 0, out["ddp"]
    assert "1 rank(s), config ddp/adamw" in out["ddp"] and final(tmp_path / "ddp")["steps"] == 4
    assert ran["k2"].returncode == 0, out["k2"]
    a, b = final(tmp_path / "k2" / "replica_0"), final(tmp_path / "k2" / "replica_1")
    assert a["diloco"]["final_global_sha256"] == b["diloco"]["final_global_sha256"]


@pytest.mark.parametrize(
    "kind, config, message",
    [
        (
            ["ddp"],
            "diloco/muloco_2bit",
            "the ddp kind runs one replica group; --config diloco/muloco_2bit has an outer loop",
        ),
        (
            ["array", "--replicas", "2"],
            "ddp/adamw",
            "the array kind runs DiLoCo replica groups; --config ddp/adamw has no outer loop",
        ),
    ],
)
def test_a_config_of_the_wrong_kind_is_one_error(slurm, tmp_path, capsys, monkeypatch, kind, config, message):
    monkeypatch.chdir(tmp_path)
    status, _, err = generate_here(capsys, *kind, "--config", config, *CPU, "--", "--dump_folder", str(tmp_path / "r"))
    assert status == 2 and message in err and err.count("error:") == 1, err
    assert not (tmp_path / "r").exists()
