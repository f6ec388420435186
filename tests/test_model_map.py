"""The sizing table (``python -m muloco.model_map``): every derived number against its formula,
the parameter split against a built model, and the command line."""

from __future__ import annotations

import json
import math
import sys

import pytest
from conftest import REPO, run_watched, tiny_model

from muloco import compat

compat.apply()

from muloco.models.flavors import (  # noqa: E402
    SHAPES,
    SOURCES,
    count_parameters,
    rescaled_weight_decay,
    sizing,
    steps_for_batch,
)
from muloco.sizing.cli import main  # noqa: E402


@pytest.mark.parametrize("global_batch, vocab, replicas", [(512, 128256, 1), (2048, 128256, 8), (64, 2048, 2)])
def test_every_derived_number_follows_its_formula(global_batch, vocab, replicas, capsys):
    assert (
        main(["--global-batch", str(global_batch), "--vocab", str(vocab), "--replicas", str(replicas), "--json"]) == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["flavor"] for r in rows] == list(SHAPES)
    for r in rows:
        shape = SHAPES[r["flavor"]]
        params = count_parameters(r["flavor"], vocab)
        assert r["parameters"] == params
        assert r["non_embedding_parameters"] == params - 2 * vocab * shape.dim  # untied embedding + head
        assert r["token_budget"] == 20 * params
        assert r["steps"] == math.ceil(20 * params / (global_batch * 2048))
        assert r["max_micro_batch"] == shape.max_local_batch
        assert r["gpus"] == math.ceil(global_batch / shape.max_local_batch)
        for key, wd in shape.weight_decay.items():
            want = wd * steps_for_batch(r["flavor"], 512, 2048, vocab) / r["steps"] / replicas
            assert r["weight_decay"][key] == pytest.approx(want, rel=1e-12)
        assert r["tuned_lr"] == shape.tuned_lr
        assert set(r["weight_decay"]) | set(r["tuned_lr"]) <= set(SOURCES)  # every tuned value has a source


def test_weight_decay_rule_matches_muloco_launchers():
    # MuLoCo's 3B DDP baseline: wd 0.001 at B=512 -> B=8192 steps shrink 16x, wd grows 16x
    flavor = "llama3-w2560-d30-h20"
    assert rescaled_weight_decay(0.001, flavor, 8192) == pytest.approx(
        0.001 * steps_for_batch(flavor, 512) / steps_for_batch(flavor, 8192)
    )
    assert rescaled_weight_decay(0.001, flavor, 8192) == pytest.approx(0.016, rel=0.01)
    assert rescaled_weight_decay(0.01, flavor, 512, replicas=16) == pytest.approx(0.01 / 16)
    with pytest.raises(ValueError, match="replicas"):
        rescaled_weight_decay(0.01, flavor, 512, replicas=0)


def test_the_parameter_split_matches_a_built_model():
    vocab = 32
    model = tiny_model(causal=True, vocab=vocab)
    row = sizing("llama3-w64-d2-h2", global_batch=4, vocab_size=vocab, seq_len=64)
    embedding_and_head = model.tok_embeddings.weight.numel() + model.lm_head.weight.numel()
    assert row.parameters == sum(p.numel() for p in model.parameters())
    assert row.non_embedding_parameters == row.parameters - embedding_and_head


def test_the_table_as_users_print_it():
    proc = run_watched(
        [
            sys.executable,
            "-m",
            "muloco.model_map",
            "--flavor",
            "llama3-w1024-d12-h8",
            "--global-batch",
            "512",
            "--replicas",
            "8",
        ],
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "llama3-w1024-d12-h8" in out and "416.83M" in out and "7,951" in out
    assert "lr[muloco_k8_quantized] 0.0224" in out and "wd[muon] 0.00125" in out  # 0.01 / K=8
    assert SOURCES["muloco_k8_quantized"] in out and "divided by K" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--flavor", "llama3-w1000"], "model.flavor 'llama3-w1000' is not a flavor name"),
        (["--flavor", "llama3-w1000-d12-h8"], "the head dimension 1000/8 = 125 is odd"),
        (["--flavor", "llama3-w100-d2-h3"], "width 100 is not a multiple of the 3 heads"),
        (["--flavor", "llama3-w0-d2-h3"], "width must be at least 1"),
        (
            ["--bits", "3", "--gpu", "tpu9", "--mfu", "7"],
            "--bits, --mfu, --gpu are link planner options: add --link-mbps",
        ),
        (["--sync-every", "10"], "--sync-every is a link planner option"),
        (["--global-batch", "0"], "--global-batch must be at least 1; got 0"),
        (["--replicas", "-2"], "--replicas must be at least 1; got -2"),
        (
            ["--vocab", "gpt9"],
            "--vocab: 'gpt9' is not a vocabulary: give a number of tokens, auto, embedded, llama3, or a",
        ),
        (["--vocab", "0"], "--vocab: 0 is not a vocabulary size (at least 1)"),
    ],
)
def test_bad_arguments_are_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("muloco map: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_the_map_is_read_without_torch():
    """Job generators, sweeps and the sizing CLI read the map; none of them pays for a torch import."""
    code = (
        "import sys, muloco.model_map, muloco.models.flavors, muloco.utils.link_model; "
        "assert 'torch' not in sys.modules, sorted(sys.modules)"
    )
    proc = run_watched([sys.executable, "-c", code], cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_the_default_vocabulary_is_the_one_each_shape_trains_with(capsys):
    """``--vocab auto``: the CPU flavors count the embedded tokenizer's rows (the default job's model
    is the 1.3M the README quotes), the GPU shapes Llama 3's; both padded as the model pads."""
    from muloco.data.tokenizer import MulocoTokenizer
    from muloco.models import ModelConfig, build_model_config

    assert main(["--json"]) == 0
    rows = {r["flavor"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    embedded = MulocoTokenizer().get_vocab_size()
    default_job = build_model_config(ModelConfig(flavor="llama3-w128-d4-h2"), embedded)
    assert rows["llama3-w128-d4-h2"]["vocab"] == default_job.vocab_size
    assert rows["llama3-w128-d4-h2"]["parameters"] == count_parameters("llama3-w128-d4-h2", default_job.vocab_size)
    assert 1.3e6 <= rows["llama3-w128-d4-h2"]["parameters"] < 1.4e6
    assert rows["llama3-w1024-d12-h8"]["vocab"] == 128256 and rows["llama3-w1024-d12-h8"]["vocab_source"] == "llama3"
    assert main(["--flavor", "llama3-w128-d4-h2", "--vocab", "1000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vocab"] == 1024  # padded to a multiple of 64


def test_any_shape_is_sized_and_builds():
    """A shape outside the map is sized (no tuned values, the next larger row's micro-batch) and
    builds into exactly the model its count says."""
    import torch

    from muloco.models import ModelConfig, build_model_config
    from muloco.models.flavors import in_map, parse_flavor

    flavor = "llama3-w96-d3-h2_qk_torch-rmsnorm"
    assert not in_map(flavor) and in_map("llama3-w128-d4-h2_pa")
    row = sizing(flavor, global_batch=8, vocab_size=256, seq_len=64)
    assert row.weight_decay == {} and row.tuned_lr == {} and not row.in_map
    assert row.max_micro_batch == SHAPES["llama3-w128-d4-h2"].max_local_batch  # the next larger row
    with torch.device("meta"):
        model = build_model_config(ModelConfig(flavor=flavor, vocab_multiple_of=1), vocab_size=256).build()
    assert row.parameters == sum(p.numel() for p in model.parameters())
    assert parse_flavor("llama3-w8192-d80-h64").shape.max_local_batch == 1  # beyond the largest row


HF_CONFIGS = {
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 96,
        "vocab_size": 256,
        "tie_word_embeddings": True,
    },
    "qwen2": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 256,
    },
    "llama": {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "intermediate_size": 160,
        "vocab_size": 320,
        "tie_word_embeddings": False,
    },
}


@pytest.mark.parametrize("family", sorted(HF_CONFIGS))
def test_a_hugging_face_folder_is_sized_as_the_model_it_builds(tmp_path, family):
    """``muloco map --flavor hf:DIR``: grouped-query heads, a head size of its own, q/k/v biases
    (Qwen2), QK norms (Qwen3), tying and the folder's vocabulary, counted as the trainer builds them."""
    import json as json_

    import torch

    from muloco.models import ModelConfig, build_model_config

    folder = tmp_path / family
    folder.mkdir()
    (folder / "config.json").write_text(json_.dumps(HF_CONFIGS[family]))
    flavor = f"hf:{folder}"
    vocab = HF_CONFIGS[family]["vocab_size"]
    row = sizing(flavor, global_batch=8, vocab_size=vocab, seq_len=64)
    with torch.device("meta"):
        model = build_model_config(ModelConfig(flavor=flavor, vocab_multiple_of=1), vocab_size=vocab).build()
    assert row.parameters == sum(p.numel() for p in model.parameters())
    proc = run_watched([sys.executable, "-m", "muloco.model_map", "--flavor", flavor], cwd=REPO)
    assert proc.returncode == 0 and flavor in proc.stdout and "the folder's" in proc.stdout, proc.stdout + proc.stderr


def test_a_shape_outside_the_map_is_marked_in_the_table():
    proc = run_watched([sys.executable, "-m", "muloco.model_map", "--flavor", "llama3-w960-d12-h8"], cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("llama3-w960-d12-h8"))
    assert "128,256" in row and "~16" in row and "a shape outside the map" in proc.stdout
