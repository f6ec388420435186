"""LoRA in runs (``--model.lora.rank``): a K=2 MuLoCo run from a Hugging Face folder trains and
exchanges only the adapters (the frozen base is bit for bit the folder's at the end and never on
the wire), both replicas end on one θ_g, and the export holds the merged model plus the adapter
alone, which peft loads onto the base the run started from with the merged model's logits; an
adapter is refused on another base."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_watched
from test_hf_families import IDS, relative_gap, save_family

from muloco import compat

compat.apply()

from muloco.export.__main__ import main as export_main  # noqa: E402

pytestmark = pytest.mark.timeout(900)
RANK = 4


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> tuple[Path, Path]:
    """(a Qwen2.5-style folder, a K=2 MuLoCo 2-bit LoRA run of 4 steps started from it)."""
    root = tmp_path_factory.mktemp("lora")
    folder, run = root / "qwen", root / "run"
    save_family("qwen2.5", folder)
    proc = run_watched(
        [
            sys.executable,
            "-m",
            "muloco.launch.local",
            "--config",
            "diloco/muloco_2bit",
            "--replicas",
            "2",
            "--",
            *TINY,
            "--training.steps",
            "4",
            "--outer.sync_every",
            "2",
            "--validator.no-enable",
            "--checkpoint.interval",
            "4",
            "--model.flavor",
            f"hf:{folder}",
            "--tokenizer.path",
            str(folder),
            "--model.lora.rank",
            str(RANK),
            "--checkpoint.initial_load_path",
            str(folder),
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
            "--dump_folder",
            str(run),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder, run


def _adapter_elements() -> int:
    """r·(in + out) over the seven projections of both layers of the tiny Qwen (64 wide, 4 heads of
    16, 2 KV heads, FFN 96)."""
    shapes = [(64, 64), (64, 32), (64, 32), (64, 64), (64, 96), (64, 96), (96, 64)]
    return 2 * sum(RANK * (i + o) for i, o in shapes)


def test_a_lora_muloco_run_exchanges_only_the_adapters_and_keeps_the_base_bit_for_bit(lora_run):
    from safetensors.torch import load_file

    from muloco.trained_model import load_config, load_model

    folder, run = lora_run
    summaries = [json.loads((run / f"replica_{r}" / "summary.json").read_text())["diloco"] for r in (0, 1)]
    assert all(s["syncs_committed"] == 2 for s in summaries)
    assert summaries[0]["final_global_sha256"] == summaries[1]["final_global_sha256"]
    # 2 bits per element of the adapters (plus the codec's scales): nowhere near the 0.4M-parameter base
    sent = summaries[0]["bytes_sent"]
    assert 2 * _adapter_elements() * 2 / 8 <= sent < 2 * _adapter_elements() * 4, sent
    config = load_config(run / "replica_0")
    model, *_ = load_model(run / "replica_0", config, None, torch.device("cpu"))
    from muloco.hf.adapter import adapter_for

    base = adapter_for(str(folder))(model.config).from_hf(load_file(str(folder / "model.safetensors")))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in base.items())  # the frozen base: the folder's, bit for bit
    assert any(v.abs().sum() > 0 for k, v in state.items() if ".lora_B." in k)  # the adapters trained


def test_a_lora_export_is_the_merged_model_and_its_adapter_loads_onto_the_base_with_peft(lora_run, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from muloco.evaluate.source import SourceError, from_hf_folder
    from muloco.trained_model import load_config, load_model

    folder, run = lora_run
    out = tmp_path / "export"
    assert export_main([str(run), "--out", str(out)]) == 0, capsys.readouterr().err
    model, *_ = load_model(run / "replica_0", load_config(run / "replica_0"), None, torch.device("cpu"))
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        ours, plain = model(IDS), base(IDS).logits
        with_adapter = PeftModel.from_pretrained(base, str(out / "adapter")).eval()(IDS).logits
        assert relative_gap(merged(IDS).logits, ours) <= 1e-5
        assert relative_gap(with_adapter, ours) <= 1e-5
    assert relative_gap(plain, ours) > 1e-4  # the adapters changed the function
    assert from_hf_folder(folder, torch.device("cpu"), adapter=out / "adapter").model is not None
    other = tmp_path / "other"
    save_family("qwen2.5", other, seed=5)
    with pytest.raises(SourceError, match="was trained on a base whose weights hash to .* load it onto"):
        from_hf_folder(other, torch.device("cpu"), adapter=out / "adapter")


def test_a_lora_base_export_with_its_adapter_is_the_merged_model(lora_run, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, run = lora_run
    merged_dir, base_dir = tmp_path / "merged", tmp_path / "base"
    assert export_main([str(run), "--out", str(merged_dir)]) == 0
    assert export_main([str(run), "--out", str(base_dir), "--lora-base"]) == 0, capsys.readouterr().err
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (
            relative_gap(PeftModel.from_pretrained(base, str(base_dir / "adapter"))(IDS).logits, merged(IDS).logits)
            <= 1e-5
        )


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            ["--model.lora.rank", "4", "--model.lora.target_modules", "q_proj,qkv"],
            "model.lora.target_modules ['q_proj', 'qkv'] must name some of",
        ),
        (["--model.lora.rank", "-1"], "model.lora.rank -1 is negative"),
        (["--model.lora.rank", "4", "--model.lora.dropout", "1.0"], "model.lora.dropout 1.0 is not in [0, 1)"),
    ],
)
def test_a_bad_lora_setting_is_one_error_before_anything_runs(tmp_path, flags, expected):
    from conftest import run_train

    proc = run_train(["--config", "ddp/adamw", *TINY, *flags, "--dump_folder", str(tmp_path / "r")])
    assert proc.returncode != 0 and expected in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "r").exists()


def test_lora_base_on_a_run_without_adapters_is_one_error(tmp_path, capsys):
    from conftest import run_train

    run = tmp_path / "run"
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--training.steps",
            "2",
            "--checkpoint.interval",
            "2",
            "--validator.no-enable",
            "--dump_folder",
            str(run),
        ]
    )
    assert proc.returncode == 0
    assert export_main([str(run), "--out", str(tmp_path / "x"), "--lora-base"]) == 2
    assert "--lora-base exports the frozen base of a LoRA run" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_streaming_fragments_split_the_blocks_that_train(tmp_path):
    """With LoRA the embedding and the head train nothing: fragments split the blocks only, and
    more fragments than blocks is one error naming the most there can be."""
    from conftest import run_train

    proc = run_train(
        [
            "--config",
            "diloco/muloco_streaming",
            *TINY,
            "--model.lora.rank",
            "4",
            "--training.steps",
            "30",
            "--dump_folder",
            str(tmp_path / "r"),
        ]
    )
    assert proc.returncode != 0 and "outer.num_fragments is 3, more than the 2 layer units of" in proc.stderr
    assert "with LoRA only the blocks train); use at most --outer.num_fragments 2" in proc.stderr


def test_fragments_of_a_lora_model_hold_only_adapters_and_none_is_empty():
    from muloco.models import ModelConfig, init_model
    from muloco.models.lora import LoraConfig
    from muloco.outer.schedule import model_fragments

    model = init_model(ModelConfig(flavor="llama3-w64-d2-h2", lora=LoraConfig(rank=4)), 2048)
    fragments = model_fragments(model, 2)
    assert all(fragments) and all(".lora_" in name for frag in fragments for name, _ in frag)
    assert sum(len(f) for f in fragments) == 2 * 7 * 2  # two layers, seven projections, A and B


def test_a_group_that_heals_in_a_lora_run_receives_the_adapters_not_the_frozen_base(tmp_path):
    """Group 1 starts once group 0 has trained its last step and heals to the final state: what
    it receives (model, optimizer, θ_g and the rest) is a fraction of the frozen base alone, and
    both groups end on one θ_g."""
    from conftest import read_metrics
    from progress import FolderProgress, until
    from replicas import DILOCO_TINY, HANG_S, Cluster, summary

    c = Cluster(tmp_path, 2, min_replicas=1)
    try:
        c.start_lighthouse()
        dump, steps = tmp_path / "run", 20
        args = [
            "--config",
            "diloco/diloco",
            *DILOCO_TINY,
            "--training.steps",
            str(steps),
            "--outer.sync_every",
            "10",
            "--model.lora.rank",
            str(RANK),
            "--validator.no-enable",
            "--checkpoint.no-enable",
            "--fault_tolerance.min_replica_size",
            "1",
            "--fault_tolerance.start_wait_seconds",
            "0",
            "--fault_tolerance.end_wait_seconds",
            "600",
            "--fault_tolerance.quorum_timeout_seconds",
            str(HANG_S),
            "--fault_tolerance.process_group_timeout_ms",
            str(HANG_S * 1000),
            "--dump_folder",
            str(dump),
        ]
        c.start_replica(0, args)

        def trained_all() -> bool:
            assert c.procs["r0"].poll() is None, c.tail("r0")  # it waits for group 1 at the end
            try:
                return any(r["step"] == steps for r in read_metrics(dump / "replica_0") if "loss" in r)
            except (FileNotFoundError, ValueError):
                return False

        until(
            f"group 0 did not train its last step:\n{c.tail('r0')}",
            trained_all,
            progress=FolderProgress(HANG_S, tmp_path),
        )
        c.start_replica(1, args)
        assert c.wait("r0", 2 * HANG_S) == 0, c.tail("r0")
        assert c.wait("r1", 2 * HANG_S) == 0, c.tail("r1")
        a, b = summary(dump, 0)["diloco"], summary(dump, 1)["diloco"]
        assert a["final_global_sha256"] == b["final_global_sha256"] and b["healed_from"] == [0]
        from muloco.models import ModelConfig, init_model
        from muloco.models.lora import LoraConfig

        model = init_model(ModelConfig(flavor="llama3-w64-d2-h2", lora=LoraConfig(rank=RANK)), 2048)
        base = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
        received = b["heal_log"][0]["bytes_received"]
        assert 0 < received < base / 4, (received, base)
    finally:
        c.close()
