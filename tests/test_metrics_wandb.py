"""W&B runs survive restarts: the run folder keeps its W&B run id (what a requeued or resubmitted
job resumes), without W&B installed: the id is what torchtitan's WandBLogger hands to wandb.init."""

from __future__ import annotations

import os
import sys

from conftest import REPO, run_watched

from muloco.components.metrics import WANDB_ID_FILE, keep_wandb_run


def test_a_run_folder_keeps_one_wandb_run_id_across_restarts(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.delenv("WANDB_RESUME", raising=False)
    first = keep_wandb_run(str(tmp_path / "run"), resuming=False)
    assert (tmp_path / "run" / WANDB_ID_FILE).read_text().strip() == first
    assert os.environ["WANDB_RUN_ID"] == first and os.environ["WANDB_RESUME"] == "allow"
    monkeypatch.delenv("WANDB_RUN_ID")  # a new process: the requeued job, resuming its checkpoint
    assert keep_wandb_run(str(tmp_path / "run"), resuming=True) == first
    monkeypatch.delenv("WANDB_RUN_ID")
    other = keep_wandb_run(str(tmp_path / "other"), resuming=True)  # another run (or group folder): its own
    assert other != first
    monkeypatch.delenv("WANDB_RUN_ID")  # the folder reused from step 0 (checkpoints gone): a new W&B run
    fresh = keep_wandb_run(str(tmp_path / "run"), resuming=False)
    assert fresh != first and (tmp_path / "run" / WANDB_ID_FILE).read_text().strip() == fresh
    monkeypatch.setenv("WANDB_RUN_ID", "mine")  # the user's choice wins, and nothing is written
    assert keep_wandb_run(str(tmp_path / "third"), resuming=False) == "mine" and not (tmp_path / "third").exists()


def test_a_resumed_training_process_exports_the_same_id(tmp_path):
    """Two processes in turn (a job and its requeue) read the id the first one made."""
    code = (
        "import os,sys; sys.path.insert(0, sys.argv[2]); from muloco.components.metrics import keep_wandb_run; "
        "print(keep_wandb_run(sys.argv[1], resuming=True), os.environ['WANDB_RESUME'])"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    runs = [
        run_watched([sys.executable, "-c", code, str(tmp_path / "run"), str(REPO)], env=env, check=True).stdout.split()
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and runs[0][1] == "allow"


def test_a_run_logs_to_wandb_offline_under_the_id_its_folder_keeps(tmp_path, monkeypatch):
    """A tiny training with ``--metrics.enable_wandb`` and ``WANDB_MODE=offline`` (no account, no
    network): wandb writes its offline run under the dump folder, named by the folder's W&B run
    id, with the training's loss in it; ``wandb sync`` uploads it later."""
    from conftest import TINY, run_train

    for key in [k for k in os.environ if k.startswith("WANDB_")]:  # e.g. an id another test left behind
        monkeypatch.delenv(key)
    run = tmp_path / "run"
    env = dict(
        WANDB_MODE="offline",
        WANDB_PROJECT="muloco-test",
        WANDB_DIR=str(tmp_path / "wandb-home"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
    )
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--training.steps",
            "2",
            "--metrics.log_freq",
            "1",
            "--checkpoint.no-enable",
            "--validator.no-enable",
            "--metrics.enable_wandb",
            "--dump_folder",
            str(run),
        ],
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_id = (run / WANDB_ID_FILE).read_text().strip()
    offline = [p for p in run.rglob(f"offline-run-*-{run_id}") if p.is_dir()]
    assert len(offline) == 1, sorted(str(p) for p in run.rglob("*run-*"))
    records = list(offline[0].glob(f"run-{run_id}.wandb"))
    assert records and all(key in records[0].read_bytes() for key in (b"grad_norm", b"tokens_per_second"))
