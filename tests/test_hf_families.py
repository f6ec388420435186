"""The Hugging Face families conversions start from: Llama (plain RoPE), Llama 3.1/3.2 (``llama3``
RoPE scaling, a tied head in 3.2), Qwen2/Qwen2.5 (biases on q/k/v, a tied head in the small ones)
and Qwen3 (per-head QK norms). Each is built tiny with transformers and random weights, saved
locally (no download), read through ``hf:DIR`` and scored against transformers on the same tokens;
runs started from them export folders transformers loads with the run's logits.

Tolerance: fp32 on both sides, ``max |Δlogit| <= 1e-5 · max |logit|`` (measured: ~2e-7 relative,
float rounding of a different summation order; weights are drawn with std 0.1, so logits are O(1)
and a dropped bias, a missed scaling or a wrong rotary permutation is off by 1e-2 or more).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_train, run_watched

from muloco import compat

compat.apply()

from muloco.data.tokenizer import MulocoTokenizer  # noqa: E402
from muloco.evaluate.source import from_hf_folder  # noqa: E402
from muloco.export.__main__ import main as export_main  # noqa: E402
from muloco.hf.adapter import adapter_for  # noqa: E402
from muloco.trained_model import load_config, load_model  # noqa: E402

pytestmark = pytest.mark.timeout(900)

RELATIVE_TOLERANCE = 1e-5
SHAPES = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
)
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
FAMILIES = {
    # name: (transformers classes, config overrides)
    "llama": ("Llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "llama3.1": ("Llama", {"rope_parameters": LLAMA31_ROPE}),
    "llama3.2": ("Llama", {"rope_parameters": {**LLAMA31_ROPE, "factor": 32.0}, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen2.5": ("Qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": True}),
    "qwen3": (
        "Qwen3",
        {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": True},
    ),
}


def tokenizer_json() -> Path:
    """The embedded tokenizer's ``tokenizer.json`` (2048 ids, ``<|mask|>`` among them)."""
    return Path(MulocoTokenizer().path)


def save_family(name: str, folder: Path, seed: int = 0) -> torch.nn.Module:
    """A tiny transformers model of family ``name`` with weights of std 0.1 (biases too), saved in
    ``folder`` with the embedded tokenizer; returned in eval mode."""
    import transformers

    prefix, overrides = FAMILIES[name]
    config = getattr(transformers, f"{prefix}Config")(**{**SHAPES, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    model.save_pretrained(str(folder))
    shutil.copy(tokenizer_json(), folder / "tokenizer.json")
    return model


def relative_gap(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


IDS = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_folder_loads_with_transformers_causal_logits(tmp_path, family):
    theirs = save_family(family, tmp_path / family)
    source = from_hf_folder(tmp_path / family, torch.device("cpu"))
    assert source.causal
    with torch.no_grad():
        want = theirs(IDS).logits
        gap = relative_gap(source.model(IDS), want)
    print(f"{family}: max |Δlogit| / max |logit| = {gap:.2e} (fp32)")
    assert gap <= RELATIVE_TOLERANCE
    assert want.abs().max() > 1.0  # logits that would show a wrong weight


def test_llama3_scaling_and_qwen2_biases_change_the_logits_they_are_checked_on(tmp_path):
    """The family test would catch a dropped scaling or bias: without them the logits differ."""
    import transformers

    theirs = save_family("llama3.2", tmp_path / "l")
    config = transformers.LlamaConfig(
        **{**SHAPES, **FAMILIES["llama3.2"][1], "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    )
    plain = transformers.LlamaForCausalLM(config).eval()
    plain.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        assert relative_gap(plain(IDS).logits, theirs(IDS).logits) > 1e-3
    qwen = save_family("qwen2.5", tmp_path / "q")
    with torch.no_grad():
        want = qwen(IDS).logits
        for layer in qwen.model.layers:
            layer.self_attn.q_proj.bias.zero_()
        assert relative_gap(qwen(IDS).logits, want) > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_adapter_maps_each_family_there_and_back_bit_for_bit(tmp_path, family):
    from safetensors.torch import load_file

    from muloco.hf import config as hf_config
    from muloco.models import Architecture, architecture_config

    save_family(family, tmp_path / family)
    folder = tmp_path / family
    config = architecture_config(Architecture.from_hf(hf_config.read(folder)))
    adapter = adapter_for(str(folder))(config)
    original = load_file(str(folder / "model.safetensors"))
    back = adapter.to_hf(adapter.from_hf(dict(original)))
    assert set(back) == set(original)
    assert all(torch.equal(back[k], v) for k, v in original.items())


def _train_from(folder: Path, run: Path, objective: str) -> None:
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--objective",
            objective,
            "--training.steps",
            "2",
            "--checkpoint.interval",
            "2",
            "--validator.no-enable",
            "--model.flavor",
            f"hf:{folder}",
            "--tokenizer.path",
            str(folder),
            "--checkpoint.initial_load_path",
            str(folder),
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
            "--dump_folder",
            str(run),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize(
    "family, objective, architecture",
    [
        ("llama3.2", "ar", "LlamaForCausalLM"),
        ("qwen2.5", "ar", "Qwen2ForCausalLM"),
        ("qwen2.5", "mdlm", "MulocoForCausalLM"),
    ],
)
def test_a_run_from_a_family_folder_exports_a_folder_transformers_loads_with_its_logits(
    tmp_path, capsys, family, objective, architecture
):
    """Trained 2 steps from the folder, exported, loaded by transformers (the shipped class for a
    diffusion model with Qwen2's biases): transformers' logits are the run's."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    folder, run, out = tmp_path / family, tmp_path / "run", tmp_path / "export"
    save_family(family, folder)
    _train_from(folder, run, objective)
    assert export_main([str(run), "--out", str(out)]) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture]
    source = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"] == source["rope_parameters"]
    assert config["max_position_embeddings"] == source["max_position_embeddings"] == 131072  # its context kept
    auto = AutoModelForCausalLM if objective == "ar" else AutoModelForMaskedLM
    hf = auto.from_pretrained(str(out), dtype=torch.float32, trust_remote_code=objective != "ar").eval()
    model, *_ = load_model(run, load_config(run), None, torch.device("cpu"))
    with torch.no_grad():
        gap = relative_gap(model(IDS), hf(IDS).logits)
    print(f"{family} {objective} export: max |Δlogit| / max |logit| = {gap:.2e}")
    assert gap <= RELATIVE_TOLERANCE


def test_a_k2_muloco_run_starts_from_a_qwen2_folder(tmp_path):
    """Qwen2's biases take part in the exchange like any parameter: the run commits its syncs."""
    folder, run = tmp_path / "qwen2", tmp_path / "run"
    save_family("qwen2.5", folder)
    proc = run_watched(
        [
            sys.executable,
            "-m",
            "muloco.launch.local",
            "--config",
            "diloco/muloco",
            "--replicas",
            "2",
            "--",
            *TINY,
            "--training.steps",
            "2",
            "--outer.sync_every",
            "1",
            "--validator.no-enable",
            "--checkpoint.interval",
            "2",
            "--model.flavor",
            f"hf:{folder}",
            "--tokenizer.path",
            str(folder),
            "--checkpoint.initial_load_path",
            str(folder),
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
            "--dump_folder",
            str(run),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summaries = [json.loads((run / f"replica_{r}" / "summary.json").read_text()) for r in (0, 1)]
    assert all(s["diloco"]["syncs_committed"] == 2 for s in summaries)
    assert summaries[0]["diloco"]["final_global_sha256"] == summaries[1]["diloco"]["final_global_sha256"]
