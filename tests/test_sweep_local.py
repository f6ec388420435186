"""``--local N``: a sweep on this machine without SLURM, through submitit's LocalExecutor (a DDP
run and a K=2 run of the tiny flavor), its manifest, a second invocation that reuses both runs,
and --status."""

from __future__ import annotations

import json

import pytest

from conftest import TINY
from muloco.launch.sweep import Sweep, grid, main

pytestmark = pytest.mark.timeout(900)
SHORT = [*TINY, "--training.steps", "4", "--validator.freq", "4", "--checkpoint.interval", "4"]
SWEEP = Sweep("tiny_local", [
    *grid("ddp", "ddp/adamw", fixed={}, vary={"--optimizer.lr": [0.003]}),
    *grid("groups", "diloco/muloco", replicas=2, fixed={"--outer.sync_every": 2}, vary={"--optimizer.lr": [0.02]}),
])


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
