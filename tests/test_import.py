"""Starting from Hugging Face folders: a folder's own shapes (``--model.flavor hf:DIR``) for a
transformers-built Llama no flavor matches, a LLaDA-style folder and a Qwen3 folder; a DiLoCo run
started from one has the folder's weights as θ_g bit for bit and exports them; what cannot be built
is one config error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_train, run_watched

from muloco import compat

compat.apply()

from muloco.config.cli import parse_args  # noqa: E402
from muloco.export.__main__ import main  # noqa: E402
from muloco.models import init_model  # noqa: E402
from muloco.trained_model import load_config, load_model  # noqa: E402

pytestmark = pytest.mark.timeout(900)  # hang timeouts: several trainings on 2 cores


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


@pytest.mark.parametrize(
    "setup, expected",
    [
        ("missing", "holds no config.json"),
        ("small-vocab", "the tokenizer's ids need 2048 embedding rows and the folder's model has 256"),
        ("rope-scaling", "RoPE has 'yarn' scaling; muloco computes plain RoPE and Llama 3's"),
        ("rope-scaling-beside-default-parameters", "RoPE has 'yarn' scaling"),
        ("llama3-scaling-without-factor", "its llama3 RoPE scaling gives no factor"),
        ("another-family", "model_type is 'gemma2': the folders that load are Llama 2/3/3.1/3.2/3.3 .*Qwen2/Qwen2.5"),
        ("llama-attention-bias", "attention_bias is True there.*Qwen2's biases on q/k/v only load from a qwen2 folder"),
        ("heads-do-not-split-the-width", "hidden_size 64 is not a multiple of num_attention_heads 3"),
        (
            "heads-do-not-split-the-width-head-dim-given",
            "hidden_size 128 is not a multiple of num_attention_heads 3: "
            "transformers refuses such a config .* never be exported",
        ),
        ("kv-heads-do-not-group", "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        ("llada-bias", "LLaDA option include_bias=True"),
    ],
)
def test_an_hf_flavor_whose_folder_cannot_be_built_is_one_config_error(tmp_path, setup, expected):
    from muloco.config.checks import check_config
    from muloco.config.loader import ConfigError

    folder = tmp_path / "hf"
    if setup != "missing":
        folder.mkdir()
        config = {
            "model_type": "llama",
            "vocab_size": 256 if setup == "small-vocab" else 4096,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        }
        if setup.startswith("rope-scaling"):
            config["rope_scaling"] = {"rope_type": "yarn", "factor": 8.0}
        if setup == "llama3-scaling-without-factor":
            config["rope_scaling"] = {"rope_type": "llama3"}
        if setup == "another-family":
            config["model_type"] = "gemma2"
        if setup == "llama-attention-bias":
            config["attention_bias"] = True
        if setup == "rope-scaling-beside-default-parameters":
            config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
        if setup == "heads-do-not-split-the-width":
            config["num_attention_heads"] = 3
        if setup == "heads-do-not-split-the-width-head-dim-given":  # transformers' LlamaConfig refuses it too
            config.update(hidden_size=128, num_attention_heads=3, num_key_value_heads=3, head_dim=64)
        if setup == "kv-heads-do-not-group":
            config["num_key_value_heads"] = 3
        if setup == "llada-bias":
            config = {
                "model_type": "llada",
                "d_model": 64,
                "n_layers": 2,
                "n_heads": 4,
                "mlp_hidden_size": 96,
                "vocab_size": 4096,
                "include_bias": True,
            }
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
    config = {
        "model_type": "llama",
        "vocab_size": 28,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
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


TINY_LLAMA = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
"""No model-map flavor has these shapes (grouped-query heads, another FFN size, RoPE base and norm
epsilon, a tied head): the run takes them from the folder with ``--model.flavor hf:DIR``."""


@pytest.fixture(scope="module")
def diloco_from_llama(tmp_path_factory) -> tuple[Path, Path]:
    """(a Llama built and saved with transformers, no hub; a K=2 MuLoCo run of its shapes started from it).
    Its outer learning rate of 1e-30 moves no weight by a bit (every update is below half an
    ulp), so the θ_g the run ends with is the one it started from."""
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("from-llama")
    folder, run = root / "tiny-llama", root / "run"
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(str(folder))
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
            "--outer.optimizer.lr",
            "1e-30",
            "--metrics.log_freq",
            "1",
            "--validator.no-enable",
            "--checkpoint.interval",
            "2",
            "--checkpoint.initial_load_path",
            str(folder),
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
            "--model.flavor",
            f"hf:{folder}",
            "--dump_folder",
            str(run),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder, run


def test_a_transformers_llama_starts_a_k2_muloco_run_whose_theta_g_starts_from_it(diloco_from_llama):
    """Not from the fresh weights the run was built with before torchtitan loaded the folder."""
    from muloco.export.folder import global_fingerprint

    folder, run = diloco_from_llama
    _, c = parse_args(["--config", "ddp/adamw", *TINY, "--model.flavor", f"hf:{folder}"])
    model = init_model(c.model, 2048, True, torch.device("cpu"))
    model.load_state_dict(_hf_load(folder, f"hf:{folder}", 2048))
    assert model.layers["0"].attention.n_kv_heads == 2 and model.lm_head.weight is model.tok_embeddings.weight
    for r in (0, 1):
        summary = json.loads((run / f"replica_{r}" / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["diloco"]["syncs_committed"] == 2
        assert summary["diloco"]["final_global_sha256"] == global_fingerprint(model), (
            "θ_g did not start from the folder"
        )


def test_a_diloco_run_exports_theta_g_with_the_fingerprint_the_run_recorded(diloco_from_llama, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from muloco.export.folder import global_fingerprint

    _, run = diloco_from_llama
    out = tmp_path / "hf"
    assert main([str(run), "--out", str(out), "--replica", "1"]) == 0, capsys.readouterr().err
    recorded = json.loads((run / "replica_1" / "summary.json").read_text())["diloco"]["final_global_sha256"]
    card = (out / "README.md").read_text()
    assert f"θ_g sha256: `{recorded}`" in card and "K=2 replica groups, H=1" in card
    assert "fault_tolerance" not in card and "  - diloco" in card  # the user's overrides, not the launcher's
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    config = load_config(run / "replica_0")
    model, _, _, _, is_global = load_model(run / "replica_0", config, None, torch.device("cpu"))
    assert is_global and global_fingerprint(model) == recorded  # both replicas hold one θ_g
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def _llada_folder(llama: Path, out: Path) -> Path:
    """A LLaDA-style folder (LLaDA's config keys and weight names, its mask token) holding the
    weights of the transformers Llama in ``llama``."""
    from safetensors.torch import load_file, save_file

    from muloco.data.tokenizer import MulocoTokenizer
    from muloco.hf.llada import to_llada_names

    out.mkdir()
    t = TINY_LLAMA
    (out / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llada",
                "architectures": ["LLaDAModelLM"],
                "d_model": t["hidden_size"],
                "n_layers": t["num_hidden_layers"],
                "n_heads": t["num_attention_heads"],
                "n_kv_heads": t["num_key_value_heads"],
                "mlp_hidden_size": t["intermediate_size"],
                "vocab_size": t["vocab_size"],
                "embedding_size": t["vocab_size"],
                "rms_norm_eps": t["rms_norm_eps"],
                "rope_theta": t["rope_theta"],
                "weight_tying": t["tie_word_embeddings"],
                "max_sequence_length": 64,
                "include_bias": False,
                "activation_type": "silu",
                "layer_norm_type": "rms",
                "block_type": "llama",
                "rope": True,
                "alibi": False,
                "mask_token_id": MulocoTokenizer().mask_id,
            }
        )
    )
    save_file(to_llada_names(load_file(str(llama / "model.safetensors"))), str(out / "model.safetensors"))
    return out


def test_a_llada_style_folder_starts_a_k2_mdlm_muloco_run_whose_theta_g_is_its_weights(diloco_from_llama, tmp_path):
    """LLaDA's names and config keys map onto the same Llama: the run's θ_g (outer lr 1e-30) is
    bit for bit the Llama folder's weights, read through LLaDA's names."""
    import sys

    from muloco.export.folder import global_fingerprint

    llama, _ = diloco_from_llama
    folder, run = _llada_folder(llama, tmp_path / "llada"), tmp_path / "run"
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
            "--objective",
            "mdlm",
            "--training.steps",
            "2",
            "--outer.sync_every",
            "1",
            "--outer.optimizer.lr",
            "1e-30",
            "--validator.no-enable",
            "--checkpoint.interval",
            "2",
            "--checkpoint.initial_load_path",
            str(folder),
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
            "--model.flavor",
            f"hf:{folder}",
            "--dump_folder",
            str(run),
        ]
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _, c = parse_args(["--config", "ddp/adamw", *TINY, "--model.flavor", f"hf:{llama}"])
    model = init_model(c.model, 2048, True, torch.device("cpu"))
    model.load_state_dict(_hf_load(llama, f"hf:{llama}", 2048))
    for r in (0, 1):
        summary = json.loads((run / f"replica_{r}" / "summary.json").read_text())
        assert summary["diloco"]["final_global_sha256"] == global_fingerprint(model)
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--checkpoint.initial_load_path",
            str(folder),
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_model_only",
            "--dump_folder",
            str(tmp_path / "wrong"),
        ]
    )  # a model-map flavor cannot read LLaDA's names
    assert proc.returncode != 0 and f"--model.flavor hf:{folder}" in proc.stderr, proc.stderr[-2000:]


def test_a_qk_norm_run_exports_as_qwen3_and_a_qwen3_folder_reads_back_as_the_same_model(tmp_path, capsys):
    """The _qk_torch-rmsnorm flavors are Qwen3's attention: export writes Qwen3ForCausalLM, which
    transformers loads with muloco's logits; read back through hf:DIR (the adapter's inverse),
    the weights are bit for bit the run's; a Qwen3 folder built by transformers (head_dim 32 ≠
    64/4, grouped-query heads, tied head) scores with transformers' logits."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from muloco.evaluate.source import from_hf_folder

    run = tmp_path / "run"
    proc = run_train(
        [
            "--config",
            "ddp/adamw",
            *TINY,
            "--model.flavor",
            "llama3-w64-d2-h2_qk_torch-rmsnorm",
            "--training.steps",
            "2",
            "--checkpoint.interval",
            "2",
            "--validator.no-enable",
            "--dump_folder",
            str(run),
        ]
    )
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
    Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=2048,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rope_theta=1e6,
            tie_word_embeddings=True,
        )
    ).save_pretrained(str(qwen))
    (qwen / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    hf = AutoModelForCausalLM.from_pretrained(str(qwen), dtype=torch.float32).eval()
    ours = from_hf_folder(qwen, torch.device("cpu")).model
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    print(f"max |logit difference| muloco vs transformers, Qwen3 folder: {diff:.3g}")
    assert diff <= 1e-4


def test_a_full_vocabulary_takes_one_of_its_reserved_tokens_as_the_mask(tmp_path):
    """Llama 3's tokenizer fills its embedding (128,256 ids, reserved special tokens among them):
    an added <|mask|> has no row, so a masked-diffusion run names a reserved token as its mask."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from muloco.config.checks import check_config
    from muloco.config.loader import ConfigError
    from muloco.data.tokenizer import MulocoTokenizer, TokenizerError

    folder = tmp_path / "hf"
    folder.mkdir()
    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, **{chr(97 + i): 2 + i for i in range(26)}}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens([AddedToken("<|reserved_special_token_0|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 29,
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
            }
        )
    )
    flags = [
        "--config",
        "ddp/adamw",
        *TINY,
        "--model.flavor",
        f"hf:{folder}",
        "--tokenizer.path",
        str(folder),
        "--objective",
        "mdlm",
    ]
    _, c = parse_args(flags)
    with pytest.raises(ConfigError, match=r"need 30 embedding rows .* --tokenizer.mask_token"):
        check_config(c)
    _, c = parse_args([*flags, "--tokenizer.mask_token", "<|reserved_special_token_0|>"])
    check_config(c)
    assert (
        MulocoTokenizer(MulocoTokenizer.Config(path=str(folder), mask_token="<|reserved_special_token_0|>")).mask_id
        == 28
    )
    with pytest.raises(TokenizerError, match=r"mask_token '<\|mask_me\|>' is not a special .*reserved_special_token_0"):
        MulocoTokenizer(MulocoTokenizer.Config(path=str(folder), mask_token="<|mask_me|>"))
    with pytest.raises(TokenizerError, match=r"mask_token 'a' is not a special \(added\) token"):
        MulocoTokenizer(MulocoTokenizer.Config(path=str(folder), mask_token="a"))
