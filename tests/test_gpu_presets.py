"""config/gpu/*: the GPU presets resolve to the documented sizing, and each trains on CPU
with the tiny override (fp32 there: mixed_precision_param auto; compile off)."""

from __future__ import annotations

import json

import pytest
from conftest import TINY, run_train
from replicas import Cluster

import muloco.compat as compat

compat.apply()  # before torchtitan is imported

from muloco.config.cli import parse_args  # noqa: E402
from muloco.config.gpu_preset import GLOBAL_BATCH, PAPER_416M  # noqa: E402
from muloco.models.flavors import steps_for_batch  # noqa: E402

PRESETS = ["gpu/ddp_adamw", "gpu/ddp_muon", "gpu/diloco", "gpu/muloco", "gpu/muloco_2bit"]
TINY_OVERRIDE = [
    *TINY,
    "--training.global_batch_size",
    "-1",
    "--training.batch_over_groups",
    "0",
    "--compile.no-enable",
    "--validator.freq",
    "1000",
    "--checkpoint.interval",
    "1000",
    "--metrics.log_freq",
    "1",
]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_resolves_to_the_416m_gpu_sizing(name):
    _, c = parse_args(["--config", name])
    k = getattr(getattr(c, "fault_tolerance", None), "group_size", 1) if name not in PRESETS[:2] else 1
    assert c.model.flavor == PAPER_416M
    assert (c.training.seq_len, c.training.local_batch_size) == (2048, 16)  # the model map's micro-batch
    assert c.training.global_batch_size * k == GLOBAL_BATCH
    budget = steps_for_batch(PAPER_416M, GLOBAL_BATCH)
    assert budget > 7000 and budget <= c.training.steps < budget + 30
    if k > 1:
        assert c.training.steps % c.outer.sync_every == 0
    assert c.training.mixed_precision_param == "auto" and c.compile.enable
    assert c.activation_checkpoint is None  # batch 16 of this shape fits an 80 GB GPU without it


def test_the_presets_batch_is_split_over_the_launchers_k():
    """512 sequences per step in all, whatever K the launcher gives (--fault_tolerance.group_size,
    which --replicas sets); an explicit per-group batch wins; a K that does not split it is refused."""
    from muloco.config.loader import ConfigError

    for k, per_group in ((2, 256), (8, 64), (4, 128)):
        _, c = parse_args(["--config", "gpu/muloco_2bit", "--fault_tolerance.group_size", str(k)])
        assert c.training.global_batch_size == per_group and per_group * k == GLOBAL_BATCH
    _, c = parse_args(
        ["--config", "gpu/muloco", "--fault_tolerance.group_size", "8", "--training.global_batch_size", "128"]
    )
    assert c.training.global_batch_size == 128
    with pytest.raises(ConfigError, match="batch_over_groups 512 does not split over 3 replica group"):
        parse_args(["--config", "gpu/diloco", "--fault_tolerance.group_size", "3"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpu/ddp_muon"])  # ddp_adamw differs only in the optimizer
def test_single_group_preset_trains_on_cpu_with_the_tiny_override(name, tmp_path):
    proc = run_train(["--config", name, *TINY_OVERRIDE, "--training.steps", "3", "--dump_folder", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["steps"] == 3 and s["precision"] == "float32" and s["final_train_loss"] > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpu/muloco_2bit"])  # gpu/diloco, gpu/muloco: its parents, resolved above
def test_replica_group_preset_trains_on_cpu_with_the_tiny_override(name, tmp_path):
    cluster = Cluster(tmp_path, 1)
    try:
        cluster.start_lighthouse()
        dump = tmp_path / "run"
        cluster.start_replica(
            0,
            [
                "--config",
                name,
                *TINY_OVERRIDE,
                "--training.steps",
                "4",
                "--outer.sync_every",
                "2",
                "--fault_tolerance.group_size",
                "1",
                "--dump_folder",
                str(dump),
            ],
        )
        assert cluster.wait("r0", 200) == 0, cluster.tail("r0")
    finally:
        cluster.close()
    s = json.loads((dump / "replica_0" / "summary.json").read_text())
    assert s["steps"] == 4 and s["precision"] == "float32"
    assert s["diloco"]["syncs_committed"] == s["diloco"]["syncs"] == 2
