"""``jobs/local/convert.sh``: a tiny AR model trained and exported, converted into a block-wise
diffusion LM by LoRA under K=2 MuLoCo, exported (merged and the adapter alone) and sampled."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, run_watched

pytestmark = pytest.mark.timeout(900)


def test_the_convert_script_turns_its_ar_export_into_a_lora_diffusion_model_under_k2_muloco(tmp_path):
    out = tmp_path / "convert"
    proc = run_watched(
        [
            str(REPO / "jobs" / "local" / "convert.sh"),
            "--ar-steps",
            "2",
            "--out",
            str(out),
            "--threads",
            "1",
            "--",
            "--training.seq_len",
            "64",
            "--training.local_batch_size",
            "4",
            "--training.steps",
            "2",
            "--outer.sync_every",
            "1",
            "--lr_scheduler.warmup_steps",
            "1",
            "--validator.no-enable",
            "--checkpoint.interval",
            "2",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert (out / "ar-hf" / "config.json").is_file() and (
        out / "diffusion-hf" / "adapter" / "adapter_config.json"
    ).is_file()
    summaries = [json.loads((out / "diffusion" / f"replica_{r}" / "summary.json").read_text()) for r in (0, 1)]
    assert all(s["objective"] == "mdlm" and s["diloco"]["syncs_committed"] == 2 for s in summaries)
    assert summaries[0]["diloco"]["final_global_sha256"] == summaries[1]["diloco"]["final_global_sha256"]
    facts = json.loads((out / "diffusion" / "replica_0" / "run.json").read_text())["facts"]
    assert facts["recipe"].startswith("block (size 16")
    assert json.loads((out / "diffusion-hf" / "config.json").read_text())["diffusion_readout"] == {
        "shift": False,
        "block_size": 16,
    }
    assert "trainable (" in proc.stdout and "the rest frozen" in proc.stdout
    for prompt in ("def ", "import "):
        assert f"--- mdlm sample, step 2 (θ_g), prompt {prompt!r}" in proc.stdout


def test_the_convert_script_refuses_an_unknown_recipe(tmp_path):
    proc = run_watched(
        [str(REPO / "jobs" / "local" / "convert.sh"), "--recipe", "dreamy", "--out", str(tmp_path)], cwd=tmp_path
    )
    assert proc.returncode == 2 and "--recipe must be full, dream or block; got 'dreamy'" in proc.stderr
