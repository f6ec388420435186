"""End-to-end: the real entry point trains, checkpoints and resumes exactly."""

from __future__ import annotations

import json

import pytest
from conftest import TINY, hand_bits_per_byte, read_metrics, run_train, train_losses


def test_loss_falls_on_embedded_corpus(tmp_path):
    out = tmp_path / "run"
    proc = run_train(
        [
            "--config",
            "base",
            *TINY,
            "--model.flavor",
            "llama3-w128-d4-h2",
            "--training.seq_len",
            "128",
            "--training.local_batch_size",
            "8",
            "--training.steps",
            "60",
            "--metrics.log_freq",
            "5",
            "--validator.freq",
            "30",
            "--optimizer.lr",
            "3e-3",
            "--dump_folder",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = train_losses(out)
    first, last = losses[1], losses[60]
    assert last < first - 1.5, f"loss did not fall enough: {first:.3f} -> {last:.3f}"
    vals = [r["validation_loss"] for r in read_metrics(out) if "validation_loss" in r]
    assert len(vals) >= 2 and vals[-1] < vals[0] - 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 60
    assert summary["tokens_seen"] == 60 * 8 * 128
    assert summary["final_validation_loss"] == pytest.approx(vals[-1])
    assert summary["final_validation_bits_per_byte"] == pytest.approx(
        hand_bits_per_byte(vals[-1], next_token=True, seq_len=128, batch=8, steps=2), rel=1e-9
    )
    assert "run summary" in proc.stderr + proc.stdout
    assert list((out / "tb").rglob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (out / "checkpoint" / "step-60" / ".metadata").is_file()


def test_console_lines_show_progress(tmp_path):
    out = tmp_path / "run"
    proc = run_train(
        [
            "--config",
            "base",
            *TINY,
            "--training.steps",
            "4",
            "--metrics.log_freq",
            "2",
            "--validator.freq",
            "100",
            "--checkpoint.no-enable",
            "--dump_folder",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    line = next(ln for ln in log.splitlines() if "step 4/4" in ln)
    for field in ("loss", "lr", "tok/s", "ms", "eta"):
        assert field in line, line
    record = read_metrics(out)[-2]
    assert {"loss", "lr", "tokens_per_second", "step_time_s", "eta_s"} <= record.keys()


@pytest.mark.parametrize("objective", ["ar", "mdlm"])
def test_validation_off_trains_and_summarises(tmp_path, objective):
    """``--validator.no-enable``: torchtitan builds no validator; the run trains, and the summary
    says there is no validation loss instead of failing."""
    out = tmp_path / "run"
    proc = run_train(
        [
            "--config",
            "base",
            *TINY,
            "--objective",
            objective,
            "--training.steps",
            "2",
            "--validator.no-enable",
            "--checkpoint.no-enable",
            "--dump_folder",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["objective"] == objective and summary["steps"] == 2
    assert summary["final_validation_loss"] is None and summary["final_train_loss"] is not None
    assert "final validation" in proc.stdout + proc.stderr


# Resuming equals the uninterrupted run (Muon state, diffusion noise stream, data position, LR
# schedule): tests/test_slurm_jobs.py::test_requeued_job_resumes_from_its_checkpoint_with_the_uninterrupted_final_loss
# (a requeued SLURM job); DiLoCo: tests/test_diloco.py::test_whole_job_cold_restart_continues_exactly.
