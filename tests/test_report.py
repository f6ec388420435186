"""muloco.report on real tiny runs: the table against each run's own summary.json, the best-run
mark, the plots and text files, bad input (exit 2), and a live run's half-written last line."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO, TINY, run_train, run_watched

from muloco import compat
from muloco.report import __main__ as cli  # noqa: E402
from muloco.report import plots, runs, tables  # noqa: E402

compat.apply()
from muloco.config import load_config  # noqa: E402
from muloco.runs.facts import facts_of  # noqa: E402

MULOCO_2BIT_FACTS = facts_of(load_config("diloco/muloco_2bit"))

QUICK = [
    *TINY,
    "--training.steps",
    "12",
    "--validator.freq",
    "4",
    "--metrics.log_freq",
    "2",
    "--checkpoint.no-enable",
    "--metrics.no-enable-tensorboard",
]
# folder -> (name in the manifest or None, config, overrides)
RUNS = {
    "lr_low": ("adamw lr 1e-3", "ddp/adamw", ["--optimizer.lr", "1e-3"]),
    "lr_high": ("adamw lr 1e-2", "ddp/adamw", ["--optimizer.lr", "1e-2"]),
    "diffusion": (None, "diffusion/ddp_adamw", []),
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A sweep folder with three real runs (two at a time: the machine has 2 cores) and a
    manifest naming two of them."""
    root = tmp_path_factory.mktemp("sweep")

    def train(folder: str):
        _, config, overrides = RUNS[folder]
        return run_train(["--config", config, *QUICK, *overrides, "--dump_folder", str(root / folder)])

    with ThreadPoolExecutor(max_workers=2) as pool:
        for folder, proc in zip(RUNS, pool.map(train, RUNS)):
            assert proc.returncode == 0, f"{folder}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    lines = [
        {"name": name, "overrides": [*overrides, "--dump_folder", str(root / folder)]}
        for folder, (name, _, overrides) in RUNS.items()
        if name
    ]
    (root / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def parse_table(text: str) -> dict[str, tuple[bool, dict[str, str]]]:
    """{run name: (marked best, {column: cell})} from the printed table."""
    lines = [line for line in text.splitlines() if line and not line.startswith("wrote ")]
    header = ["run", *re.split(r"\s{2,}", lines[0].strip())[1:]]
    rows = {}
    for line in lines[2:]:
        cells = re.split(r"\s{2,}", line[1:].strip())
        rows[cells[0]] = (line.startswith("*"), dict(zip(header, cells)))
    return rows


def label(folder: str) -> str:
    return RUNS[folder][0] or folder


@pytest.fixture(scope="module")
def printed(sweep):
    """One report of the sweep into its default folder: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main([str(sweep)])
    return status, out.getvalue(), err.getvalue()


def test_table_rows_match_each_runs_summary(sweep, printed):
    status, out, _ = printed
    assert status == 0
    rows = parse_table(out)
    assert set(rows) == {label(f) for f in RUNS}
    for folder in RUNS:
        s, (_, row) = summary(sweep / folder), rows[label(folder)]
        validation = s.get("final_validation_nelbo", s["final_validation_loss"])
        assert float(row["val loss"]) == pytest.approx(validation, abs=5e-5)
        assert float(row["val bits/byte"]) == pytest.approx(s["final_validation_bits_per_byte"], abs=5e-5)
        assert float(row["train loss"]) == pytest.approx(s["final_train_loss"], abs=5e-5)
        assert int(row["steps"]) == s["steps"] == 12
        assert int(row["tokens"].replace(",", "")) == s["tokens_seen"]
        assert row["obj"] == s["objective"]
        assert row["method"] == "ddp-adamw"
        assert row["wall"] == f"{s['wall_seconds']:.1f}s"
        assert (row["bits/param"], row["sent/replica"], row["sync"]) == ("-", "-", "-")  # one group: no syncs
    assert rows["diffusion"][1]["obj"] == "mdlm"


def test_best_run_per_method_is_marked(sweep, printed):
    rows = parse_table(printed[1])
    losses = {f: summary(sweep / f)["final_validation_loss"] for f in ("lr_low", "lr_high")}
    winner = min(losses, key=losses.get)
    assert [f for f in RUNS if rows[label(f)][0]] == [winner]  # the lone mdlm run is not "best" of anything
    order = list(rows)
    assert order.index(label(winner)) < order.index(label(max(losses, key=losses.get)))  # sorted by loss


def test_outputs_are_the_report_files_only(sweep, printed):
    out = sweep / "report"
    assert sorted(p.name for p in out.iterdir()) == sorted(cli.REPORT_FILES)
    for name in cli.REPORT_FILES[:3]:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    assert "left out 3 run(s) without byte counts" in printed[2]
    rows = {r["name"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    for folder in RUNS:
        s, row = summary(sweep / folder), rows[label(folder)]
        assert row["final_validation_loss"] == s["final_validation_loss"]
        assert row["final_validation_bits_per_byte"] == s["final_validation_bits_per_byte"]
        assert (row["steps"], row["tokens"], row["wall_seconds"]) == (s["steps"], s["tokens_seen"], s["wall_seconds"])
    md = (out / "report.md").read_text()
    assert all(f"| {label(f)} | ddp-adamw |" in md for f in RUNS)


def test_missing_path_and_folder_without_runs_are_exit_2(tmp_path, capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("muloco report: error: give one or more run or sweep folders") and "\n" not in err
    assert cli.main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"muloco report: error: {tmp_path / 'nope'}: no such file or folder") and "\n" not in err
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert cli.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"muloco report: error: {tmp_path / 'empty'}: no runs found") and "--dump_folder" in err
    assert not (tmp_path / "empty" / "report").exists()


def test_malformed_line_names_file_and_line(sweep, tmp_path, capsys):
    run = shutil.copytree(sweep / "lr_low", tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = "{not json\n"
    (run / "metrics.jsonl").write_text("".join(lines))
    assert cli.main([str(run)]) == 2
    assert f"{run / 'metrics.jsonl'}:3: not valid JSON" in capsys.readouterr().err
    (run / "summary.json").write_text('{"steps": 12,\n')
    assert cli.main([str(run)]) == 2
    assert f"{run / 'summary.json'}:2: not valid JSON" in capsys.readouterr().err


def test_live_runs_partial_last_line_is_skipped(sweep, tmp_path, capsys):
    run = shutil.copytree(sweep / "lr_high", tmp_path / "live")
    (run / "summary.json").unlink()
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text[:-30])  # the writer died mid-line
    assert cli.main([str(run), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    n = len(text.splitlines())
    assert f"warning: {run / 'metrics.jsonl'}:{n}: skipped a partial last line" in err
    _, row = parse_table(out)["live (no summary)"]
    kept = [json.loads(line) for line in text.splitlines()[:-1]]
    assert int(row["steps"]) == max(r["step"] for r in kept)
    assert float(row["val loss"]) == pytest.approx(
        [r for r in kept if "validation_loss" in r][-1]["validation_loss"], abs=5e-5
    )
    assert row["wall"] == "-"


def test_diloco_job_folder_is_one_run(sweep, tmp_path):
    """A DiLoCo job's replica_<i>/ folders read as one run: tokens summed, bytes and bits from
    the syncs, the method from the facts in run.json. The replicas are a real run's files with
    sync records and a K=2 MuLoCo config's facts added (a real K=2 job is trained below)."""
    job = tmp_path / "job"
    sent = [(4, 1000), (8, 1000), (12, 1000)]
    for i in range(2):
        rep = shutil.copytree(sweep / "lr_low", job / f"replica_{i}")
        run_json = json.loads((rep / "run.json").read_text())
        (rep / "run.json").write_text(json.dumps({**run_json, "facts": MULOCO_2BIT_FACTS}))
        with open(rep / "metrics.jsonl", "a") as f:
            for step, n in sent:
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "sync/bytes_sent": n + i,
                            "sync/payload_bytes": n,
                            "sync/numel": 4000,
                            "sync/fragment": 0,
                        }
                    )
                    + "\n"
                )
        s = summary(rep)
        s["diloco"] = {
            "bytes_sent": 3000 + 3 * i,
            "payload_bits_per_parameter": 2.0,
            "exchange": "quantize(statistical, 2b, block 4096, R 3.93σ), error feedback β=0.9",
            "sync_share_of_wall_time": 0.1 * (i + 1),
        }
        (rep / "summary.json").write_text(json.dumps(s))
    run = runs.find_runs([job])[0]
    one = summary(sweep / "lr_low")
    assert (run.name, run.method, run.objective, run.replicas) == ("job", "muloco-2bit", "ar", 2)
    assert run.tokens == 2 * one["tokens_seen"]
    assert run.bytes_sent_per_replica == pytest.approx(3001.5) and run.bits_per_parameter == 2.0
    assert run.sync_share == pytest.approx(0.15)
    assert list(run.sync_steps) == [4, 8, 12] and list(run.sync_bytes) == pytest.approx([1000.5, 2001, 3001.5])
    assert "job" in tables.table([run]) and plots.without_bytes([run]) == []
    # against bytes the train line starts at the first sync: no segment from "0 bytes" (nothing was sent then)
    x, y = plots._train_xy(run, "bytes")
    assert list(x) == pytest.approx([1000.5, 2001, 3001.5]) and len(y) == 3
    assert plots.write_plots([run], tmp_path / "plots")[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_runs_bytes_count_every_process_and_a_redone_sync_once(sweep, tmp_path):
    """A run restarted from its step-8 checkpoint: its summary (the last process's) counts the one
    sync that process made; metrics.jsonl holds all of them, the sync at 12 twice (made, lost
    with the first process, made again): the table counts three syncs."""
    rep = shutil.copytree(sweep / "lr_low", tmp_path / "job" / "replica_0")
    run_json = json.loads((rep / "run.json").read_text())
    (rep / "run.json").write_text(json.dumps({**run_json, "facts": MULOCO_2BIT_FACTS}))
    with open(rep / "metrics.jsonl", "a") as f:
        for step in (4, 8, 12, 12):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "sync/bytes_sent": 1000,
                        "sync/payload_bytes": 250,
                        "sync/numel": 1000,
                        "sync/fragment": 0,
                    }
                )
                + "\n"
            )
    s = summary(rep)
    s["diloco"] = {"bytes_sent": 1000, "payload_bits_per_parameter": 2.0, "sync_share_of_wall_time": 0.1}
    (rep / "summary.json").write_text(json.dumps(s))
    run = runs.find_runs([tmp_path / "job"])[0]
    assert run.bytes_sent_per_replica == 3000 and run.bits_per_parameter == 2.0 and run.sync_share == 0.1


def test_an_older_run_without_facts_is_reported_with_them_named_not_guessed(sweep, tmp_path, capsys):
    """A run.json from before facts were recorded: the method is '?', and a warning names the
    missing facts, whatever the config module or folder is called."""
    run = shutil.copytree(sweep / "lr_low", tmp_path / "diloco-muloco_2bit-K2")
    record = json.loads((run / "run.json").read_text())
    del record["facts"]
    (run / "run.json").write_text(json.dumps({**record, "config": "/x/config/diloco/muloco_2bit.py"}))
    assert cli.main([str(run), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    _, row = parse_table(out)["diloco-muloco_2bit-K2"]
    assert row["method"] == "?" and row["obj"] == "ar"  # the objective is in the summary: recorded, not guessed
    assert f"warning: {run}: run.json records no method, objective, model, inner_optimizer, outer" in err


NEUTRAL_MODULE = """from muloco.config import load_config


def config():
    return load_config("diloco/muloco_2bit")
"""


def test_a_neutrally_named_muloco_run_is_named_by_its_facts_after_its_folder_is_renamed(tmp_path, capsys):
    """A config module ``exp_a.py`` (MuLoCo 2-bit inside, nothing in its name says so) trained as a
    real K=2 job; its folder renamed to something misleading; the report still says muloco-2bit."""
    module = tmp_path / "exp_a.py"
    module.write_text(NEUTRAL_MODULE)
    folder = tmp_path / "first-name"
    proc = run_watched(
        [
            sys.executable,
            "-m",
            "muloco.launch.local",
            "--config",
            str(module),
            "--replicas",
            "2",
            "--",
            *TINY,
            "--training.steps",
            "10",
            "--outer.sync_every",
            "5",
            "--validator.freq",
            "5",
            "--checkpoint.no-enable",
            "--metrics.no-enable-tensorboard",
            "--dump_folder",
            str(folder),
        ],
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    renamed = folder.rename(tmp_path / "ddp-adamw-baseline")
    assert cli.main([str(renamed), "--out", str(tmp_path / "report")]) == 0
    out, _ = capsys.readouterr()
    print(out)  # the closing note of the issue quotes it
    _, row = parse_table(out)["ddp-adamw-baseline"]
    assert (row["method"], row["obj"]) == ("muloco-2bit", "ar")
    assert float(row["bits/param"]) < 2.5
    facts = json.loads((tmp_path / "report" / "report.json").read_text())["rows"][0]["facts"]
    assert facts["inner_optimizer"]["name"] == "Muon" and facts["outer"]["replica_groups"] == 2
    assert facts["outer"]["codec"]["name"] == "quantize" and facts["outer"]["codec"]["bits"] == 2
    assert facts["outer"]["error_feedback"]["enabled"] and facts["model"]["parameters"] > 0


def test_the_report_imports_no_torch_and_no_tyro():
    """Reading results needs neither: the report starts at once, on any machine that has the runs."""
    code = "import sys, muloco.report.__main__; assert not {'torch', 'tyro'} & set(sys.modules), sorted(sys.modules)"
    proc = run_watched([sys.executable, "-c", code], cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_times_of_a_run_over_an_emulated_link_say_so():
    """A run with ``--outer.link.mbps`` (its facts say so): its sync share and wall time include the
    emulated link's waits, and the table marks both."""
    over_link = runs.Run(
        folder=Path("a"),
        name="a",
        method="muloco",
        objective="ar",
        sync_share=0.25,
        wall_seconds=65.0,
        facts={"outer": {"link": {"mbps": 100.0, "latency_ms": 0.0}}},
    )
    real = runs.Run(
        folder=Path("b"),
        name="b",
        method="muloco",
        objective="ar",
        sync_share=0.05,
        wall_seconds=60.0,
        facts={"outer": {"link": None}},
    )
    text = tables.table([over_link, real])
    line_a = next(line for line in text.splitlines() if line.lstrip("* ").startswith("a "))
    line_b = next(line for line in text.splitlines() if line.lstrip("* ").startswith("b "))
    assert line_a.count("(emulated 100 Mbps link)") == 2 and "emulated" not in line_b


def _deadline_sync(step: int, progress: float, steps: int, committed: bool = True, healed_from=None) -> dict:
    return {
        "step": step,
        "sync/bytes_sent": 100,
        "sync/payload_bytes": 25,
        "sync/numel": 100,
        "sync/fragment": 0,
        "sync/progress": progress,
        "sync/round_steps": steps,
        "sync/tokens": 10 * steps,
        "sync/committed": committed,
        "sync/healed_from": healed_from,
    }


def test_deadline_rounds_are_counted_on_each_group_s_current_timeline(tmp_path):
    """Deadline rounds, two groups, by hand. Group 0: a failed sync, then a restart from its step-4
    checkpoint whose redone round ends at step 10, not 12 (the budgets follow paces measured again):
    the abandoned step-12 round is not counted and the failed sync adds no step and no point of its
    own. Group 1: killed, restarted without a checkpoint, and healed from a peer at its step 10; it
    logged no train loss (the curves leave it out instead of failing)."""
    job = tmp_path / "job"
    records = [
        [
            {"step": 0, "session_start": True},
            {"step": 2, "loss": 5.0, "n_tokens_seen": 20},
            _deadline_sync(4, 4.0, 4),
            {"step": 8, "loss": 4.0, "n_tokens_seen": 80},
            _deadline_sync(8, 4.0, 4, committed=False),
            _deadline_sync(12, 8.0, 4),
            {"step": 4, "session_start": True},
            {"step": 6, "loss": 4.5, "n_tokens_seen": 60},
            {"step": 8, "loss": 4.2, "n_tokens_seen": 80},
            _deadline_sync(10, 7.0, 6),
            _deadline_sync(16, 11.0, 6),
            {"step": 16, "validation_loss": 3.0},
        ],
        [
            {"step": 0, "session_start": True},
            _deadline_sync(4, 4.0, 4),
            {"step": 0, "session_start": True},
            _deadline_sync(10, 7.0, 0, healed_from=0),
            _deadline_sync(12, 11.0, 2),
            {"step": 12, "validation_loss": 3.0},
        ],
    ]
    for i, rows in enumerate(records):
        (job / f"replica_{i}").mkdir(parents=True)
        (job / f"replica_{i}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = runs.load_run(job)
    assert run.rounds == {
        "progress": 11.0,
        "groups": [
            {"group": 0, "rounds": 3, "steps": 16, "min_steps": 4, "max_steps": 6, "tokens_per_rank": 160.0},
            {"group": 1, "rounds": 2, "steps": 6, "min_steps": 2, "max_steps": 4, "tokens_per_rank": 60.0},
        ],
    }
    assert run.val_steps.tolist() == [11.0] and run.val_loss.tolist() == [3.0]
    assert run.train_steps.tolist() == [2.0, 5.0, 6.0]  # group 0's steps 2, 6 and 8: 4 + 2/6 and 4/6 of 3
    assert run.train_loss.tolist() == [5.0, 4.5, 4.2]  # the restarted process's step 8, not the first's
    # every sync sent its bytes, the abandoned one at step 12 too (at group 0's progress 7 + 2/6 of 4)
    assert run.sync_steps.tolist() == pytest.approx([4.0, 6.0, 7.0, 25 / 3, 11.0])
    assert run.sync_bytes.tolist() == [100.0, 150.0, 250.0, 300.0, 400.0] and run.bytes_sent_per_replica == 400
    assert tables.rounds_lines([run]) == [
        "job: deadline rounds, 11 nominal steps; group 0: 16 steps in 3 rounds (4-6 per round), 160 tokens per rank; "
        "group 1: 6 steps in 2 rounds (2-4 per round), 60 tokens per rank"
    ]
