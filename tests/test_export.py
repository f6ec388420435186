"""``python -m muloco.export``: a tiny next-token run becomes a Hugging Face folder that
transformers loads, with muloco's logits and tokens; what it cannot express yet is one clear
error and writes nothing; a corrupt checkpoint is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_train

from muloco import compat

compat.apply()

from muloco.config.cli import parse_args  # noqa: E402
from muloco.export import _unsupported, main  # noqa: E402
from muloco.run_loading import load_config, load_model  # noqa: E402
from muloco.models import init_model  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # hang timeouts: several trainings on 2 cores

TEXT = "To be, or not to be, that is the question"


@pytest.fixture(scope="module")
def ar_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    proc = run_train(["--config", "ddp/adamw", *TINY, "--training.steps", "4", "--checkpoint.interval", "4",
                      "--validator.freq", "4", "--dump_folder", str(run)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def test_an_ar_run_loads_in_transformers_with_muloco_logits_and_tokens(ar_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    assert main([str(ar_run), "--out", str(out)]) == 0, capsys.readouterr().err
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "README.md"} <= {p.name for p in out.iterdir()}
    config = load_config(ar_run)
    model, tokenizer, _, step, is_global = load_model(ar_run, config, None, torch.device("cpu"))
    assert step == 4 and not is_global
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = tokenizer.encode(TEXT, add_bos=True)
    assert AutoTokenizer.from_pretrained(str(out))(TEXT)["input_ids"] == ids  # BOS first, as muloco trains
    with torch.no_grad():
        ours = model(torch.tensor([ids]))
        theirs = hf(torch.tensor([ids])).logits
    diff = (ours - theirs).abs().max().item()
    print(f"max |logit difference| muloco vs transformers: {diff:.3g}")
    assert diff <= 1e-4
    card = (out / "README.md").read_text()
    summary = json.loads((ar_run / "summary.json").read_text())
    assert "config module: `ddp/adamw`" in card and str(summary["tokens_seen"]) in card
    assert str(ar_run) not in card  # no path of this machine


@pytest.fixture(scope="module")
def mdlm_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export-mdlm") / "run"
    proc = run_train(["--config", "ddp/adamw", "--objective", "mdlm", *TINY, "--training.steps", "4",
                      "--checkpoint.interval", "4", "--validator.freq", "4", "--dump_folder", str(run)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def test_an_mdlm_run_loads_as_a_bidirectional_model_with_muloco_logits_and_its_card_samples(mdlm_run, tmp_path,
                                                                                             capsys):
    from transformers import AutoModelForMaskedLM

    out = tmp_path / "hf"
    assert main([str(mdlm_run), "--out", str(out)]) == 0, capsys.readouterr().err
    assert "trust_remote_code=True" in capsys.readouterr().out
    config = load_config(mdlm_run)
    model, tokenizer, _, _, _ = load_model(mdlm_run, config, None, torch.device("cpu"))
    hf = AutoModelForMaskedLM.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert hf.config.mask_token_id == tokenizer.mask_id
    ids = tokenizer.encode(TEXT, add_bos=True)
    ids[3] = ids[6] = tokenizer.mask_id
    x = torch.tensor([ids])
    changed = x.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 64
    with torch.no_grad():
        diff = (model(x) - hf(x).logits).abs().max().item()
        earlier = (hf(changed).logits[0, 0] - hf(x).logits[0, 0]).abs().max().item()
    print(f"max |logit difference| muloco vs transformers (mdlm): {diff:.3g}")
    assert diff <= 1e-4 and earlier > 0  # the first position sees the last: bidirectional
    card = (out / "README.md").read_text()
    snippet = card.split("```python\n")[1].split("```")[0].replace("DIR", repr(str(out)))
    exec(compile(snippet, "README.md", "exec"), {})  # the card's sampling loop runs as written
    assert "Once upon a time" in capsys.readouterr().out


def test_a_non_empty_out_and_a_corrupt_checkpoint_are_refused_and_nothing_is_written(ar_run, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert main([str(ar_run), "--out", str(busy)]) == 2
    assert "is not empty" in capsys.readouterr().err and [p.name for p in busy.iterdir()] == ["keep.txt"]
    broken = tmp_path / "broken"
    import shutil

    shutil.copytree(ar_run, broken)
    data = next((broken / "checkpoint" / "step-4").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-16] + b"\0" * 16)
    assert main([str(broken), "--out", str(tmp_path / "out")]) == 2
    assert "muloco.export: error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_a_tiktoken_run_exports_a_tokenizer_json_that_encodes_as_muloco_does(tmp_path, capsys):
    """A tiktoken BPE file (Llama 3's format: base64 token, rank) is converted with its special
    tokens after the ranks; the folder's tokenizer gives muloco's ids, BOS first."""
    import base64

    from transformers import AutoModelForCausalLM, AutoTokenizer

    merges = [b"th", b"he", b"the", b"  ", b"in", b"re", b"return", b"de", b"def", b" t", b" the"]
    tokens = [bytes([b]) for b in range(256)] + merges
    tiktoken_file = tmp_path / "tokenizer.model"
    tiktoken_file.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(tokens)))
    run = tmp_path / "run"
    proc = run_train(["--config", "ddp/adamw", *TINY, "--tokenizer.path", str(tiktoken_file), "--training.steps", "2",
                      "--checkpoint.interval", "2", "--validator.no-enable", "--dump_folder", str(run)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "hf"
    assert main([str(run), "--out", str(out)]) == 0, capsys.readouterr().err
    model, tokenizer, *_ = load_model(run, load_config(run), None, torch.device("cpu"))
    theirs = AutoTokenizer.from_pretrained(str(out))
    for text in (TEXT, "def the_return(x):\n    return x  # é ☃ 123456", "   spaces\t\ttabs\n\n"):
        assert theirs(text)["input_ids"] == tokenizer.encode(text, add_bos=True), text
    assert theirs.decode(tokenizer.encode(TEXT)) == TEXT
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode(TEXT, add_bos=True)])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_what_this_export_cannot_write_yet_is_named():
    _, c = parse_args(["--config", "ddp/adamw", *TINY])
    tokenizer = c.tokenizer.build(tokenizer_path=c.hf_assets_path)
    model = init_model(c.model, tokenizer.get_vocab_size(), True, torch.device("cpu"))
    assert _unsupported(model.config, "ar", tokenizer) is None
    assert _unsupported(model.config, "bert", tokenizer).startswith("objective 'bert'")


@pytest.mark.parametrize("objective", ["ar", "mdlm"])
def test_the_sandwich_flavor_exports_with_its_shipped_class_and_muloco_logits(objective, tmp_path, capsys):
    """The GPU presets' block (QK norms, post-attention and post-FFN norms): the folder ships
    modeling_muloco.py; transformers loads it (trust_remote_code) with muloco's logits, and it
    reads back bit for bit."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    from muloco.evaluate.source import from_hf_folder

    run = tmp_path / "run"
    proc = run_train(["--config", "ddp/adamw", *TINY, "--objective", objective,
                      "--model.flavor", "llama3-w64-d2-h2_qk_torch-rmsnorm_pa_pf", "--training.steps", "2",
                      "--checkpoint.interval", "2", "--validator.no-enable", "--dump_folder", str(run)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "hf"
    assert main([str(run), "--out", str(out)]) == 0, capsys.readouterr().err
    assert "trust_remote_code=True" in capsys.readouterr().out and (out / "modeling_muloco.py").is_file()
    written = json.loads((out / "config.json").read_text())
    assert (written["model_type"], written["bidirectional"]) == ("muloco", objective == "mdlm")
    model, *_ = load_model(run, load_config(run), None, torch.device("cpu"))
    auto = AutoModelForMaskedLM if objective == "mdlm" else AutoModelForCausalLM
    hf = auto.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    print(f"max |logit difference| muloco vs transformers, {objective} _qk_pa_pf: {diff:.3g}")
    assert diff <= 1e-4
    back = from_hf_folder(out, torch.device("cpu")).model.state_dict()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def _hf_load(folder: Path, flavor: str, vocab: int) -> dict[str, torch.Tensor]:
    """A fresh model of ``flavor`` loaded from ``folder`` the way the checkpointer loads an
    initial Hugging Face checkpoint (the spec's adapter, DCP's Hugging Face reader)."""
    import torch.distributed.checkpoint as dcp

    from muloco.models import build_model_config, hf_adapter

    _, c = parse_args(["--config", "ddp/adamw", "--model.flavor", flavor])
    model = init_model(c.model, vocab, True, torch.device("cpu"))
    adapter = hf_adapter(c.model)(build_model_config(c.model, vocab, True), str(folder))
    hf_state = adapter.to_hf(model.state_dict())
    dcp.load(hf_state, storage_reader=adapter.get_hf_storage_reader(str(folder)), no_dist=True)
    return adapter.from_hf(hf_state)


def test_export_then_import_gives_the_parameters_bit_for_bit_and_a_run_started_from_it_trains_alike(
        ar_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main([str(ar_run), "--out", str(out)]) == 0, capsys.readouterr().err
    config = load_config(ar_run)
    model, tokenizer, _, _, _ = load_model(ar_run, config, None, torch.device("cpu"))
    loaded = _hf_load(out, "llama3-w64-d2-h2", tokenizer.get_vocab_size())
    source = model.state_dict()
    assert loaded.keys() == source.keys()
    assert all(torch.equal(loaded[k], source[k]) for k in source), "the round trip changed a parameter"

    def losses(initial: list[str], name: str) -> dict[int, float]:
        run = tmp_path / name
        proc = run_train(["--config", "ddp/adamw", *TINY, "--training.steps", "3", "--metrics.log_freq", "1",
                          "--validator.no-enable", "--checkpoint.interval", "1000", "--checkpoint.initial_load_model_only",
                          *initial, "--dump_folder", str(run)])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    from_hf = losses(["--checkpoint.initial_load_path", str(out), "--checkpoint.initial_load_in_hf"], "from-hf")
    from_muloco = losses(["--checkpoint.initial_load_path", str(ar_run / "checkpoint" / "step-4")], "from-dcp")
    assert from_hf == from_muloco and len(from_hf) == 3, (from_hf, from_muloco)


def test_a_hugging_face_folder_of_another_shape_is_one_error_naming_the_difference(ar_run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main([str(ar_run), "--out", str(out)]) == 0
    proc = run_train(["--config", "ddp/adamw", *TINY, "--model.flavor", "llama3-w128-d4-h2",
                      "--checkpoint.initial_load_path", str(out), "--checkpoint.initial_load_in_hf",
                      "--checkpoint.initial_load_model_only", "--dump_folder", str(tmp_path / "run")])
    assert proc.returncode != 0 and "hidden_size is 64 there and 128 here" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setup, expected", [
    ("missing", "holds no config.json"),
    ("small-vocab", "the tokenizer's ids need 2048 embedding rows and the folder's model has 256"),
    ("rope-scaling", "RoPE has 'llama3' scaling"),
    ("llada-bias", "LLaDA option include_bias=True"),
])
def test_an_hf_flavor_whose_folder_cannot_be_built_is_one_config_error(tmp_path, setup, expected):
    from muloco.config.checks import check_config
    from muloco.config.loader import ConfigError

    folder = tmp_path / "hf"
    if setup != "missing":
        folder.mkdir()
        config = {"model_type": "llama", "vocab_size": 256 if setup == "small-vocab" else 4096, "hidden_size": 64,
                  "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
        if setup == "rope-scaling":
            config["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
        if setup == "llada-bias":
            config = {"model_type": "llada", "d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_hidden_size": 96,
                      "vocab_size": 4096, "include_bias": True}
        (folder / "config.json").write_text(json.dumps(config))
    _, c = parse_args(["--config", "ddp/adamw", *TINY, "--model.flavor", f"hf:{folder}"])
    with pytest.raises(ConfigError, match=expected) as err:
        check_config(c)
    assert str(err.value).startswith(f"model.flavor hf:{folder}") and "\n" not in str(err.value)


def test_an_hf_flavor_fits_a_folder_whose_tokenizer_had_no_mask_token(tmp_path):
    """A Llama folder uses every embedding row; muloco adds a mask id after them, which a
    next-token run never feeds, so it fits; a masked-diffusion run needs that row and is refused,
    as is one whose mask token is not the one config.json says the model was trained with."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from muloco.config.checks import check_config
    from muloco.config.loader import ConfigError

    folder = tmp_path / "hf"
    folder.mkdir()
    vocab = {"<s>": 0, "</s>": 1, **{chr(97 + i): 2 + i for i in range(26)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(folder / "tokenizer.json"))
    config = {"model_type": "llama", "vocab_size": 28, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    (folder / "config.json").write_text(json.dumps(config))
    flags = [*TINY, "--model.flavor", f"hf:{folder}", "--tokenizer.path", str(folder)]
    _, c = parse_args(["--config", "ddp/adamw", *flags])
    check_config(c)  # 28 rows, BOS 0, EOS 1, the added mask 28: fits a next-token run
    _, c = parse_args(["--config", "ddp/adamw", *flags, "--objective", "mdlm"])
    with pytest.raises(ConfigError, match="need 29 embedding rows and the folder's model has 28"):
        check_config(c)
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 29, "mask_token_id": 5}))
    with pytest.raises(ConfigError, match="masks with id 5 and the tokenizer's mask token is 28"):
        check_config(c)


TINY_LLAMA = dict(vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
"""No model-map flavor has these shapes (grouped-query heads, another FFN size, RoPE base and norm
epsilon, a tied head): the run takes them from the folder with ``--model.flavor hf:DIR``."""


@pytest.fixture(scope="module")
def diloco_from_llama(tmp_path_factory) -> tuple[Path, Path]:
    """(a Llama built and saved with transformers, no hub; a K=2 MuLoCo run of its shapes started from it).
    Its outer learning rate of 1e-30 moves no weight by a bit (every update is below half an
    ulp), so the θ_g the run ends with is the one it started from."""
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("from-llama")
    folder, run = root / "tiny-llama", root / "run"
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(str(folder))
    proc = subprocess.run([sys.executable, "-m", "muloco.launch.local", "--config", "diloco/muloco", "--replicas", "2",
                           "--", *TINY, "--training.steps", "2", "--outer.sync_every", "1", "--outer.optimizer.lr", "1e-30",
                           "--metrics.log_freq", "1", "--validator.no-enable", "--checkpoint.interval", "2",
                           "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
                           "--checkpoint.initial_load_model_only", "--model.flavor", f"hf:{folder}",
                           "--dump_folder", str(run)],
                          capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder, run


def test_a_transformers_llama_starts_a_k2_muloco_run_whose_theta_g_starts_from_it(diloco_from_llama):
    """Not from the fresh weights the run was built with before torchtitan loaded the folder."""
    from muloco.export import global_fingerprint

    folder, run = diloco_from_llama
    _, c = parse_args(["--config", "ddp/adamw", *TINY, "--model.flavor", f"hf:{folder}"])
    model = init_model(c.model, 2048, True, torch.device("cpu"))
    model.load_state_dict(_hf_load(folder, f"hf:{folder}", 2048))
    assert model.layers["0"].attention.n_kv_heads == 2 and model.lm_head.weight is model.tok_embeddings.weight
    for r in (0, 1):
        summary = json.loads((run / f"replica_{r}" / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["diloco"]["syncs_committed"] == 2
        assert summary["diloco"]["final_global_sha256"] == global_fingerprint(model), "θ_g did not start from the folder"


def test_a_diloco_run_exports_theta_g_with_the_fingerprint_the_run_recorded(diloco_from_llama, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from muloco.export import global_fingerprint

    _, run = diloco_from_llama
    out = tmp_path / "hf"
    assert main([str(run), "--out", str(out), "--replica", "1"]) == 0, capsys.readouterr().err
    recorded = json.loads((run / "replica_1" / "summary.json").read_text())["diloco"]["final_global_sha256"]
    card = (out / "README.md").read_text()
    assert f"θ_g sha256: `{recorded}`" in card and "K=2 replica groups, H=1" in card
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    config = load_config(run / "replica_0")
    model, _, _, _, is_global = load_model(run / "replica_0", config, None, torch.device("cpu"))
    assert is_global and global_fingerprint(model) == recorded  # both replicas hold one θ_g
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_push_to_hub_uploads_the_folder_in_one_commit_with_the_token_from_the_environment(ar_run, tmp_path, capsys,
                                                                                          monkeypatch):
    """The Hub is a local stand-in at its HTTP boundary (tests/hub_stub.py); the token reaches it and
    nothing else: not the output, not the folder."""
    import os
    import subprocess
    import sys

    from conftest import REPO
    from hub_stub import HubStub

    token = "hf_test_token_not_real"
    out = tmp_path / "hf"
    with HubStub() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": token, "HF_HUB_DISABLE_TELEMETRY": "1",
               "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-m", "muloco.export", str(ar_run), "--out", str(out),
                               "--push-to-hub", "me/tiny-llama", "--private"], capture_output=True, text=True,
                              env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"pushed to the Hub as me/tiny-llama: {hub.url}/me/tiny-llama/commit/" in proc.stdout
    assert not hub.unexpected and hub.created[0]["visibility"] == "private" and len(hub.cards) == 1
    assert hub.authorizations == {f"Bearer {token}"}
    local = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert hub.files["me/tiny-llama"] == local and "model.safetensors" in local
    assert token not in proc.stdout + proc.stderr and not any(token.encode() in b for b in local.values())

    with HubStub() as hub:  # --private onto a repository that exists and is public: refused, nothing sent
        hub.public.add("me/public-one")
        env = {**env, "HF_ENDPOINT": hub.url}
        proc = subprocess.run([sys.executable, "-m", "muloco.export", str(ar_run), "--out", str(tmp_path / "again"),
                               "--push-to-hub", "me/public-one", "--private"], capture_output=True, text=True,
                              env=env, timeout=300)
    assert proc.returncode == 2 and "exists and is public" in proc.stderr and not hub.files, proc.stderr[-2000:]

    monkeypatch.delenv("HF_TOKEN", raising=False)  # no token: one error before anything is written
    assert main([str(ar_run), "--out", str(tmp_path / "none"), "--push-to-hub", "me/tiny-llama"]) == 2
    assert "export HF_TOKEN=" in capsys.readouterr().err and not (tmp_path / "none").exists()


def _llada_folder(llama: Path, out: Path) -> Path:
    """A LLaDA-style folder (LLaDA's config keys and weight names, its mask token) holding the
    weights of the transformers Llama in ``llama``."""
    from safetensors.torch import load_file, save_file

    from muloco.compat.llada import to_llada_names
    from muloco.data.tokenizer import MulocoTokenizer

    out.mkdir()
    t = TINY_LLAMA
    (out / "config.json").write_text(json.dumps({
        "model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": t["hidden_size"],
        "n_layers": t["num_hidden_layers"], "n_heads": t["num_attention_heads"], "n_kv_heads": t["num_key_value_heads"],
        "mlp_hidden_size": t["intermediate_size"], "vocab_size": t["vocab_size"], "embedding_size": t["vocab_size"],
        "rms_norm_eps": t["rms_norm_eps"], "rope_theta": t["rope_theta"], "weight_tying": t["tie_word_embeddings"],
        "max_sequence_length": 64, "include_bias": False, "activation_type": "silu", "layer_norm_type": "rms",
        "block_type": "llama", "rope": True, "alibi": False, "mask_token_id": MulocoTokenizer().mask_id}))
    save_file(to_llada_names(load_file(str(llama / "model.safetensors"))), str(out / "model.safetensors"))
    return out


def test_a_llada_style_folder_starts_a_k2_mdlm_muloco_run_whose_theta_g_is_its_weights(diloco_from_llama, tmp_path):
    """LLaDA's names and config keys map onto the same Llama: the run's θ_g (outer lr 1e-30) is
    bit for bit the Llama folder's weights, read through LLaDA's names."""
    import subprocess
    import sys

    from muloco.export import global_fingerprint

    llama, _ = diloco_from_llama
    folder, run = _llada_folder(llama, tmp_path / "llada"), tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "muloco.launch.local", "--config", "diloco/muloco", "--replicas", "2",
                           "--", *TINY, "--objective", "mdlm", "--training.steps", "2", "--outer.sync_every", "1",
                           "--outer.optimizer.lr", "1e-30", "--validator.no-enable", "--checkpoint.interval", "2",
                           "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_in_hf",
                           "--checkpoint.initial_load_model_only", "--model.flavor", f"hf:{folder}",
                           "--dump_folder", str(run)], capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _, c = parse_args(["--config", "ddp/adamw", *TINY, "--model.flavor", f"hf:{llama}"])
    model = init_model(c.model, 2048, True, torch.device("cpu"))
    model.load_state_dict(_hf_load(llama, f"hf:{llama}", 2048))
    for r in (0, 1):
        summary = json.loads((run / f"replica_{r}" / "summary.json").read_text())
        assert summary["diloco"]["final_global_sha256"] == global_fingerprint(model)
    proc = run_train(["--config", "ddp/adamw", *TINY, "--checkpoint.initial_load_path", str(folder),
                      "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_model_only",
                      "--dump_folder", str(tmp_path / "wrong")])  # a model-map flavor cannot read LLaDA's names
    assert proc.returncode != 0 and f"--model.flavor hf:{folder}" in proc.stderr, proc.stderr[-2000:]


def test_a_qk_norm_run_exports_as_qwen3_and_a_qwen3_folder_reads_back_as_the_same_model(tmp_path, capsys):
    """The _qk_torch-rmsnorm flavors are Qwen3's attention: export writes Qwen3ForCausalLM, which
    transformers loads with muloco's logits; read back through hf:DIR (the adapter's inverse),
    the weights are bit for bit the run's; a Qwen3 folder built by transformers (head_dim 32 ≠
    64/4, grouped-query heads, tied head) scores with transformers' logits."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from muloco.evaluate.source import from_hf_folder

    run = tmp_path / "run"
    proc = run_train(["--config", "ddp/adamw", *TINY, "--model.flavor", "llama3-w64-d2-h2_qk_torch-rmsnorm",
                      "--training.steps", "2", "--checkpoint.interval", "2", "--validator.no-enable",
                      "--dump_folder", str(run)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "hf"
    assert main([str(run), "--out", str(out)]) == 0, capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    model, *_ = load_model(run, load_config(run), None, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    back = from_hf_folder(out, torch.device("cpu")).model.state_dict()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())

    qwen = tmp_path / "qwen3"
    Qwen3ForCausalLM(Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
                                 tie_word_embeddings=True)).save_pretrained(str(qwen))
    (qwen / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    hf = AutoModelForCausalLM.from_pretrained(str(qwen), dtype=torch.float32).eval()
    ours = from_hf_folder(qwen, torch.device("cpu")).model
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    print(f"max |logit difference| muloco vs transformers, Qwen3 folder: {diff:.3g}")
    assert diff <= 1e-4
